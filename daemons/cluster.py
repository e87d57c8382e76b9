"""Starting and stopping a cluster's daemons, and the state file that lets `asyncrl` find them.

    spec = ClusterSpec(cpu_devices=2, insecure=True)
    async with HeadNode.start(spec) as head:      # coordinator + this node's daemon
        handles = await head.coordinator.spawn_workers(head.coordinator.create_pool("p"))
    async with NodeOnly.start(spec.joining("tcp://10.0.0.1:29400", node_rank=1)) as node:
        await node.daemon.stopped.wait()           # serve until the coordinator releases us

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from daemons.coordinator import Coordinator
from daemons.node import DEFAULT_SHM_POOL_BYTES, KEEP_JOB_LOGS, NodeDaemon
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
from transport.loop import LoopLagMonitor
from transport.peers import ServerLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSpec:
    """How to start this machine's daemons."""

    host: str = "127.0.0.1"  # address this node binds and advertises
    bind: str | None = None  # the coordinator's bind address (default: host; "0.0.0.0" for all)
    limits: ServerLimits = ServerLimits()  # what every server of this node admits
    allowed_packages: tuple[str, ...] = ()  # workers run code from these and asyncrl's packages
    port: int = 0  # the coordinator's port (0: any)
    coordinator: str | None = None  # NodeOnly: the head's "tcp://HOST:PORT"
    node_rank: int = 0
    cpu_devices: int = 2  # CPU "devices" when the node has no GPU
    gpus_per_node: int = 0  # GPUs a node's daemon uses: 0 = every visible one
    curve: CurveConfig | None = None
    insecure: bool = False
    log_dir: str | os.PathLike = "outputs/logs"
    keep_job_logs: int = KEEP_JOB_LOGS  # a node's newest job log folders kept; older ones go
    heartbeat_interval_s: float = 1.0
    node_timeout_s: float = 5.0  # the coordinator marks a silent node dead after this
    coordinator_timeout_s: float | None = None  # a node stops its workers after this (default max(10, 2 x node_timeout_s))
    head_loss_timeout_s: float | None = None  # NodeOnly: the daemon stops after this long without the head (None: never)
    register_timeout_s: float = 30.0  # HeadNode: wait this long for its own node to register
    shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES  # per worker store; see daemons.node
    store_memory_limit: int | None = None  # bytes per worker store; None: objectstore.memory's default
    write_state: bool = False  # HeadNode: write the state file (and remove it on stop)
    state_dir: str | os.PathLike | None = None  # None: $ASYNCRL_STATE_DIR or ~/.asyncrl/state
    job_id: str | None = None  # HeadNode: the state file's id (None: a new one from job_name)
    job_name: str = "job"
    daemon: bool = False  # HeadNode: the state file names a daemon (`asyncrl shutdown`), not a job

    def joining(self, coordinator: str, node_rank: int) -> ClusterSpec:
        """This spec for a node that joins the head at `coordinator`."""
        return replace(self, coordinator=coordinator, node_rank=node_rank)

    def node_daemon(self, coordinator: str) -> NodeDaemon:
        return NodeDaemon(coordinator, node_rank=self.node_rank, host=self.host,
                          cpu_devices=self.cpu_devices, gpus_per_node=self.gpus_per_node, curve=self.curve, insecure=self.insecure,
                          log_dir=self.log_dir, heartbeat_interval=self.heartbeat_interval_s,
                          coordinator_timeout=(self.coordinator_timeout_s
                                               or max(10.0, 2 * self.node_timeout_s)),
                          shm_pool_bytes=self.shm_pool_bytes, store_memory_limit=self.store_memory_limit,
                          head_loss_timeout=None if self.node_rank == 0 else self.head_loss_timeout_s,
                          limits=self.limits, keep_job_logs=self.keep_job_logs)


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
        self.loop_lag = LoopLagMonitor("driver", threshold_s=max(1.0, spec.heartbeat_interval_s))

    @classmethod
    async def launch(cls, spec: ClusterSpec) -> HeadNode:
        """Start the coordinator and the node daemon, wait for the node to register, and write
        the state file when `spec.write_state`."""
        coordinator = Coordinator(f"tcp://{spec.bind or spec.host}:{spec.port}", curve=spec.curve,
                                  insecure=spec.insecure, node_timeout=spec.node_timeout_s,
                                  limits=spec.limits, allowed_packages=spec.allowed_packages)
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
                 "insecure" if spec.insecure else "CurveZMQ")
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
    """Node k > 0: a node daemon that joins the coordinator at `spec.coordinator`."""

    def __init__(self, spec: ClusterSpec, daemon: NodeDaemon) -> None:
        self.spec = spec
        self.daemon = daemon

    @classmethod
    async def launch(cls, spec: ClusterSpec, *, wait_registered: float | None = None) -> NodeOnly:
        """Start the node daemon; with `wait_registered` seconds, wait until it has joined
        (TimeoutError after that)."""
        if not spec.coordinator:
            raise ValueError("NodeOnly needs spec.coordinator, the head's tcp://HOST:PORT")
        node = cls(spec, spec.node_daemon(spec.coordinator))
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
__all__ = ["ClusterSpec", "ClusterState", "HeadNode", "NodeOnly", "read_states", "remove_state", "state_dir",
           "write_state"]
