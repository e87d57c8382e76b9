"""`JobContext`: what an algorithm script's `async def main(ctx)` gets — the cluster, the config,
resource pools, worker groups, and the driver's own small object store for data it produces
(prompts from a dataloader). A context owns its store and its `RefTracker`; the DistBatches
it and its groups hand out carry that tracker, so two contexts in one process never share one.
A context is one job on the coordinator (`job_id`): its pools and workers are that job's, and
closing the context stops them, leaving other jobs on the same cluster alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.config import COLLECTIVE_TIMEOUT_ENV, WorkerConfig
from asyncrl.single_controller.distbatch import DistBatch, RefTracker
from asyncrl.single_controller.group import (
    ProcessSet,
    WorkerGroup,
    create_groups,
    instantiate,
    spec_of,
)
from asyncrl.single_controller.transfer import publish
from daemons.cluster import ClusterConfig, ClusterSpec, HeadNode
from daemons.coordinator import Coordinator, JobRecord, ResourcePool
from daemons.worker import ALLOWED_ENV, entry_package
from daemons.worker_client import WorkerHandle
from objectstore import ObjectStore
from objectstore.memory import resolve_memory_limit

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding asyncrl/
# driver-made objects up to this size (a small prompt batch) travel inside their refs: each rank
# reads its rows without a pull from the driver, which would serve the same bytes a round trip later
DRIVER_INLINE_BYTES = 64 << 10


def _select(cfg: Any, dotted: str) -> Any:
    """`cfg.a.b` of a DictConfig, dict or dataclass config; None where a part is missing."""
    for part in dotted.split("."):
        if cfg is None:
            return None
        cfg = cfg.get(part) if hasattr(cfg, "get") else getattr(cfg, part, None)
    return cfg


class Groups(dict):
    """Colocated groups by role; also readable as attributes (`groups.actor`)."""

    def __getattr__(self, name: str) -> WorkerGroup:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no role {name!r}; roles: {sorted(self)}") from None


class JobContext:
    """The cluster as a driver script sees it."""

    def __init__(self, coordinator: Coordinator, cfg: Any, job_id: str | None = None,
                 allowed_packages: tuple[str, ...] = ()) -> None:
        self.coordinator = coordinator
        self.cfg = cfg
        # what this job's workers may run besides asyncrl: its entry's package, the config's list
        entry, listed = _select(cfg, "job.entry"), _select(cfg, "cluster.allowed_packages")
        self.allowed_packages = tuple(p for p in dict.fromkeys(
            [*allowed_packages, entry_package(entry), *(listed or [])]) if p)
        self.name = cfg.job.name if cfg is not None and "job" in cfg else "job"
        self.log = logging.getLogger(f"asyncrl.job.{self.name}")
        self.job: JobRecord = coordinator.begin_job(job_id, self.name)
        self.store: ObjectStore | None = None
        self.tracker: RefTracker | None = None
        self.process_sets: dict[str, ProcessSet] = {}
        self.groups: dict[str, WorkerGroup] = {}
        self.worker_cfg = WorkerConfig.of(cfg)  # call deadlines and collective timeouts

    async def open(self) -> JobContext:
        """Start the driver's object store on the head node and track the refs the driver holds."""
        node = self.coordinator.live_nodes()[0]
        # the same share as the node's worker stores: one per device, and this one
        limit = resolve_memory_limit(_memory_limit(self.cfg), stores_on_node=len(node.devices) + 1)
        self.store = ObjectStore(node_id=node.node_id, endpoint=f"tcp://{node.host}:0", bulk_host=node.host,
                                 curve=self.coordinator.worker_curve, insecure=self.coordinator.insecure,
                                 limits=self.coordinator.limits, name="store-driver", memory_limit_bytes=limit,
                                 host_only=True,  # the controller never creates a CUDA context
                                 inline_bytes=DRIVER_INLINE_BYTES)
        await self.store.start()
        self.tracker = RefTracker(self.store, asyncio.get_running_loop())
        return self

    @property
    def job_id(self) -> str:
        return self.job.job_id

    async def close(self) -> None:
        """Stop this job's workers (only this job's) and close the driver's store."""
        try:
            await self.coordinator.end_job(self.job_id)
            log_dir = _select(self.cfg, "cluster.log_dir")
            if log_dir and len(self.coordinator.live_nodes()) > 1:  # every node's logs beside node 0's
                await self.coordinator.collect_job_logs(self.job_id, Path(log_dir) / self.job_id)
        finally:
            if self.tracker is not None:
                self.tracker.close()
            if self.store is not None:
                await self.store.close()
                self.store = None

    async def restart_workers(self) -> None:
        """Stop every worker of this job and forget its pools and groups; the job, its driver
        store and its id stay (a failover spawns the workers again)."""
        await self.coordinator.end_job(self.job_id)
        self.job = self.coordinator.begin_job(self.job_id, self.name)
        self.process_sets.clear()
        self.groups.clear()

    # pools and groups ---------------------------------------------------------------------------
    def create_pool(self, name: str, world_size: int | None = None,
                    per_node: list[int] | None = None) -> ResourcePool:
        """A named set of devices: `world_size` in node order, or `per_node[k]` on node rank k."""
        return self.coordinator.create_pool(name, world_size, per_node, job=self.job_id)


    async def spawn_workers(self, pool: ResourcePool, group: str = "workers",
                            env: dict[str, str] | None = None) -> list[WorkerHandle]:
        """Raw worker processes (no Worker classes): for jobs that call functions directly.
        Their calls (`handle.run`, `handle.call`) get worker.call_timeout_s unless they pass a
        timeout of their own."""
        handles = await self.coordinator.spawn_workers(pool, group, {**self._worker_env(), **(env or {})})
        for handle in handles:
            handle.default_timeout_s = self.worker_cfg.call_timeout_s
        return handles

    async def spawn(self, pool: ResourcePool, **roles: Any) -> Groups:
        """Colocate Worker classes on every device of `pool`, one process per device.

        `await ctx.spawn(pool, actor=(ActorWorker, cfg.actor), critic=CriticWorker)` returns the
        groups by role. Spawning again on the same pool adds classes to the same processes.
        """
        clash = sorted(set(roles) & set(self.groups))
        if clash:
            raise ValueError(f"roles {clash} exist already; give each group its own role name")
        procs = self.process_sets.get(pool.name)
        if procs is None:
            handles = await self.spawn_workers(pool, group=pool.name)
            procs = self.process_sets[pool.name] = ProcessSet(
                pool, handles, self.worker_cfg.call_timeout_s, self.worker_cfg.collective_timeout_s)
        groups = await create_groups(procs, {r: spec_of(v) for r, v in roles.items()}, self.tracker)
        self.groups.update(groups)
        return Groups(groups)

    async def replace_rank(self, pool_name: str, rank: int, rebuild: tuple[str, ...] = (),
                           before_rebuild: str = "") -> WorkerHandle:
        """A new process for rank `rank` of pool `pool_name`, whose worker died, with every role
        of the pool built on it; the roles in `rebuild` are built again on the other ranks too
        (after `before_rebuild`, a function "module:name" run on every rank with the new rendezvous
        host and port), so that all ranks form their process group anew. The pool's calls go on."""
        procs = self.process_sets[pool_name]
        for f in procs.unsettled:  # the failed call's other ranks: ended by the rebuild, awaited by no one
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        procs.unsettled.clear()
        procs.tail = None
        handle, host, port = await self.coordinator.respawn_worker(procs.pool, rank)
        handle.default_timeout_s = self.worker_cfg.call_timeout_s
        procs.handles[rank] = handle
        if before_rebuild:
            await asyncio.gather(*(h.run(before_rebuild, host, port) for h in procs.handles))
        for group in [g for g in self.groups.values() if g.procs is procs]:
            await instantiate(group, procs.handles if group.role in rebuild else [handle])
        return handle

    async def spawn_group(self, pool: ResourcePool, cls: type, *args: Any, role: str | None = None,
                          **kwargs: Any) -> WorkerGroup:
        """One Worker class on `pool` (see `spawn` for colocating several)."""
        role = role or pool.name
        return (await self.spawn(pool, **{role: (cls, args, kwargs)}))[role]

    def _worker_env(self) -> dict[str, str]:
        # workers import the same code as the driver, including script directories on sys.path
        # (the interpreter's own directories are found without help)
        installed = (sys.prefix, sys.base_prefix, sys.exec_prefix)
        own = [p for p in sys.path if p and Path(p).is_dir() and not p.startswith(installed)]
        paths = [str(REPO_ROOT), os.getcwd(), *own]
        paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
        return {"PYTHONPATH": os.pathsep.join(p for p in dict.fromkeys(paths) if p),
                ALLOWED_ENV: ",".join(self.allowed_packages),
                COLLECTIVE_TIMEOUT_ENV: str(self.worker_cfg.collective_timeout_s)}

    # data ---------------------------------------------------------------------------------------
    def put(self, batch: Batch | dict) -> DistBatch:
        """Place driver-made data (e.g. a prompt batch) in the driver's store; ranks pull their rows."""
        if self.store is None:
            raise RuntimeError("JobContext.open() has not run")
        if isinstance(batch, dict):
            batch = Batch(batch)
        return publish(batch, self.store, self.tracker)

    def controller_bytes(self) -> int:
        """Every byte the driver process sends or serves: RPC it sends to workers and receives
        back, its store's own RPC, and the bytes its store serves to pulling workers (RPC
        replies, bulk TCP, shared memory written for same-node readers)."""
        total = 0
        for handle in self.coordinator.job_handles(self.job_id):
            sent, received = handle.client.bytes_transferred
            total += sent + received
        if self.store is not None:
            sent, received = self.store.bytes_transferred
            total += sent + received + self.store.bytes_served
        return total

    def status(self) -> Any:
        return self.coordinator.status(self.job_id)


