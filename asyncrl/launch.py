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

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from asyncrl.errors import AsyncRLError
from asyncrl.metrics import json_line
from asyncrl.single_controller.config import LaunchConfig
from asyncrl.single_controller.context import JobContext
from asyncrl.single_controller.schema import explain, job_schema, register_with_hydra, typed
from daemons.cluster import ClusterSpec, HeadNode, NodeOnly
from daemons.coordinator import Coordinator
from daemons.errors import DaemonError, JobError
from daemons.logs import setup_logging
from daemons.state import StateKind, new_job_id, remove_state, state_for_this_process, write_state
from daemons.worker import entry_package, resolve
from transport import AuthenticationError, CurveConfig, TransportError
from transport.checks import ConfigError
from transport.loop import run
from transport.rpc import expose

log = logging.getLogger("asyncrl.launch")

# `asyncrl shutdown` ends a daemon with this status (EX_TEMPFAIL): not a crash, but not 0 either, so
# a service manager's restart-on-failure policy restarts it (`systemctl stop` is how it stays down)
SHUTDOWN_EXIT = 75


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


def check_config(cfg: DictConfig) -> Any:
    """Types and ranges of every section (the schemas' `check` methods); the typed config.

    A config whose YAML names no schema is a user's job with sections of its own: only what
    `asyncrl-launch` reads (cluster, worker, job, seed, objectstore) is checked."""
    kind = OmegaConf.get_type(cfg)
    if isinstance(kind, type) and issubclass(kind, LaunchConfig) and kind is not LaunchConfig:
        return typed(kind, cfg)
    return typed(LaunchConfig, {k: cfg[k] for k in ("cluster", "worker", "job", "seed", "objectstore") if k in cfg})


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


def security(cfg: DictConfig) -> tuple[CurveConfig | None, bool]:
    if cfg.cluster.insecure:
        return None, True
    if cfg.cluster.key_dir:
        return CurveConfig.load(cfg.cluster.key_dir), False
    return CurveConfig.ephemeral(), False


def load_entry(entry: str | None) -> Any:
    if not entry:
        raise ConfigError("job.entry is not set: give the driver as job.entry=package.module:main "
                          "or job.entry=path/to/script.py:main")
    path, sep, name = entry.rpartition(":")
    if sep and path.endswith(".py"):
        file = Path(path)
        if not file.exists():
            raise ConfigError(f"job.entry script {file} does not exist")
        spec = importlib.util.spec_from_file_location(file.stem, file)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(file.parent.resolve()))
        spec.loader.exec_module(module)
        fn = getattr(module, name, None)
        if fn is None:
            raise ConfigError(f"{file} defines no {name!r}")
        return fn
    return resolve(entry)


# roles --------------------------------------------------------------------------------------------
def cluster_spec(cfg: Any, daemon: bool = False, job_id: str | None = None) -> ClusterSpec:
    """This node's daemons as the `cluster` section (typed by `check_config`) describes them; the
    head writes its state file under `job_id` (the job's id, or the daemon's)."""
    cfg = check_config(cfg) if isinstance(cfg, DictConfig) else cfg
    curve, _ = security(cfg)
    return ClusterSpec(cluster=cfg.cluster.with_addresses(), curve=curve, extra_packages=(entry_package(cfg.job.entry),),
                       store_memory_limit=cfg.objectstore.memory_limit, write_state=True, job_id=job_id,
                       job_name=cfg.job.name, daemon=daemon)


