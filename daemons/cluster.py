"""Starting and stopping a cluster's daemons, and the state file that lets `asyncrl` find them.

    spec = ClusterSpec(ClusterConfig(cpu_devices=2, insecure=True))
    async with HeadNode.start(spec) as head:      # coordinator + this node's daemon
        handles = await head.coordinator.spawn_workers(head.coordinator.create_pool("p"))
    async with NodeOnly.start(spec.joining("10.0.0.1:29400", node_rank=1)) as node:
        await node.daemon.stopped.wait()  # until released, or cluster.head_loss_timeout_s without
                                          # the head (ClusterSpec(daemon=True): it waits for the head)

`HeadNode.launch(spec)` / `await head.stop()` are the same without the context manager. With
`spec.write_state` the head records its endpoint and a client key pair that only this
coordinator admits (never the cluster secret) in its own state file,
`<state dir>/<spec.job_id>.json` (mode 0600, see `daemons.state`), for
`asyncrl status|stop|shutdown|submit`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from daemons.coordinator import Coordinator
from daemons.node import DEFAULT_SHM_POOL_BYTES, KEEP_JOB_LOGS, NodeDaemon
from daemons.proc import route_ip
from daemons.state import (
    ClusterState,
    StateKind,
    new_job_id,
    read_states,
    remove_state,
    state_dir,
    state_for_this_process,
    write_state,
)
from transport import CurveConfig
from transport.checks import ConfigError, check, check_positive
from transport.loop import LoopLagMonitor
from transport.peers import ServerLimits

log = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    """The `cluster` section of a job's config: every cluster knob, declared here once.

    `asyncrl-launch` reads it from the YAML and the command line and passes it, as is, to the
    daemons in a `ClusterSpec`."""

    coordinator: str | None = None
    """HOST:PORT of node 0's coordinator; None: this node hosts it."""
    port: int = 0
    """The coordinator's port on node 0 (0 = any; set one for multi-node)."""
    node_rank: int = 0  # this node's rank (0 hosts the coordinator)
    nnodes: int = 1  # nodes in the job
    host: str | None = None
    """The address this node binds and advertises; None = loopback for one node, the address
    other nodes route to for several."""
    bind: str | None = None
    """Where node 0's coordinator listens: None = cluster.host; "0.0.0.0" = every interface."""
    cpu_devices: int = 2
    """CPU "devices" per node when there is no GPU."""
    gpus_per_node: int = 0
    """GPUs each node's daemon uses: 0 = every visible GPU, N = the first N."""
    key_dir: str | None = None
    """CurveZMQ key directory (`asyncrl keys generate DIR`); None = ephemeral keys, one node only."""
    insecure: bool = False
    """Unauthenticated sockets: local tests only."""
    join: bool = False
    """This node joins a job already running (`asyncrl-launch --join HEAD:PORT` sets it): refused
    unless a job there takes such nodes (an elastic rollout pool)."""
    join_timeout_s: float = 60.0  # a joining node gives up after this long without the head
    heartbeat_interval_s: float = 1.0  # how often a node tells the coordinator it lives
    node_timeout_s: float = 5.0
    """The coordinator marks a node dead after this long without heartbeats."""
    head_loss_timeout_s: float = 20.0
    """A job's non-head node exits after this long without the head (daemon nodes wait for it)."""
    log_dir: str = "outputs/logs"  # worker logs, one folder per job
    keep_job_logs: int = KEEP_JOB_LOGS
    """Each node keeps its newest job log folders and removes older ones it made."""
    shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES
    """A pre-faulted /dev/shm block per worker store for same-node pulls (that much shared memory
    per worker, twice while refilling); 0 = off (see benchmarks/objectstore.py)."""
    max_message_bytes: int = ServerLimits.max_message_bytes
    """An RPC message above this gets an error (bulk data goes through the object store)."""
    max_connections_per_peer: int = ServerLimits.max_connections_per_peer
    """Connections one peer address may hold to one server."""
    allowed_packages: list[str] = field(default_factory=list)
    """Workers run functions and classes from these packages (`run`, hosted Worker classes)
    besides asyncrl's own and the job entry's package; e.g. ["my_rewards"]."""
    warm_imports: list[str] = field(default_factory=list)
    """Modules a CPU node's fork server imports once, as the node starts: its workers fork from
    it (milliseconds) instead of each importing them in a fresh interpreter, and a daemon's
    server stays for every later job; [] = workers start cold. GPU nodes start workers cold."""

    def check(self, at: str) -> None:
        check_positive(at + "shm_pool_bytes", self.shm_pool_bytes, allow_zero=True)
        check_positive(at + "max_message_bytes", self.max_message_bytes)
        check_positive(at + "max_connections_per_peer", self.max_connections_per_peer)
        for pkg in self.allowed_packages:
            check(isinstance(pkg, str) and re.fullmatch(r"[A-Za-z_][\w.]*", pkg) is not None,
                  at + "allowed_packages", pkg, "must be importable package names like my_pkg.rewards")
        for mod in self.warm_imports:
            check(isinstance(mod, str) and re.fullmatch(r"[A-Za-z_][\w.]*", mod) is not None,
                  at + "warm_imports", mod, "must be importable module names like asyncrl.roles.actor")
        check(self.nnodes >= 1, at + "nnodes", self.nnodes, "must be >= 1")
        check(0 <= self.node_rank < self.nnodes, at + "node_rank", self.node_rank,
              f"must be in [0, {at}nnodes={self.nnodes})")
        check(0 <= self.port <= 65535, at + "port", self.port, "must be a TCP port (0 = any)")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            check(bool(host) and port.isdigit() and 0 < int(port) <= 65535, at + "coordinator", self.coordinator,
                  "must be HOST:PORT, node 0's cluster.host and cluster.port (null on node 0 itself)")
        check_positive(at + "cpu_devices", self.cpu_devices)
        check_positive(at + "gpus_per_node", self.gpus_per_node, allow_zero=True)
        check_positive(at + "keep_job_logs", self.keep_job_logs)
        for name in ("join_timeout_s", "heartbeat_interval_s", "node_timeout_s", "head_loss_timeout_s"):
            check_positive(at + name, getattr(self, name))
        check(not Path(self.log_dir).expanduser().exists() or Path(self.log_dir).expanduser().is_dir(),
              at + "log_dir", self.log_dir, "is a file; it must be a directory (created when missing)")
        if self.nnodes > 1 and not self.key_dir and not self.insecure:
            raise ConfigError("a multi-node cluster needs shared keys: run `asyncrl keys generate DIR`, "
                              "copy DIR to every node and pass cluster.key_dir=DIR (or "
                              "cluster.insecure=true on a trusted test network)")

    @property
    def limits(self) -> ServerLimits:
        """What every RPC server of this node admits."""
        return ServerLimits(max_message_bytes=self.max_message_bytes,
                            max_connections_per_peer=self.max_connections_per_peer)

    def with_addresses(self) -> ClusterConfig:
        """This config with `host` (and node 0's `bind`) filled in: never every interface by
        default: loopback for one node, the address the other nodes route to for several."""
        if self.coordinator is None:  # node 0
            host = self.host or (route_ip("192.0.2.1") if self.nnodes > 1 else "127.0.0.1")
            return replace(self, host=host, bind=self.bind or host)
        return replace(self, host=self.host or route_ip(self.coordinator.rsplit(":", 1)[0]), bind=None)


