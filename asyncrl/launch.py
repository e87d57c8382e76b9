"""`asyncrl-launch`: start (or join) a cluster from a Hydra config and run its job.

    asyncrl-launch --config-name smoke                       # embedded: one machine, everything
    asyncrl-launch --config-name smoke cluster.nnodes=2 cluster.host=10.0.0.1 cluster.port=29400
    asyncrl-launch --config-name smoke cluster.coordinator=10.0.0.1:29400 cluster.node_rank=1
    asyncrl-launch --config-name cluster daemon              # long-running daemon (systemd)

Node 0 (no `cluster.coordinator`) hosts the coordinator, waits for `cluster.nnodes` nodes,
runs the job's `async def main(ctx)` and tears everything down; other nodes run a node daemon
until the coordinator releases them. Exit status is non-zero when the job fails.

Each job gets an id (`smoke-3fa2c1`): its state file (`asyncrl status|stop --job ID`) and its
worker logs (`<cluster.log_dir>/<id>/`) are its own, so jobs on one machine never share either.
A daemon runs submitted jobs side by side; `asyncrl stop` ends one of them, `asyncrl shutdown`
the daemon (exit status `SHUTDOWN_EXIT`, so systemd's `Restart=on-failure` brings it back).
"""

# ruff: noqa: E402  (the allocator settings come before the imports that load torch)
from __future__ import annotations

import os
import sys

from daemons.proc import with_allocator_settings

if __name__ == "__main__":  # `python -m asyncrl.launch`: as `asyncrl-launch` (asyncrl.cli.launch), before torch loads
    with_allocator_settings(os.environ)  # type: ignore[arg-type]
# torch reads its allocator settings (`daemons.proc.ALLOCATOR_ENV`) as it first allocates, which the
# imports below do: a launcher whose torch loaded with them forks its CPU node's fork server (`_fork_server`)
_LOADS_AS_A_FORK_SERVER = "torch" not in sys.modules and with_allocator_settings(dict(os.environ)) == dict(os.environ)

import argparse
import importlib
import itertools
import logging
import secrets
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from asyncrl.errors import AsyncRLError
from asyncrl.jobs.nodes import (
    check_config,
    run_head,
    run_node,
)
from asyncrl.metrics import json_line
from asyncrl.single_controller.schema import explain, job_schema, register_with_hydra
from daemons import forking
from daemons.errors import DaemonError
from daemons.logs import setup_logging
from daemons.node import discover_devices, fork_server_imports
from daemons.proc import exit_now
from daemons.slurm import check_gpus, cluster_overrides, job_keys, remove_job_keys, slurm_step
from transport import AuthenticationError, TransportError
from transport.checks import ConfigError
from transport.loop import run

log = logging.getLogger("asyncrl.launch")
_THREADS_AFTER_IMPORTS = forking.threads()  # torch's own idle one: a fresh fork server has it too

# configuration -----------------------------------------------------------------------------------
def shipped_config_dir() -> Path:
    """The configs that come with asyncrl: `configs/` of a checkout, or `asyncrl/configs` in a wheel."""
    installed = Path(__file__).resolve().parent / "configs"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "configs"


def _search_dirs(config_dir: str | None) -> list[Path]:
    shipped = shipped_config_dir()
    user = Path(config_dir).expanduser().resolve() if config_dir else None
    return [user, shipped] if user and user != shipped else [shipped]


def _config_files(dirs: list[Path]) -> dict[str, str]:
    """Config name (as Hydra reports it) -> the file it is read from (the first directory wins)."""
    files: dict[str, str] = {}
    for d in dirs:
        for p in sorted(d.rglob("*.yaml")):
            files.setdefault(str(p.relative_to(d).with_suffix("")), str(p))
    return files