def explain_bind(spec: ClusterSpec, daemon: bool) -> tuple[int, str]:
    """The log level and line that say where the coordinator listens and how to change it."""
    bind = spec.cluster.bind or spec.host
    if bind in ("0.0.0.0", "::", "*"):
        return logging.WARNING, (f"the coordinator listens on every interface ({bind}:{spec.cluster.port or 'any port'}, "
                                 "cluster.bind); only CurveZMQ keys keep strangers out: prefer the "
                                 "address the other nodes use (cluster.host=ADDRESS)")
    if bind.startswith("127.") or bind == "::1":
        if daemon:
            return logging.WARNING, (f"daemon mode: the coordinator listens on {bind} only (loopback), so "
                                     "no other machine can join or submit; set cluster.host=ADDRESS (the "
                                     "address other nodes reach) to serve a cluster")
        return logging.INFO, f"the coordinator listens on {bind} (loopback)"
    return logging.INFO, f"the coordinator listens on {bind} (cluster.bind / cluster.host)"


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_head(cfg: DictConfig, daemon: bool = False, summary: list | None = None) -> int:
    """Node 0: coordinator + node daemon + the driver (or, as a daemon, submitted jobs); the
    driver's result goes into `summary`."""
    stop = _stop_on_signals()
    job_id = new_job_id(cfg.job.name)
    # daemon nodes outlive a coordinator restart and re-register, so they are not released
    spec = cluster_spec(cfg, daemon, job_id)
    log.log(*explain_bind(spec, daemon))
    async with HeadNode.start(spec, release_nodes=not daemon) as head:
        coordinator = head.coordinator
        if daemon:
            service = JobService(coordinator, cfg, head)
            coordinator.server.register_object(service)
            log.info("daemon %s: jobs are submitted with `asyncrl submit`", job_id)
            await _wait_any(stop.wait(), coordinator.stop_requested.wait())
            await service.stop_all("the daemon is shutting down")
            if coordinator.stop_requested.is_set():
                log.warning("daemon stopped: %s; exit status %d", coordinator.stop_reason, SHUTDOWN_EXIT)
                return SHUTDOWN_EXIT
            return 0
        ctx = JobContext(coordinator, cfg, job_id)
        log.info("job %s: worker logs in %s", job_id, Path(cfg.cluster.log_dir) / job_id)
        stops = [stop, ctx.job.stopped, coordinator.stop_requested]
        try:
            t0 = time.monotonic()
            nodes = asyncio.ensure_future(coordinator.wait_for_nodes(cfg.cluster.nnodes, cfg.cluster.join_timeout_s))
            if await _unless_stopped(nodes, stops):
                nodes.result()
                # the driver's imports (torch, the trainer, transformers) off the loop: on it they
                # would stall heartbeats and the loop-lag warning would blame the user's code
                entry = await asyncio.to_thread(load_entry, cfg.job.entry)
                await ctx.open()
                driver = asyncio.get_running_loop().create_task(entry(ctx), name="driver")
                if await _unless_stopped(driver, stops):
                    result = driver.result()  # raises the driver's exception
                    log.info("job %s finished in %.1fs", cfg.job.name, time.monotonic() - t0)
                    if summary is not None:
                        summary.append(result)
                    return 0
            log.error("job stopped: %s (job %s)", ctx.job.stop_reason or coordinator.stop_reason or "signal",
                      job_id)
            return 1
        finally:
            await ctx.close()