@dataclass(frozen=True)
class ClusterSpec:
    """How to start this machine's daemons: the `cluster` section, and what only the starting
    process knows (its keys, the job, the state file)."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    curve: CurveConfig | None = None  # None with cluster.insecure
    extra_packages: tuple[str, ...] = ()  # allowed besides cluster.allowed_packages (the job entry's)
    store_memory_limit: int | None = None  # objectstore.memory_limit: bytes per worker store
    coordinator_timeout_s: float | None = None  # a node stops its workers after this (default max(10, 2 x node_timeout_s))
    register_timeout_s: float = 30.0  # HeadNode: wait this long for its own node to register
    write_state: bool = False  # HeadNode: write the state file (and remove it on stop)
    state_dir: str | os.PathLike | None = None  # None: $ASYNCRL_STATE_DIR or ~/.asyncrl/state
    job_id: str | None = None  # HeadNode: the state file's id (None: a new one from job_name)
    job_name: str = "job"
    daemon: bool = False  # a daemon: the state file names one (`asyncrl shutdown`), nodes never give up on the head

    @property
    def host(self) -> str:
        return self.cluster.host or "127.0.0.1"

    @property
    def allowed_packages(self) -> tuple[str, ...]:
        return tuple(p for p in dict.fromkeys([*self.cluster.allowed_packages, *self.extra_packages]) if p)

    def joining(self, coordinator: str, node_rank: int) -> ClusterSpec:
        """This spec for a node that joins the head at `coordinator` ("HOST:PORT" or "tcp://HOST:PORT")."""
        address = coordinator.removeprefix("tcp://")
        return replace(self, cluster=replace(self.cluster, coordinator=address, node_rank=node_rank))

    def node_daemon(self, coordinator: str) -> NodeDaemon:
        c = self.cluster
        return NodeDaemon(coordinator, node_rank=c.node_rank, host=self.host, cpu_devices=c.cpu_devices,
                          gpus_per_node=c.gpus_per_node, curve=self.curve, insecure=c.insecure, log_dir=c.log_dir,
                          heartbeat_interval_s=c.heartbeat_interval_s,
                          coordinator_timeout_s=self.coordinator_timeout_s or max(10.0, 2 * c.node_timeout_s),
                          shm_pool_bytes=c.shm_pool_bytes, store_memory_limit=self.store_memory_limit,
                          head_loss_timeout_s=None if c.node_rank == 0 or self.daemon else c.head_loss_timeout_s,
                          limits=c.limits, keep_job_logs=c.keep_job_logs, warm_imports=tuple(c.warm_imports))


# daemons ---------------------------------------------------------------------------------------
class HeadNode:
    """Node 0: the coordinator and this machine's node daemon, registered with it."""

    def __init__(self, spec: ClusterSpec, coordinator: Coordinator, node: NodeDaemon, endpoint: str) -> None:
        self.spec = spec
        self.coordinator = coordinator
        self.node = node
        self.endpoint = endpoint  # advertised "tcp://HOST:PORT"
        self.state_id = spec.job_id or new_job_id(spec.job_name)
        self.state_path: Path | None = None
        # the driver shares this loop: a warning names any stall its code causes (heartbeats
        # are unaffected, see daemons.liveness)
        self.loop_lag = LoopLagMonitor("driver", threshold_s=max(1.0, spec.cluster.heartbeat_interval_s))

    @classmethod
    async def launch(cls, spec: ClusterSpec) -> HeadNode:
        """Start the coordinator and the node daemon, wait for the node to register, and write
        the state file when `spec.write_state`."""
        c = spec.cluster
        coordinator = Coordinator(f"tcp://{c.bind or spec.host}:{c.port}", curve=spec.curve,
                                  insecure=c.insecure, node_timeout=c.node_timeout_s,
                                  limits=c.limits, allowed_packages=spec.allowed_packages)
        await coordinator.start()
        endpoint = f"tcp://{spec.host}:{coordinator.endpoint.rsplit(':', 1)[1]}"
        node = spec.node_daemon(endpoint)
        head = cls(spec, coordinator, node, endpoint)
        head.loop_lag.start()
        try:
            await node.start()
            if spec.write_state:
                head.state_path = write_state(state_for_this_process(
                    endpoint, spec.curve is None, coordinator.cli_curve.to_env() if coordinator.cli_curve else None,
                    head.state_id, spec.job_name, StateKind.DAEMON if spec.daemon else StateKind.JOB),
                    spec.state_dir)
            await node.wait_registered(spec.register_timeout_s)
        except BaseException:
            await head.stop()
            raise
        log.info("head node up: coordinator %s (%s)", endpoint,
                 "insecure" if c.insecure else "CurveZMQ")
        return head

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, spec: ClusterSpec, *, release_nodes: bool = True) -> AsyncIterator[HeadNode]:
        """`async with HeadNode.start(spec) as head:`; stops everything on exit."""
        head = await cls.launch(spec)
        try:
            yield head
        finally:
            await head.stop(release_nodes=release_nodes)

    async def stop(self, *, release_nodes: bool = True, grace_s: float = 3.0) -> None:
        """Stop every worker, release the nodes (unless `release_nodes` is False: daemon nodes
        outlive a coordinator restart and re-register), close both daemons, remove the state file."""
        self.loop_lag.stop()
        try:
            await self.coordinator.shutdown_workers(grace_s=grace_s)
            if release_nodes:
                await self.coordinator.shutdown_nodes()
            await self.node.close()
            await self.coordinator.close()
        finally:
            if self.state_path is not None:
                remove_state(self.state_id, self.spec.state_dir)
                self.state_path = None