def _hydra_overrides(dirs: list[Path], overrides: list[str]) -> list[str]:
    """The shipped configs stay on the search path (user configs inherit `rl_defaults`); Hydra's
    own logging setup is off (asyncrl's puts the role and rank in every line)."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    extra = []
    if len(dirs) > 1 and "hydra.searchpath" not in keys:
        extra.append(f"hydra.searchpath=[{','.join('file://' + str(d) for d in dirs[1:])}]")
    extra += [f"hydra/{k}=none" for k in ("job_logging", "hydra_logging") if f"hydra/{k}" not in keys]
    return extra + list(overrides)


def load_config(config_name: str, overrides: list[str], config_dir: str | None = None,
                daemon: bool = False) -> DictConfig:
    """Compose a config as `asyncrl-launch` does (with `daemon`: as `asyncrl-launch ... daemon`
    does) and check it against its schema.

    Raises `ConfigError` naming the bad key, where it was set and the closest valid key.
    """
    register_with_hydra()
    dirs = _search_dirs(config_dir)
    if not any((d / f"{config_name}.yaml").exists() for d in dirs):
        known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")} - {"rl_defaults"})
        raise ConfigError(f"no config named {config_name!r} in {', '.join(map(str, dirs))}; "
                          f"available: {', '.join(known)}")
    files = _config_files(dirs)
    try:
        with initialize_config_dir(config_dir=str(dirs[0]), version_base=None):
            cfg = compose(config_name=config_name, overrides=_hydra_overrides(dirs, overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e, None, files)) from None
    except (AttributeError, AssertionError) as e:  # OmegaConf: a dict merged into a null section
        raise ConfigError(_null_section(config_name, dirs, overrides, e)) from None
    if daemon:
        _daemon_size(cfg)
    check_config(cfg)
    return cfg


def _null_section(config_name: str, dirs: list[Path], overrides: list[str], error: Exception) -> str:
    """Why composing failed when an override sets fields of a section that is null in the config
    (OmegaConf cannot merge into it): the first such override, found by applying them in turn."""
    for i, override in enumerate(overrides):
        try:
            with initialize_config_dir(config_dir=str(dirs[0]), version_base=None):
                cfg = compose(config_name=config_name, overrides=_hydra_overrides(dirs, overrides[:i]))
        except Exception:  # noqa: BLE001 - an earlier override is the culprit; reported below
            break
        key, _, value = override.lstrip("+~").partition("=")
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            section = ".".join(parts[:n])
            sets_fields = n < len(parts) or value.lstrip().startswith("{")
            if sets_fields and OmegaConf.select(cfg, section, default=0) is None:
                return (f"cannot apply {override!r}: {section} is null in config {config_name!r}, and Hydra "
                        f"cannot set fields of a null section from the command line. Set the section in a "
                        f"YAML config of yours (e.g. a file with `defaults: [{config_name}, _self_]` and "
                        f"{section} given as a mapping), or start from a config that sets it")
    return f"cannot compose config {config_name!r} with {overrides}: {type(error).__name__}: {error}"


def _daemon_size(cfg: DictConfig) -> None:
    """A daemon cluster has no fixed size: nodes join whenever they start and nothing waits for
    `cluster.nnodes` of them, so any `cluster.node_rank` is a valid one (systemd's node units run
    `cluster.node_rank=K` with the shipped `nnodes: 1`)."""
    c = cfg.get("cluster")
    if c is not None and isinstance(c.get("node_rank"), int) and isinstance(c.get("nnodes"), int):
        with open_dict(cfg):
            c.nnodes = max(c.nnodes, c.node_rank + 1)


def _sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of a `-m` sweep as its own list of overrides: the product of the swept values
    (`lr=1e-3,1e-4`, `range(0,3)`, `choice(...)`), in the order Hydra's basic sweeper runs them."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
               else [o.input_line] for o in parsed]
    return [list(job) for job in itertools.product(*choices)]


def _override(overrides: list[str], key: str) -> str | None:
    """The value `overrides` give `key` (None when they do not set it)."""
    return next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{key}=")), None)


def _join_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """`--join HOST:PORT` taken out of the command line (Hydra does not know it)."""
    for i, a in enumerate(argv):
        if a == "--join" and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if a.startswith("--join="):
            return argv[:i] + argv[i + 1:], a.split("=", 1)[1]
    return argv, None


def args_parser() -> argparse.ArgumentParser:
    """Hydra's command-line flags (what `@hydra.main` accepts), parsed here first so that a bad
    config exits 2 before anything starts."""
    p = argparse.ArgumentParser(prog="asyncrl-launch", add_help=False,
                                description="Start (or join) a cluster from a Hydra config and run its job.")
    p.add_argument("overrides", nargs="*", help="key=value overrides (dots for nested keys)")
    # `--join HOST:PORT` (read before this parser): this machine joins a running job's cluster as a
    # new node (an elastic rollout pool starts workers on its devices)
    p.add_argument("--help", "-h", action="store_true", help="this program's help")
    p.add_argument("--hydra-help", action="store_true", help="Hydra's help")
    p.add_argument("--version", action="store_true", help="Hydra's version")
    p.add_argument("--cfg", "-c", choices=["job", "hydra", "all"], help="print the config instead of running")
    p.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations")
    p.add_argument("--package", "-p", help="with --cfg: the config package to print")
    p.add_argument("--run", "-r", action="store_true", help="run a job (the default)")
    p.add_argument("--multirun", "-m", action="store_true", help="run every job of a sweep, one after another")
    p.add_argument("--shell-completion", "-sc", action="store_true", help="Hydra's shell completion")
    p.add_argument("--config-path", "-cp", help="the primary config's directory")
    p.add_argument("--config-name", "-cn", help="the config to run (default: quickstart)")
    p.add_argument("--config-dir", "-cd", help="a directory of configs searched before the shipped ones")
    p.add_argument("--experimental-rerun", help="rerun a job from a previous config pickle")
    p.add_argument("--info", "-i", const="all", nargs="?",
                   choices=["all", "config", "defaults", "defaults-tree", "plugins", "searchpath"],
                   help="print Hydra information")
    return p


def main(argv: list[str] | None = None) -> int:
    """Hydra's command line (`--config-name`, `--config-dir`, `--cfg`, `--info`, `-m` sweeps run
    one after another, `hydra.run.dir`/`hydra.sweep.dir`), with configuration errors checked
    first: a bad key or value exits 2 naming it, before anything starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    daemon = "daemon" in argv
    argv = [a for a in argv if a != "daemon"]
    argv, join = _join_flag(argv)
    if join is not None:  # a node of its own for a running job: its coordinator, a node rank no one has
        rank = secrets.randbelow(1_000_000) + 1000
        argv += [f"cluster.coordinator={join}", f"cluster.node_rank={rank}", f"cluster.nnodes={rank + 1}",
                 "cluster.join=true"]
    args = args_parser().parse_args(argv)  # unknown flags exit 2 with argparse's message
    config_name = args.config_name or "quickstart"
    if args.help or args.hydra_help or args.version or args.shell_completion or args.experimental_rerun:
        try:
            _hydra(argv, args, config_name, daemon, [])
        except ConfigError as e:
            print(f"asyncrl-launch: {e}", file=sys.stderr)
            return 2
        return 0
    step = slurm_step()  # inside `srun`: the cluster flags come from SLURM's environment
    if step is not None and not (args.cfg or args.info):
        args.overrides = [*cluster_overrides(step, args.overrides), *args.overrides]
    made_keys = False
    try:
        if args.config_dir and not Path(args.config_dir).expanduser().is_dir():
            raise ConfigError(f"--config-dir {args.config_dir}: no such directory")
        jobs = _sweep(args.overrides) if args.multirun else [args.overrides]
        for overrides in jobs:
            cfg = load_config(config_name, overrides, args.config_dir, daemon)
            job = job_schema(OmegaConf.get_type(cfg))
            if step is not None:
                check_gpus(step, cfg.cluster.gpus_per_node, OmegaConf.select(cfg, "trainer.n_workers"))
            if not args.multirun and not args.cfg and job and job.preflight:
                # the job's own checks (the RL trainer's: run directory, model, data, reward files)
                head = cfg.cluster.coordinator is None and not args.info
                job.preflight(check_config(cfg), _override(overrides, "hydra.run.dir"), head)
        if step is not None and step.ntasks > 1 and not (args.cfg or args.info) and cfg.cluster.key_dir:
            made_keys = job_keys(step, cfg.cluster.key_dir)
    except ConfigError as e:
        print(f"asyncrl-launch: {e}", file=sys.stderr)
        return 2
    codes: list[int] = []
    try:
        _hydra(argv, args, config_name, daemon, codes)
    finally:
        if made_keys:
            remove_job_keys(step)
    return max(codes, default=0)


