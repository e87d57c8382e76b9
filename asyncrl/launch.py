"""`asyncrl-launch`: start (or join) a cluster from a Hydra config and run its job.

    asyncrl-launch --config-name smoke                       # embedded: one machine, everything
    asyncrl-launch --config-name smoke cluster.nnodes=2 cluster.host=10.0.0.1 cluster.port=29400
    asyncrl-launch --config-name smoke cluster.coordinator=10.0.0.1:29400 cluster.node_rank=1
    asyncrl-launch --config-name cluster daemon              # long-running daemon (systemd)

Node 0 (no `cluster.coordinator`) hosts the coordinator, waits for `cluster.nnodes` nodes,
runs the job's `async def main(ctx)` and tears everything down; other nodes run a node daemon
until the coordinator releases them. Exit status is non-zero when the job fails.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from asyncrl.context import JobContext
from daemons.coordinator import Coordinator
from daemons.errors import ConfigError, DaemonError
from daemons.logs import setup_logging
from daemons.node import NodeDaemon
from daemons.proc import route_ip
from daemons.worker import resolve
from transport import AuthenticationError, CurveConfig, TransportError
from transport.loop import run

log = logging.getLogger("asyncrl.launch")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
STATE_DIR = Path(os.environ.get("ASYNCRL_STATE_DIR", Path.home() / ".asyncrl" / "state"))


@dataclass
class ClusterConfig:
    coordinator: str | None = None  # HOST:PORT of node 0's coordinator; None: this node hosts it
    port: int = 0  # coordinator port on node 0 (0 = any; set one for multi-node)
    node_rank: int = 0
    nnodes: int = 1
    host: str | None = None  # address this node binds and advertises; None = auto
    cpu_devices: int = 2  # CPU "devices" per node when there is no GPU
    key_dir: str | None = None  # CurveZMQ key dir (`asyncrl keys generate DIR`); None = ephemeral, one node only
    insecure: bool = False  # unauthenticated sockets: local tests only
    join_timeout_s: float = 60.0
    heartbeat_interval_s: float = 1.0
    node_timeout_s: float = 5.0
    log_dir: str = "outputs/logs"


@dataclass
class JobConfig:
    entry: str | None = None  # "package.module:main" or "path/to/script.py:main"
    name: str = "job"


# configuration -----------------------------------------------------------------------------------
def load_config(config_name: str, overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """Compose a Hydra config and check the launch sections against their schema."""
    directory = Path(config_dir or CONFIG_DIR).resolve()
    if not (directory / f"{config_name}.yaml").exists():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ConfigError(f"no config named {config_name!r} in {directory}; available: {', '.join(known)}")
    try:
        # schema keys a yaml leaves out (cluster.nnodes in smoke.yaml) are set with `++`
        schema = {f"{s}.{f.name}" for s, t in (("cluster", ClusterConfig), ("job", JobConfig)) for f in fields(t)}
        overrides = [f"++{o}" if o.split("=", 1)[0] in schema else o for o in overrides]
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        # cluster and job are checked against their schema; other sections belong to the job
        merged = cfg
        OmegaConf.set_struct(merged, False)
        merged.cluster = OmegaConf.merge(OmegaConf.structured(ClusterConfig), cfg.get("cluster") or {})
        merged.job = OmegaConf.merge(OmegaConf.structured(JobConfig), cfg.get("job") or {})
        OmegaConf.set_struct(merged, True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain_config_error(e, config_name)) from None
    if merged.cluster.nnodes < 1 or not 0 <= merged.cluster.node_rank < merged.cluster.nnodes:
        raise ConfigError(f"cluster.node_rank={merged.cluster.node_rank} must be in [0, cluster.nnodes="
                          f"{merged.cluster.nnodes})")
    if merged.cluster.nnodes > 1 and not merged.cluster.key_dir and not merged.cluster.insecure:
        raise ConfigError("a multi-node cluster needs shared keys: run `asyncrl keys generate DIR`, copy "
                          "DIR to every node and pass cluster.key_dir=DIR (or cluster.insecure=true on a "
                          "trusted test network)")
    return merged


def _explain_config_error(e: Exception, config_name: str) -> str:
    text = str(e).strip().splitlines()[0]
    hint = ("Check the spelling against configs/" + config_name + ".yaml; keys that do not exist "
            "there cannot be set (add them to the yaml, or prefix with + only if the job reads them).")
    return f"bad configuration: {text}. {hint}"


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
def _write_state(coordinator: Coordinator, curve: CurveConfig | None, advertised: str) -> Path:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / "coordinator.json"
    state = {"endpoint": advertised, "pid": os.getpid(), "insecure": curve is None,
             "curve": curve.to_env() if curve else None}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    return path


async def run_head(cfg: DictConfig, daemon: bool = False) -> int:
    """Node 0: coordinator + node daemon + the driver (or, as a daemon, submitted jobs)."""
    c = cfg.cluster
    curve, insecure = security(cfg)
    multi = c.nnodes > 1 or daemon
    host = c.host or ("127.0.0.1" if not multi else route_ip("192.0.2.1"))
    bind = "0.0.0.0" if multi and not c.host else host
    coordinator = Coordinator(f"tcp://{bind}:{c.port}", curve=curve, insecure=insecure,
                              node_timeout=c.node_timeout_s)
    await coordinator.start()
    port = coordinator.endpoint.rsplit(":", 1)[1]
    advertised = f"tcp://{host}:{port}"
    node = NodeDaemon(advertised, node_rank=0, host=host, cpu_devices=c.cpu_devices, curve=curve,
                      insecure=insecure, log_dir=c.log_dir, heartbeat_interval=c.heartbeat_interval_s,
                      coordinator_timeout=max(10.0, 2 * c.node_timeout_s))
    await node.start()
    state = _write_state(coordinator, curve, advertised)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("coordinator at %s (%s)", advertised, "insecure" if insecure else "CurveZMQ")
    ctx = None
    try:
        await node.wait_registered(30)
        if daemon:
            coordinator.server.register("submit", functools.partial(_submit, coordinator, cfg))
            await _wait_any(stop.wait(), coordinator.stop_requested.wait())
            return 0
        await coordinator.wait_for_nodes(c.nnodes, c.join_timeout_s)
        entry = load_entry(cfg.job.entry)
        ctx = await JobContext(coordinator, cfg).open()
        t0 = time.monotonic()
        driver = loop.create_task(entry(ctx), name="driver")
        await _wait_any(driver, stop.wait(), coordinator.stop_requested.wait())
        if not driver.done():
            driver.cancel()
            await asyncio.gather(driver, return_exceptions=True)
            log.error("job stopped: %s", coordinator.stop_reason or "signal")
            return 1
        result = driver.result()  # raises the driver's exception
        log.info("job %s finished in %.1fs", cfg.job.name, time.monotonic() - t0)
        if isinstance(result, dict):  # the job's summary is the last line on stdout
            print(json.dumps(result), flush=True)
        return 0
    finally:
        if ctx is not None:
            await ctx.close()
        await coordinator.shutdown_workers()
        if not daemon:  # daemon nodes outlive a coordinator restart and re-register
            await coordinator.shutdown_nodes()
        await node.close()
        await coordinator.close()
        state.unlink(missing_ok=True)


async def _submit(coordinator: Coordinator, cfg: DictConfig, entry: str, overrides: dict | None) -> Any:
    with open_dict(cfg):  # a submitted job may bring config sections the daemon's config lacks
        job_cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides or {}))
    fn = load_entry(entry)
    ctx = await JobContext(coordinator, job_cfg).open()
    try:
        return await fn(ctx)
    finally:
        await ctx.close()
        await coordinator.shutdown_workers()


async def run_node(cfg: DictConfig, daemon: bool = False) -> int:
    """Node k > 0: a node daemon that serves the coordinator until released."""
    c = cfg.cluster
    curve, insecure = security(cfg)
    coord_host = c.coordinator.rsplit(":", 1)[0]
    host = c.host or route_ip(coord_host)
    node = NodeDaemon(f"tcp://{c.coordinator}", node_rank=c.node_rank, host=host, cpu_devices=c.cpu_devices,
                      curve=curve, insecure=insecure, log_dir=c.log_dir,
                      heartbeat_interval=c.heartbeat_interval_s,
                      coordinator_timeout=max(10.0, 2 * c.node_timeout_s))
    await node.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if not daemon:
            try:
                await node.wait_registered(c.join_timeout_s)
            except TimeoutError:
                raise ConfigError(
                    f"could not join the coordinator at {c.coordinator} within {c.join_timeout_s:.0f}s: "
                    "check cluster.coordinator (node 0's cluster.host:cluster.port), that node 0 is "
                    "running, the firewall, and that both nodes use the same cluster.key_dir") from None
            log.info("node %d joined %s", c.node_rank, c.coordinator)
        await _wait_any(stop.wait(), node.stopped.wait())
        return 0
    finally:
        await node.close()


async def _wait_any(*aws: Any) -> None:
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            if not t.done() and t.get_name() != "driver":
                t.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl-launch", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config-name", "-cn", default="quickstart")
    ap.add_argument("--config-dir", "-cd", default=None, help="directory of yaml configs (default: configs/)")
    ap.add_argument("args", nargs="*", help="key=value overrides, and `daemon` to run as a service")
    ns = ap.parse_args(argv)
    daemon = "daemon" in ns.args
    overrides = [a for a in ns.args if a != "daemon"]
    try:
        cfg = load_config(ns.config_name, overrides, ns.config_dir)
        setup_logging("coordinator" if cfg.cluster.coordinator is None else "node", cfg.cluster.node_rank)
        role = run_head if cfg.cluster.coordinator is None else run_node
        return run(role(cfg, daemon=daemon))
    except (ConfigError, DaemonError, TransportError) as e:
        print(f"asyncrl-launch: {e}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, AuthenticationError)) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the job's own failure: one line, then its traceback in the log above
        logging.getLogger("asyncrl.launch").exception("job failed")
        print(f"asyncrl-launch: job failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