class NodeOnly:
    """Node k > 0: a node daemon that joins the coordinator at `spec.cluster.coordinator`."""

    def __init__(self, spec: ClusterSpec, daemon: NodeDaemon) -> None:
        self.spec = spec
        self.daemon = daemon

    @classmethod
    async def launch(cls, spec: ClusterSpec, *, wait_registered: float | None = None) -> NodeOnly:
        """Start the node daemon; with `wait_registered` seconds, wait until it has joined
        (TimeoutError after that)."""
        if not spec.cluster.coordinator:
            raise ValueError("NodeOnly needs spec.cluster.coordinator, the head's HOST:PORT")
        node = cls(spec, spec.node_daemon(f"tcp://{spec.cluster.coordinator}"))
        await node.daemon.start()
        if wait_registered is not None:
            try:
                await node.daemon.wait_registered(wait_registered)
            except BaseException:
                await node.stop()
                raise
        return node

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, spec: ClusterSpec, *, wait_registered: float | None = None) -> AsyncIterator[NodeOnly]:
        node = await cls.launch(spec, wait_registered=wait_registered)
        try:
            yield node
        finally:
            await node.stop()

    async def stop(self) -> None:
        """Kill this node's workers and close the daemon."""
        await self.daemon.close()


# the state file API lives in daemons.state; re-exported for callers of this module
__all__ = ["ClusterConfig", "ClusterSpec", "ClusterState", "HeadNode", "NodeOnly", "read_states", "remove_state", "state_dir",
           "write_state"]