def _memory_limit(cfg: Any) -> int | None:
    """`objectstore.memory_limit` of a job's config (a DictConfig, a dict or a typed config)."""
    section = cfg.get("objectstore") if hasattr(cfg, "get") else getattr(cfg, "objectstore", None)
    if section is None:
        return None
    return section.get("memory_limit") if hasattr(section, "get") else getattr(section, "memory_limit", None)


@contextlib.asynccontextmanager
async def local_cluster(cpu_devices: int = 2, log_dir: str | Path = "outputs/logs", cfg: Any = None,
                        insecure: bool = False, allowed_packages: tuple[str, ...] = ()) -> AsyncIterator[JobContext]:
    """A coordinator, one node daemon and a driver context in this process (tests, benchmarks,
    notebooks). Workers are stopped and the store closed on exit. Workers run functions and
    Worker classes of asyncrl and of `allowed_packages` (e.g. ("my_pkg",)) only."""
    from transport import CurveConfig

    curve = None if insecure else CurveConfig.ephemeral()
    spec = ClusterSpec(ClusterConfig(cpu_devices=cpu_devices, insecure=insecure, log_dir=str(log_dir),
                                     heartbeat_interval_s=0.5), curve=curve)
    async with HeadNode.start(spec) as head:
        ctx = await JobContext(head.coordinator, cfg, allowed_packages=allowed_packages).open()
        try:
            yield ctx
        finally:
            await ctx.close()