def _hydra(argv: list[str], args: argparse.Namespace, config_name: str, daemon: bool, codes: list[int]) -> None:
    """Hand the command line (`argv`, parsed as `args`) to Hydra's own runner; each job's exit
    code is appended to `codes`."""
    import hydra

    register_with_hydra()
    dirs = _search_dirs(args.config_dir)
    rest = [a for a in argv if a not in args.overrides]
    if args.config_dir is None:
        rest += ["--config-dir", str(dirs[0])]
    if args.config_name is None:
        rest += ["--config-name", config_name]

    @hydra.main(version_base=None, config_path=None, config_name=None)
    def task(cfg: DictConfig) -> None:
        codes.append(run_job(cfg, daemon))

    # @hydra.main reads sys.argv (its only public entry): it gets asyncrl-launch's command line
    # with the config directory, name and search path filled in, restored afterwards
    saved = sys.argv
    sys.argv = ["asyncrl-launch", *rest, *_hydra_overrides(dirs, args.overrides)]
    try:
        task()
    finally:
        sys.argv = saved


def run_job(cfg: DictConfig, daemon: bool = False) -> int:
    """One job of `asyncrl-launch`: its outputs go to Hydra's run (or sweep job) directory."""
    from hydra.core.hydra_config import HydraConfig

    if daemon:
        _daemon_size(cfg)  # as `main` checked it
    job = job_schema(OmegaConf.get_type(cfg))
    key = job.run_dir_key if job else None  # where the job writes its outputs
    if HydraConfig.initialized() and key:
        out = Path(HydraConfig.get().runtime.output_dir)
        with open_dict(cfg):  # hydra.run.dir / hydra.sweep.dir decide where a run writes
            OmegaConf.update(cfg, key, os.path.relpath(out) if out.is_relative_to(Path.cwd()) else str(out))
    try:  # `main` checked this config before Hydra ran it
        forked = _fork_server(cfg, daemon)
        setup_logging("coordinator" if cfg.cluster.coordinator is None else "node", cfg.cluster.node_rank)
        if forked:
            log.info("the CPU workers' fork server is this launcher, forked (pid %d): it imports only "
                     "what the launcher has not", forked)
        if cfg.cluster.coordinator is not None:
            return run(run_node(cfg, daemon=daemon))
        summary: list[Any] = []
        code = run(run_head(cfg, daemon=daemon, summary=summary))
        if summary and isinstance(summary[0], dict):  # the job's summary: the last line, after teardown's logs
            sys.stderr.flush()
            print(json_line(summary[0]), flush=True)
        return code
    except (ConfigError, DaemonError, AsyncRLError, TransportError) as e:
        print(f"asyncrl-launch: {e}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, AuthenticationError)) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the job's own failure: one line, then its traceback in the log above
        log.exception("job failed")
        print(f"asyncrl-launch: job failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _fork_server(cfg: DictConfig, daemon: bool) -> int | None:
    """Start this CPU node's fork server (`cluster.warm_imports`) as a fork of this process, before
    the job starts a thread: torch, hydra and (on the head) the driver's module, imported here
    already, are not imported again by the server (~7 s of CPU a launch on 2 cores). Otherwise
    (GPU nodes, a torch loaded without the workers' allocator settings, a native thread started
    since this module's imports) the node starts its own.
    The server's pid when it forked one."""
    c = cfg.cluster
    imports = fork_server_imports(discover_devices(c.cpu_devices, c.gpus_per_node), c.warm_imports)
    if not imports or not _LOADS_AS_A_FORK_SERVER:
        return None
    # asyncrl's own driver module only: a user's could start threads or register exit handlers
    # (the workers would run them), so the driver imports it as before
    module, _, _ = (cfg.job.entry or "").rpartition(":")
    if c.coordinator is None and not daemon and module.startswith("asyncrl."):
        try:
            importlib.import_module(module)
        except Exception:  # the driver's own import of it reports this (asyncrl.jobs.nodes.load_entry)
            pass
    if forking.threads() > _THREADS_AFTER_IMPORTS:  # a fork copies no thread, only the locks it holds
        return None
    return forking.start(imports, with_allocator_settings(dict(os.environ)), here=True)


def cli() -> None:
    """The `asyncrl-launch` command: `main`, then the process ends without the interpreter's
    teardown (about 1 s with torch loaded; workers and stores are closed by then)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
