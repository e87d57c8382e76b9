"""Coordinator daemon: node registry, resource pools, worker placement, object directory.

It runs in the driver's event loop; node heartbeats do not (`daemons.liveness`), so a driver
that blocks the loop delays the coordinator's answers but never gets a healthy node marked dead. The driver (the user's `async def` algorithm script) talks
to workers through `WorkerHandle`s (`daemons.worker_client`); the coordinator holds only
metadata — where workers and objects are — never bulk data. Its RPC endpoints are its
`@expose` methods; what nodes and workers send it are the typed messages of `daemons.messages`.

Every pool and worker belongs to a job (`begin_job`); `end_job` stops that job's workers only
and forgets its pools, handles and objects, so a daemon running job after job (or several at
once) neither kills other jobs' workers nor grows.

Keys: the coordinator serves with the cluster key. Workers never see it: the coordinator makes
a worker key pair (`worker_curve`) that every worker and object store of its jobs serves and
connects with, hands it to workers in their spawn request, and admits it as a client; local
tools get a client pair of their own (`cli_curve`, written to the state file).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemons.errors import JobError, NodeDiedError, PlacementError, WorkerDiedError
from daemons.liveness import HeartbeatServer
from daemons.messages import (
    ClusterStatus,
    JobStatus,
    NodeLiveness,
    NodeRegistration,
    NodeStatus,
    WorkerExit,
    WorkerReady,
    WorkerSpec,
    WorkerState,
    WorkerStatus,
)
from daemons.state import JOB_LOGS_MARKER, check_job_id, new_job_id
from daemons.worker import ALLOWED_ENV, COORDINATOR_KEY_ENV
from daemons.worker_client import WorkerHandle
from objectstore import ObjectRef
from transport import (
    ConnectionLost,
    CurveConfig,
    RpcClient,
    RpcServer,
    RpcTimeout,
    TransportError,
    expose,
)
from transport.peers import ServerLimits

SHUTDOWN_REPLY_S = 0.5  # `shutdown` replies before the teardown begins
log = logging.getLogger(__name__)
_LEAVES = frozenset((bool, int, float, str, bytes))  # reply values that hold no refs
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a node id usable as a folder


@dataclass
class NodeInfo:
    node_id: str
    rank: int
    host: str
    endpoint: str
    devices: list[str]
    client: RpcClient
    liveness: NodeLiveness = NodeLiveness.ALIVE

    @property
    def alive(self) -> bool:
        return self.liveness is NodeLiveness.ALIVE


@dataclass
class WorkerInfo:
    worker_id: str
    node_id: str
    rank: int
    group: str
    device: str
    state: WorkerState = WorkerState.STARTING
    pid: int = 0
    endpoint: str = ""
    store_endpoint: str = ""
    exit_reason: str = ""
    log_tail: str = ""
    ready: asyncio.Future | None = None
    job: str = ""
    env: dict[str, str] = field(default_factory=dict)  # what it was started with (a replacement's base)


@dataclass
class ResourcePool:
    """A named set of devices across nodes (HybridFlow's ResourcePool)."""

    name: str
    placements: list[tuple[str, str]]  # (node_id, device), in rank order
    job: str = ""  # the job that made it; its name is unique within that job

    @property
    def world_size(self) -> int:
        return len(self.placements)

    @property
    def key(self) -> str:
        return f"{self.job}/{self.name}" if self.job else self.name


@dataclass
class JobRecord:
    """A job this coordinator runs; it owns the pools and workers made under its id."""

    job_id: str
    name: str
    started_at: float = field(default_factory=time.time)
    stop_reason: str = ""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set by `stop`: the job should end


class Coordinator:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        curve: CurveConfig | None = None,
        insecure: bool = False,
        node_timeout: float = 5.0,
        spawn_timeout: float = 120.0,
        limits: ServerLimits | None = None,
        allowed_packages: tuple[str, ...] = (),
    ) -> None:
        self.insecure = insecure
        # the worker pair talks to worker and store servers (which present it) and, as a
        # client, to this coordinator; the CLI pair only to this coordinator
        self.worker_curve = None if curve is None else CurveConfig.ephemeral()
        self.cli_curve = None if curve is None else CurveConfig.identity(curve.public_key)
        if curve is not None:
            curve = curve.authorizing(self.worker_curve.public_key, self.cli_curve.public_key)
        self.curve = curve
        self.limits = limits or ServerLimits()
        self.allowed_packages = tuple(allowed_packages)  # besides asyncrl's; see daemons.worker
        self.node_timeout = node_timeout
        self.spawn_timeout = spawn_timeout
        self.server = RpcServer(endpoint, curve=curve, insecure=insecure, limits=self.limits,
                                name="coordinator")
        self.nodes: dict[str, NodeInfo] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.handles: dict[str, WorkerHandle] = {}
        self.pools: dict[str, ResourcePool] = {}  # by ResourcePool.key
        self.jobs: dict[str, JobRecord] = {}
        self.objects: dict[str, tuple[str, str, int]] = {}  # object id -> (worker id, node id, nbytes)
        self.node_joined = asyncio.Condition()
        self.stop_requested = asyncio.Event()  # `shutdown`: the process should end
        self.stop_reason = ""
        self._ids = itertools.count()
        self.liveness = HeartbeatServer(endpoint.removeprefix("tcp://").rsplit(":", 1)[0], curve=curve,
                                        insecure=insecure, node_timeout=node_timeout,
                                        on_silent=self._node_silent, limits=self.limits,
                                        # only node daemons (the cluster key) send heartbeats
                                        restricted=[k.public_key for k in (self.worker_curve, self.cli_curve)
                                                    if k is not None])
        self.started_at = time.time()
        self.elastic: set[str] = set()  # jobs that take nodes joining mid-run (`elastic_jobs`)

    async def start(self) -> str:
        self.server.register_object(self)
        if self.worker_curve is not None:
            # workers run job code: their key may report readiness, not stop or submit jobs
            self.server.restrict_client(self.worker_curve.public_key, {"worker_ready"})
        endpoint = await self.server.start()
        await self.liveness.start()
        return endpoint

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    async def close(self) -> None:
        if any(w.state is not WorkerState.DEAD for w in self.workers.values()):
            await self.shutdown_workers()
        await self.liveness.close()
        for handle in self.handles.values():
            await handle.client.close()
        for node in self.nodes.values():
            await node.client.close()
        await self.server.close()

    # node registry -------------------------------------------------------------------------
    @expose
    async def elastic_jobs(self) -> list[str]:
        """The running jobs that put nodes joining mid-run to work (an elastic rollout pool)."""
        return sorted(j for j in self.elastic if j in self.jobs)

    @expose
    async def register_node(self, reg: NodeRegistration) -> int:
        """Add (or re-add) a node; returns the port of the heartbeat endpoint (`daemons.liveness`)."""
        if not isinstance(reg, NodeRegistration):
            raise TypeError(f"register_node takes a NodeRegistration, got a {type(reg).__qualname__}")
        old = self.nodes.get(reg.node_id)
        if old is not None:
            await old.client.close()
        client = RpcClient(reg.endpoint, curve=self.curve, insecure=self.insecure,
                           name=f"coord->{reg.node_id}")
        self.nodes[reg.node_id] = NodeInfo(reg.node_id, reg.rank, reg.host, reg.endpoint,
                                           list(reg.devices), client)
        self.liveness.track(reg.node_id)
        log.info("node %s (rank %d, %s) joined with %d devices", reg.node_id, reg.rank, reg.host,
                 len(reg.devices))
        async with self.node_joined:
            self.node_joined.notify_all()
        return self.liveness.port

    async def wait_for_nodes(self, nnodes: int, timeout: float) -> None:
        """Wait until `nnodes` live nodes have joined; the error names the missing node ranks."""
        async def enough() -> None:
            async with self.node_joined:
                await self.node_joined.wait_for(lambda: len(self.live_nodes()) >= nnodes)
        try:
            await asyncio.wait_for(enough(), timeout)
        except TimeoutError:
            have = {n.rank for n in self.live_nodes()}
            missing = sorted(set(range(nnodes)) - have)
            raise PlacementError(
                f"only {len(have)} of {nnodes} nodes joined within {timeout:.0f}s; missing node "
                f"ranks {missing}. Start `asyncrl-launch ... cluster.coordinator={self.endpoint_for_nodes()} "
                f"cluster.node_rank=K` on each of them, and check the firewall and key files.") from None

    def endpoint_for_nodes(self) -> str:
        return self.endpoint.removeprefix("tcp://")

    def live_nodes(self) -> list[NodeInfo]:
        return sorted((n for n in self.nodes.values() if n.alive), key=lambda n: n.rank)

    def _node_silent(self, node_id: str, silent_s: float) -> None:
        """The liveness thread heard nothing from `node_id` for node_timeout: it and its workers are dead."""
        node = self.nodes.get(node_id)
        if node is not None and node.alive:
            log.error("node %s missed heartbeats for %.1fs: marked dead", node_id, silent_s)
            self._node_lost(node, "stopped heartbeating")

    def _node_lost(self, node: NodeInfo, how: str) -> None:
        node.liveness = NodeLiveness.DEAD
        self.liveness.forget(node.node_id)
        for info in self.workers.values():
            if info.node_id == node.node_id and info.state is not WorkerState.DEAD:
                self._mark_dead(info, f"its node {node.node_id} {how}", "")

    # resource pools and placement ------------------------------------------------------------
    def create_pool(self, name: str, world_size: int | None = None,
                    per_node: list[int] | None = None, *, job: str = "") -> ResourcePool:
        """Pick devices for a pool of `job`: `per_node[k]` devices on node rank k, or `world_size`
        in order. Devices held by any job's pools are not free."""
        nodes = self.live_nodes()
        if not nodes:
            raise PlacementError("no node has joined the cluster yet")
        if ResourcePool(name, [], job).key in self.pools:
            raise PlacementError(f"a pool named {name!r} exists already; pick another name")
        taken = {p for pool in self.pools.values() for p in pool.placements}
        placements: list[tuple[str, str]] = []
        if per_node is not None:
            if len(per_node) > len(nodes):
                raise PlacementError(f"pool {name!r} wants {len(per_node)} nodes; {len(nodes)} joined")
            for node, count in zip(nodes, per_node, strict=False):
                free = [d for d in node.devices if (node.node_id, d) not in taken]
                if count > len(free):
                    raise PlacementError(f"pool {name!r} wants {count} devices on node {node.node_id}, "
                                         f"which has {len(free)} free of {len(node.devices)}; colocate "
                                         "roles on one pool instead of making another")
                placements += [(node.node_id, d) for d in free[:count]]
        else:
            available = [(n.node_id, d) for n in nodes for d in n.devices if (n.node_id, d) not in taken]
            want = world_size or len(available)
            if want > len(available) or want == 0:
                raise PlacementError(f"pool {name!r} wants {want} devices; the cluster has "
                                     f"{len(available)} free ({', '.join(n.node_id for n in nodes)}, "
                                     f"{len(taken)} held by pools {sorted(self.pools)}); colocate "
                                     "roles on one pool instead of making another")
            placements = available[:want]
        pool = ResourcePool(name, placements, job)
        self.pools[pool.key] = pool
        return pool

    async def spawn_workers(self, pool: ResourcePool, group: str = "workers",
                            env: dict[str, str] | None = None) -> list[WorkerHandle]:
        """Start one worker process per device of `pool`; returns handles in rank order."""
        master_node = self.nodes[pool.placements[0][0]]
        master_port = await master_node.client.call("free_port", timeout=10)
        local_counts: dict[str, int] = {}
        per_node = {n: sum(1 for m, _ in pool.placements if m == n) for n, _ in pool.placements}
        infos = []
        for rank, (node_id, device) in enumerate(pool.placements):
            local_rank = local_counts.get(node_id, 0)
            local_counts[node_id] = local_rank + 1
            worker_env = {
                "RANK": str(rank), "WORLD_SIZE": str(pool.world_size), "LOCAL_RANK": str(local_rank),
                "MASTER_ADDR": master_node.host, "MASTER_PORT": str(master_port),
                "LOCAL_WORLD_SIZE": str(per_node[node_id]), "ASYNCRL_DEVICE": device, "ASYNCRL_GROUP": group, **(env or {}),
            }
            infos.append(await self._spawn_one(pool, group, rank, node_id, device, worker_env))
        return await self._handles(infos)

    async def respawn_worker(self, pool: ResourcePool, rank: int) -> tuple[WorkerHandle, str, int]:
        """A new process for rank `rank` of `pool`, whose worker died: on its device if its node
        lives, else on a free device of a live node. Returns its handle and the rendezvous (host,
        port) it joins, which the pool's other ranks join too: the process group is formed anew."""
        dead = [i for i in self.workers.values() if i.job == pool.job and i.group == pool.name and i.rank == rank]
        if not dead or dead[-1].state is not WorkerState.DEAD:
            raise PlacementError(f"rank {rank} of pool {pool.name!r} has no dead worker to replace")
        old = dead[-1]
        node_id, device = self._replacement_device(pool, rank)
        master = self.nodes[pool.placements[0][0]]
        port = await master.client.call("free_port", timeout=10)
        here = sum(1 for n, _ in pool.placements if n == node_id)
        worker_env = {**old.env, "MASTER_ADDR": master.host, "MASTER_PORT": str(port), "ASYNCRL_DEVICE": device}
        if node_id != old.node_id:
            worker_env.update({"LOCAL_RANK": str(here - 1), "LOCAL_WORLD_SIZE": str(here)})
        info = await self._spawn_one(pool, old.group, rank, node_id, device, worker_env)
        (handle,) = await self._handles([info])
        log.warning("rank %d of pool %s: worker %s replaces %s (%s) on node %s", rank, pool.name,
                    info.worker_id, old.worker_id, old.exit_reason, node_id)
        return handle, master.host, port

    def _replacement_device(self, pool: ResourcePool, rank: int) -> tuple[str, str]:
        """Where a dead rank's replacement runs: its own place while its node lives, else the first
        free device of a live node (`pool.placements` then names it)."""
        node_id, device = pool.placements[rank]
        if node_id in self.nodes and self.nodes[node_id].alive:
            return node_id, device
        taken = {p for other in self.pools.values() for p in other.placements}
        free = [(n.node_id, d) for n in self.live_nodes() for d in n.devices if (n.node_id, d) not in taken]
        if not free:
            raise PlacementError(f"rank {rank} of pool {pool.name!r} lost its node {node_id} and no live node "
                                 "has a free device; add a node (asyncrl-launch --join) or restart the job")
        pool.placements[rank] = free[0]
        return free[0]

    async def _spawn_one(self, pool: ResourcePool, group: str, rank: int, node_id: str, device: str,
                         worker_env: dict[str, str]) -> WorkerInfo:
        node = self.nodes[node_id]
        worker_id = f"{group}-{rank}-{next(self._ids)}"
        info = WorkerInfo(worker_id, node_id, rank, group, device,
                          ready=asyncio.get_running_loop().create_future(), job=pool.job, env=dict(worker_env))
        self.workers[worker_id] = info
        allowed = [*self.allowed_packages, *worker_env.get(ALLOWED_ENV, "").split(",")]
        worker_env = {**worker_env, ALLOWED_ENV: ",".join(p for p in dict.fromkeys(allowed) if p), **self.worker_env()}
        # a GPU's physical id is known only to its node: the node daemon pins the worker to it
        info.pid = await node.client.call("spawn_worker", WorkerSpec(worker_id, worker_env, pool.job), timeout=30)
        return info

    async def _handles(self, infos: list[WorkerInfo]) -> list[WorkerHandle]:
        """Wait until the workers report ready; their handles, in order."""
        try:
            await asyncio.wait_for(asyncio.gather(*[i.ready for i in infos]), self.spawn_timeout)
        except TimeoutError:
            slow = [i.worker_id for i in infos if not i.ready.done()]
            raise PlacementError(f"workers {slow} did not report ready within {self.spawn_timeout}s; "
                                 "see their logs in the node's log_dir") from None
        handles = []
        for info in infos:
            client = RpcClient(info.endpoint, curve=self.worker_curve, insecure=self.insecure,
                               name=f"driver->{info.worker_id}")
            handle = WorkerHandle(self, info, client)
            self.handles[info.worker_id] = handle
            handles.append(handle)
        return handles

    def worker_env(self) -> dict[str, str]:
        """What a worker needs to authenticate: the worker key pair and this coordinator's public
        key (never the cluster secret), or the insecure flag; limits for its servers."""
        env = self.limits.to_env()
        if self.worker_curve is None:
            return {**env, "ASYNCRL_INSECURE": "1"}
        return {**env, **self.worker_curve.to_env(), COORDINATOR_KEY_ENV: self.curve.public_key.decode()}

    @expose
    def worker_ready(self, msg: WorkerReady) -> bool:
        info = self.workers.get(msg.worker_id)
        if info is None:
            raise KeyError(f"unknown worker {msg.worker_id!r}: it was not spawned by this coordinator")
        info.endpoint, info.store_endpoint, info.pid = msg.endpoint, msg.store_endpoint, msg.pid
        info.state = WorkerState.READY
        if info.ready is not None and not info.ready.done():
            info.ready.set_result(True)
        return True

    @expose
    def worker_exited(self, msg: WorkerExit) -> None:
        worker_id, reason, log_tail = msg.worker_id, msg.reason, msg.log_tail
        info = self.workers.get(worker_id)
        if info is not None and info.state is not WorkerState.DEAD:
            expected = self.stop_requested.is_set() or info.exit_reason == "stopped"
            (log.info if expected else log.error)("worker %s (rank %d on %s) %s", worker_id, info.rank,
                                                  info.node_id, reason)
            self._mark_dead(info, reason, log_tail)

    def _mark_dead(self, info: WorkerInfo, reason: str, log_tail: str) -> None:
        info.state = WorkerState.DEAD
        info.exit_reason = info.exit_reason or reason
        info.log_tail = log_tail
        err = WorkerDiedError(info.worker_id, info.node_id, info.rank, info.exit_reason, log_tail)
        if info.ready is not None and not info.ready.done():
            info.ready.set_exception(err)
            info.ready.exception()  # retrieved: spawn_workers reports it
        handle = self.handles.get(info.worker_id)
        if handle is not None:
            handle.client.fail_pending(err)
        for oid in [o for o, (w, _, _) in self.objects.items() if w == info.worker_id]:
            del self.objects[oid]

    async def explain_loss(self, info: WorkerInfo, cause: Exception) -> WorkerDiedError:
        """Turn a lost connection into WorkerDiedError: the exit its node reaped, else its node's loss."""
        if isinstance(cause, WorkerDiedError):
            return cause
        deadline = time.monotonic() + 0.3  # the node's own exit report usually arrives first
        while info.state is not WorkerState.DEAD and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if info.state is not WorkerState.DEAD:
            await self.check_workers([info])
        if info.state is not WorkerState.DEAD:
            self._mark_dead(info, f"stopped answering ({cause})", "")
        return WorkerDiedError(info.worker_id, info.node_id, info.rank, info.exit_reason, info.log_tail)

    async def check_workers(self, infos: list[WorkerInfo], timeout: float = 2.0) -> list[WorkerInfo]:
        """Ask the workers' node daemons whether they still run (without waiting for heartbeats or
        exit reports); those that exited, or whose node does not answer within `timeout`, are
        marked dead and returned."""
        by_node: dict[str, list[WorkerInfo]] = {}
        for info in infos:
            if info.state is not WorkerState.DEAD:
                by_node.setdefault(info.node_id, []).append(info)

        async def ask(node_id: str, members: list[WorkerInfo]) -> None:
            node = self.nodes.get(node_id)
            if node is None or not node.alive:
                for info in members:
                    self._mark_dead(info, f"its node {node_id} is gone", "")
                return
            try:
                exits = await node.client.call("exits", [i.worker_id for i in members], timeout=timeout)
            except TransportError as e:
                # a node daemon takes its workers with it (parent-death signal); were it alive
                # after all, its next heartbeat is refused and it registers again
                log.error("node %s did not answer within %.0fs (%s): marked dead", node_id, timeout,
                          type(e).__name__)
                self._node_lost(node, f"stopped answering ({type(e).__name__}); its daemon is probably "
                                "dead, and its workers with it")
                return
            for msg in exits:
                self.worker_exited(msg)

        await asyncio.gather(*(ask(n, m) for n, m in by_node.items()))
        return [i for i in infos if i.state is WorkerState.DEAD]

    async def shutdown_workers(self, grace_s: float = 5.0) -> None:
        """Stop every worker of every job: ask nicely, then let node daemons kill what is left.
        Frees all pools."""
        self.pools.clear()
        for info in self.workers.values():
            if info.state is not WorkerState.DEAD:
                info.exit_reason = "stopped"
        await self._ask_to_shut_down(list(self.handles.values()))

        async def kill(node: NodeInfo) -> None:
            try:
                await node.client.call("kill_all", grace_s, timeout=grace_s + 10)
            except (ConnectionLost, RpcTimeout, Exception) as e:
                log.warning("node %s did not confirm stopping its workers: %s", node.node_id, e)
                return
            for info in self.workers.values():
                if info.node_id == node.node_id and info.state is not WorkerState.DEAD:
                    self._mark_dead(info, "stopped", "")

        # nodes whose workers are all dead have nothing to stop (and may be dead themselves)
        busy = {i.node_id for i in self.workers.values() if i.state is not WorkerState.DEAD}
        await asyncio.gather(*(kill(n) for n in self.live_nodes() if n.node_id in busy))

    async def _ask_to_shut_down(self, handles: list[WorkerHandle]) -> None:
        async def ask(handle: WorkerHandle) -> None:
            try:
                await handle.client.call("shutdown", timeout=1)
            except (ConnectionLost, RpcTimeout, Exception):
                pass
        await asyncio.gather(*(ask(h) for h in handles if h.info.state is WorkerState.READY))

    # jobs ---------------------------------------------------------------------------------------
    def begin_job(self, job_id: str | None = None, name: str = "job") -> JobRecord:
        """Register a job; its pools and workers are made with `job=record.job_id`."""
        job_id = check_job_id(job_id) if job_id else new_job_id(name)
        if job_id in self.jobs:
            raise JobError(f"a job with id {job_id!r} runs already on this coordinator; pick another id")
        record = self.jobs[job_id] = JobRecord(job_id, name)
        return record

    def job_handles(self, job_id: str) -> list[WorkerHandle]:
        return [h for h in self.handles.values() if h.info.job == job_id]

    async def collect_job_logs(self, job_id: str, dest: Path) -> int:
        """Copy the worker logs of job `job_id` from every other node (their tails, see
        `NodeDaemon.job_logs`) to `dest/<node id>/` on this machine, so one folder holds the
        whole job's logs. A node that keeps its logs in `dest` itself is skipped; a node that does
        not answer, or a write that fails (disk full, permissions), is a warning: the job's result
        never depends on its logs. Returns the number of files written."""
        here, target = socket.gethostname(), str(dest.resolve())

        def write(node_id: str, files: dict[str, bytes]) -> int:
            folder = dest / node_id
            folder.mkdir(parents=True, exist_ok=True)
            for marked in (dest, folder):  # node 0's log rotation removes both with the job
                if not (marked / JOB_LOGS_MARKER).exists():
                    (marked / JOB_LOGS_MARKER).write_text(job_id + "\n")
            names = [n for n in files if "/" not in n and n.startswith("worker-") and n.endswith(".log")]
            for name in names:  # a node names its own files; nothing else is written
                (folder / name).write_bytes(files[name])
            return len(names)

        async def fetch(node: NodeInfo) -> int:
            if not _SAFE_NAME.fullmatch(node.node_id):
                log.warning("node id %r is not a folder name; its logs of job %s stay on that node", node.node_id, job_id)
                return 0
            try:
                reply = await node.client.call("job_logs", job_id, timeout=30)
                if not reply["files"] or (reply["host"] == here and reply["dir"] == target):
                    return 0
                return await asyncio.to_thread(write, node.node_id, reply["files"])
            except Exception as e:  # noqa: BLE001 - the job is over; its logs stay on that node
                log.warning("node %s: could not copy job %s's worker logs to %s (%s); they stay on that node",
                            node.node_id, job_id, dest, e)
                return 0

        counts = await asyncio.gather(*(fetch(n) for n in self.live_nodes()))
        return sum(counts)

    async def end_job(self, job_id: str, grace_s: float = 5.0) -> None:
        """Stop the workers of `job_id` (not other jobs') and forget its pools, workers, handles
        and objects."""
        infos = [i for i in self.workers.values() if i.job == job_id]
        for info in infos:
            if info.state is not WorkerState.DEAD:
                info.exit_reason = info.exit_reason or "stopped"
        handles = [self.handles[i.worker_id] for i in infos if i.worker_id in self.handles]
        await self._ask_to_shut_down(handles)
        by_node: dict[str, list[str]] = {}
        for info in infos:
            if info.state is not WorkerState.DEAD:
                by_node.setdefault(info.node_id, []).append(info.worker_id)

        async def kill(node_id: str, ids: list[str]) -> None:
            node = self.nodes.get(node_id)
            if node is None or not node.alive:
                return
            try:
                await node.client.call("kill_workers", ids, grace_s, timeout=grace_s + 10)
            except Exception as e:  # its heartbeats decide whether the node is gone
                log.warning("node %s did not confirm stopping job %s's workers: %s", node_id, job_id, e)
        await asyncio.gather(*(kill(n, ids) for n, ids in by_node.items()))
        for info in infos:
            if info.state is not WorkerState.DEAD:
                self._mark_dead(info, "stopped", "")
            self.workers.pop(info.worker_id, None)
            handle = self.handles.pop(info.worker_id, None)
            if handle is not None:
                await handle.client.close()
        ids = {i.worker_id for i in infos}
        for oid in [o for o, (w, _, _) in self.objects.items() if w in ids]:
            del self.objects[oid]
        for key in [k for k, p in self.pools.items() if p.job == job_id]:
            del self.pools[key]
        self.jobs.pop(job_id, None)

    def find_job(self, job_id: str | None) -> JobRecord:
        """The job `job_id`, or the only one running when it is None; JobError says what runs."""
        if job_id is not None:
            record = self.jobs.get(job_id)
            if record is None:
                raise JobError(f"no job {job_id!r} runs on this coordinator; running: "
                               f"{', '.join(self.jobs) or 'none'}")
            return record
        if len(self.jobs) == 1:
            return next(iter(self.jobs.values()))
        if not self.jobs:
            raise JobError("no job runs on this coordinator (`asyncrl shutdown` stops a daemon)")
        raise JobError(f"{len(self.jobs)} jobs run on this coordinator ({', '.join(self.jobs)}); "
                       "name one with --job ID")

    async def shutdown_nodes(self) -> None:
        async def release(node: NodeInfo) -> None:
            try:
                await node.client.call("shutdown", timeout=2)
            except Exception as e:  # a node that is gone needs no shutdown
                log.debug("node %s shutdown: %s", node.node_id, e)
            node.liveness = NodeLiveness.RELEASED  # not failed: stop watching its heartbeats
            self.liveness.forget(node.node_id)

        await asyncio.gather(*(release(n) for n in self.live_nodes()))

    # object directory --------------------------------------------------------------------------
    def note_refs(self, value: Any, info: WorkerInfo) -> None:
        """Record where refs returned by a call live (locations only)."""
        if value is None or type(value) in _LEAVES:  # most of a reply: nothing to walk
            return
        if isinstance(value, ObjectRef):
            self.objects[value.object_id] = (info.worker_id, value.node_id, value.nbytes or 0)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.note_refs(v, info)
        elif isinstance(value, dict):
            for v in value.values():
                self.note_refs(v, info)

    # status -----------------------------------------------------------------------------------
    @expose
    async def status(self, job: str | None = None) -> ClusterStatus:
        """Nodes, workers, pools, objects and store memory; with `job`, only that job's."""
        jobs = [self.find_job(job)] if job is not None else list(self.jobs.values())
        mine = {j.job_id for j in jobs}
        workers = [w for w in self.workers.values() if job is None or w.job in mine]
        owners = {w.worker_id for w in workers}
        objects = [b for w, _, b in self.objects.values() if job is None or w in owners]
        return ClusterStatus(
            coordinator=self.endpoint,
            uptime_s=round(time.time() - self.started_at, 1),
            nodes=tuple(NodeStatus(n.node_id, n.rank, n.host, n.liveness, tuple(n.devices),
                                   round(self.liveness.silence(n.node_id) or 0.0, 2))
                        for n in sorted(self.nodes.values(), key=lambda n: n.rank)),
            workers=tuple(WorkerStatus(w.worker_id, w.group, w.rank, w.node_id, w.device, w.pid,
                                       w.state, w.exit_reason, w.job)
                          for w in workers),
            pools={p.key: [list(pl) for pl in p.placements] for p in self.pools.values()
                   if job is None or p.job in mine},
            objects={"count": len(objects), "bytes": sum(objects)},
            memory=await self.worker_memory(None if job is None else mine),
            jobs=tuple(JobStatus(j.job_id, j.name, round(j.started_at, 3),
                                 sum(1 for w in self.workers.values()
                                     if w.job == j.job_id and w.state is not WorkerState.DEAD),
                                 j.stop_reason)
                       for j in jobs),
        )

    async def worker_memory(self, jobs: set[str] | None = None) -> dict[str, Any]:
        """Per-worker object-store usage, asked of each live worker (of `jobs` when given)."""
        out = {}
        for wid, handle in list(self.handles.items()):
            if handle.info.state is WorkerState.READY and (jobs is None or handle.info.job in jobs):
                try:
                    out[wid] = await handle.client.call("store_stats", timeout=2)
                except Exception as e:  # status must work while things are failing
                    out[wid] = {"error": str(e)}
        return out

    @expose
    def stop(self, reason: str = "asyncrl stop", job: str | None = None) -> str:
        """Ask job `job` (or the only job running) to end; returns its id. Its driver is cancelled
        and its workers stopped; other jobs and the coordinator keep running."""
        record = self.find_job(job)
        record.stop_reason = reason or "asyncrl stop"
        record.stopped.set()
        log.info("job %s: stop requested (%s)", record.job_id, record.stop_reason)
        return record.job_id

    @expose
    def shutdown(self, reason: str = "asyncrl shutdown") -> bool:
        """End this coordinator's process (a daemon: every job it runs, then the daemon). The
        teardown starts a moment after this returns, so the caller gets its reply first."""
        self.stop_reason = reason
        asyncio.get_running_loop().call_later(SHUTDOWN_REPLY_S, self.stop_requested.set)
        return True


__all__ = ["Coordinator", "JobRecord", "NodeDiedError", "ResourcePool", "WorkerInfo"]