class JobService:
    """The daemon's job endpoint: `asyncrl submit ENTRY` runs a job on the running cluster.

    Jobs run side by side, each with its own id, state file, log directory and workers; a job's
    end (or `asyncrl stop --job ID`) stops its workers only."""

    def __init__(self, coordinator: Coordinator, cfg: DictConfig, head: HeadNode) -> None:
        self.coordinator, self.cfg, self.head = coordinator, cfg, head

    @expose
    async def submit(self, entry: str, overrides: dict | None, job_id: str | None = None) -> Any:
        """Run `entry` with `overrides` merged over the daemon's config as job `job_id` (default:
        a new id); returns the driver's result. JobError when the job was stopped."""
        if self.coordinator.stop_requested.is_set():
            raise JobError("the daemon is shutting down; submit again once it is back")
        # a submitted job brings config sections of its own: merged as plain data, and a typed
        # job (the RL trainer) checks them against its schema when it starts
        job_cfg = OmegaConf.merge(OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True)),
                                  OmegaConf.create(overrides or {}), {"job": {"entry": entry}})
        fn = await asyncio.to_thread(load_entry, entry)  # its imports would stall the daemon's loop
        ctx = JobContext(self.coordinator, job_cfg, job_id)
        spec = self.head.spec
        try:
            write_state(state_for_this_process(self.head.endpoint, spec.curve is None,
                                               spec.curve.to_env() if spec.curve else None, ctx.job_id,
                                               ctx.name, StateKind.DAEMON_JOB), spec.state_dir)
            log.info("job %s (%s) started: worker logs in %s", ctx.job_id, entry,
                     Path(spec.cluster.log_dir) / ctx.job_id)
            await ctx.open()
            driver = asyncio.get_running_loop().create_task(fn(ctx), name=f"driver-{ctx.job_id}")
            if not await _unless_stopped(driver, [ctx.job.stopped]):
                raise JobError(f"job {ctx.job_id} stopped: {ctx.job.stop_reason}")
            result = driver.result()
            log.info("job %s finished", ctx.job_id)
            return result
        finally:
            await ctx.close()
            remove_state(ctx.job_id, spec.state_dir)

    async def stop_all(self, reason: str, timeout_s: float = 20.0) -> None:
        """Stop every running job and wait (up to `timeout_s`) until each has cleaned up."""
        for record in list(self.coordinator.jobs.values()):
            record.stop_reason = record.stop_reason or reason
            record.stopped.set()
        deadline = time.monotonic() + timeout_s
        while self.coordinator.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def _unless_stopped(task: asyncio.Future, stops: list[asyncio.Event]) -> bool:
    """Wait for `task` unless one of `stops` is set first, which cancels it. Whether it ended."""
    waiters = [asyncio.ensure_future(e.wait()) for e in stops]
    try:
        await asyncio.wait([task, *waiters], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    if task.done():
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def run_node(cfg: DictConfig, daemon: bool = False) -> int:
    """Node k > 0: a node daemon that serves the coordinator until released."""
    c = cfg.cluster
    stop = _stop_on_signals()
    spec = cluster_spec(cfg, daemon)
    try:
        node = await NodeOnly.launch(spec, wait_registered=None if daemon else c.join_timeout_s)
    except TimeoutError:
        raise ConfigError(
            f"could not join the coordinator at {c.coordinator} within {c.join_timeout_s:.0f}s: "
            "check cluster.coordinator (node 0's cluster.host:cluster.port), that node 0 is "
            "running, the firewall, and that both nodes use the same cluster.key_dir") from None
    try:
        if not daemon:
            log.info("node %d joined %s", c.node_rank, c.coordinator)
        await _wait_any(stop.wait(), node.daemon.stopped.wait())
        if node.daemon.stop_reason:
            print(f"asyncrl-launch: {node.daemon.stop_reason}", file=sys.stderr)
            return 1
        return 0
    finally:
        await node.stop()


async def _wait_any(*aws: Any) -> None:
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


def args_parser() -> argparse.ArgumentParser:
    """Hydra's command-line flags (what `@hydra.main` accepts), parsed here first so that a bad
    config exits 2 before anything starts."""
    p = argparse.ArgumentParser(prog="asyncrl-launch", add_help=False,
                                description="Start (or join) a cluster from a Hydra config and run its job.")
    p.add_argument("overrides", nargs="*", help="key=value overrides (dots for nested keys)")
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
    args = args_parser().parse_args(argv)  # unknown flags exit 2 with argparse's message
    config_name = args.config_name or "quickstart"
    if args.help or args.hydra_help or args.version or args.shell_completion or args.experimental_rerun:
        try:
            _hydra(argv, args, config_name, daemon, [])
        except ConfigError as e:
            print(f"asyncrl-launch: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        if args.config_dir and not Path(args.config_dir).expanduser().is_dir():
            raise ConfigError(f"--config-dir {args.config_dir}: no such directory")
        jobs = _sweep(args.overrides) if args.multirun else [args.overrides]
        for overrides in jobs:
            cfg = load_config(config_name, overrides, args.config_dir, daemon)
            job = job_schema(OmegaConf.get_type(cfg))
            if not args.multirun and not args.cfg and job and job.preflight:
                # the job's own checks (the RL trainer's: run directory, model, data, reward files)
                head = cfg.cluster.coordinator is None and not args.info
                job.preflight(check_config(cfg), _override(overrides, "hydra.run.dir"), head)
    except ConfigError as e:
        print(f"asyncrl-launch: {e}", file=sys.stderr)
        return 2
    codes: list[int] = []
    _hydra(argv, args, config_name, daemon, codes)
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
        setup_logging("coordinator" if cfg.cluster.coordinator is None else "node", cfg.cluster.node_rank)
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


if __name__ == "__main__":
    sys.exit(main())
