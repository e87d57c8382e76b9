"""The roles a node plays in a job, and the daemon's job service: node 0 (`run_head`: coordinator,
node daemon and the driver, or submitted jobs as a daemon), every other node (`run_node`), and
`JobService` (`asyncrl submit`). `asyncrl-launch` (`asyncrl.launch`) composes the config and
hands it here; it does not come back."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from asyncrl.single_controller.config import LaunchConfig
from asyncrl.single_controller.context import JobContext
from asyncrl.single_controller.schema import typed
from daemons.cluster import ClusterSpec, HeadNode, NodeOnly
from daemons.coordinator import Coordinator
from daemons.errors import JobError
from daemons.heap import settle
from daemons.state import StateKind, new_job_id, remove_state, state_for_this_process, write_state
from daemons.worker import entry_package, resolve
from transport import CurveConfig
from transport.checks import ConfigError
from transport.rpc import expose

log = logging.getLogger("asyncrl.launch")

# `asyncrl shutdown` ends a daemon with this status (EX_TEMPFAIL): not a crash, but not 0 either, so
# a service manager's restart-on-failure policy restarts it (`systemctl stop` is how it stays down)
SHUTDOWN_EXIT = 75



# configuration -----------------------------------------------------------------------------------
def check_config(cfg: DictConfig) -> Any:
    """Types and ranges of every section (the schemas' `check` methods); the typed config.

    A config whose YAML names no schema is a user's job with sections of its own: only what
    `asyncrl-launch` reads (cluster, worker, job, seed, objectstore) is checked."""
    kind = OmegaConf.get_type(cfg)
    if isinstance(kind, type) and issubclass(kind, LaunchConfig) and kind is not LaunchConfig:
        return typed(kind, cfg)
    return typed(LaunchConfig, {k: cfg[k] for k in ("cluster", "worker", "job", "seed", "objectstore") if k in cfg})



def security(cfg: DictConfig) -> tuple[CurveConfig | None, bool]:
    if cfg.cluster.insecure:
        return None, True
    if cfg.cluster.key_dir:
        return CurveConfig.load(cfg.cluster.key_dir), False
    return CurveConfig.ephemeral(), False


async def import_entry(head: HeadNode, entry: str | None) -> Any:
    """`load_entry` on a thread, its stalls of the loop excused (C code of the imports holds the
    GIL at times), then what the imports made frozen (`daemons.heap.settle`): otherwise the
    collector's first full passes over it stall the loop (0.4-1 s each, the GIL held)."""
    def load() -> Any:
        fn = load_entry(entry)
        settle()
        return fn

    with head.loop_lag.excused(f"job {entry}'s imports"):
        return await asyncio.to_thread(load)


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
                entry = await import_entry(head, cfg.job.entry)
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
        fn = await import_entry(self.head, entry)
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
        if c.join and not await node.daemon.coordinator.call("elastic_jobs", timeout=30):
            raise ConfigError(f"--join {c.coordinator}: no job there takes nodes joining mid-run (only an elastic "
                              "rollout pool does: trainer.placement=split rollout.elastic=true); this node left "
                              "again and the running job is unchanged")
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
