"""Typed messages between the coordinator, node daemons, workers and the CLI.

Each is a frozen dataclass registered with `transport.codec.message`, so it travels as a short
msgpack list under its extension code (`transport.wire.Ext`), and an unknown enum value on the
wire is a `CodecError`, not a silently wrong state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from transport.codec import message
from transport.wire import Ext


class WorkerState(enum.StrEnum):
    STARTING = "starting"  # spawned, not yet reported ready
    READY = "ready"  # serving calls
    DEAD = "dead"  # exited, killed, or its node died


class NodeLiveness(enum.StrEnum):
    ALIVE = "alive"  # heartbeating
    DEAD = "dead"  # missed heartbeats for node_timeout
    RELEASED = "released"  # told to shut down by the coordinator


@message(Ext.NODE_REGISTRATION)
@dataclass(frozen=True, slots=True)
class NodeRegistration:
    """Node -> coordinator: a node daemon joins (or re-joins) the cluster."""

    node_id: str
    rank: int
    host: str
    endpoint: str  # the node daemon's RPC endpoint
    devices: tuple[str, ...]


@message(Ext.WORKER_SPEC)
@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Coordinator -> node: start one worker process with `env` added to the node's environment;
    its log goes to `<log_dir>/<job_id>/`."""

    worker_id: str
    env: dict[str, str] = field(default_factory=dict)
    job_id: str = ""


@message(Ext.WORKER_READY)
@dataclass(frozen=True, slots=True)
class WorkerReady:
    """Worker -> coordinator: the worker serves calls at `endpoint`, its store at `store_endpoint`."""

    worker_id: str
    endpoint: str
    store_endpoint: str
    pid: int


@message(Ext.WORKER_EXIT)
@dataclass(frozen=True, slots=True)
class WorkerExit:
    """Node -> coordinator: a worker process ended."""

    worker_id: str
    code: int
    reason: str  # "exited with code 1", "killed by SIGKILL", …
    log_tail: str = ""


@message(Ext.CHILD_STATUS)
@dataclass(frozen=True, slots=True)
class ChildStatus:
    """One worker process as its node daemon sees it."""

    pid: int
    state: str  # the process's exit reason, or "still running"
    log: str  # path of its log file


@message(Ext.NODE_INFO)
@dataclass(frozen=True, slots=True)
class NodeInfoReply:
    """Node daemon `info`: its devices and the worker processes it started."""

    node_id: str
    host: str
    devices: tuple[str, ...]
    workers: dict[str, ChildStatus]


@message(Ext.NODE_STATUS)
@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: str
    rank: int
    host: str
    liveness: NodeLiveness
    devices: tuple[str, ...]
    last_heartbeat_s: float


@message(Ext.WORKER_STATUS)
@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker_id: str
    group: str
    rank: int
    node_id: str
    device: str
    pid: int
    state: WorkerState
    exit: str
    job: str = ""  # the id of the job that spawned it


@message(Ext.JOB_STATUS)
@dataclass(frozen=True, slots=True)
class JobStatus:
    """One job a coordinator runs (embedded: its own; a daemon: each submitted one)."""

    job_id: str
    name: str
    started_at: float  # time.time()
    workers: int  # its live worker processes
    stopping: str = ""  # why it is being stopped, once it is


@message(Ext.CLUSTER_STATUS)
@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """Coordinator `status`: nodes, workers, pools, the object directory and store memory."""

    coordinator: str
    uptime_s: float
    nodes: tuple[NodeStatus, ...]
    workers: tuple[WorkerStatus, ...]
    pools: dict[str, list[list[str]]]  # pool name -> [(node id, device)] in rank order
    objects: dict[str, int]  # {"count": n, "bytes": n}
    memory: dict[str, Any]  # worker id -> its store's stats (or {"error": ...})
    jobs: tuple[JobStatus, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`asyncrl status --json`)."""
        return {
            "coordinator": self.coordinator, "uptime_s": self.uptime_s,
            "nodes": [{"node_id": n.node_id, "rank": n.rank, "host": n.host,
                       "alive": n.liveness is NodeLiveness.ALIVE, "liveness": n.liveness.value,
                       "devices": list(n.devices), "last_heartbeat_s": n.last_heartbeat_s}
                      for n in self.nodes],
            "workers": [{"worker_id": w.worker_id, "group": w.group, "rank": w.rank,
                         "node_id": w.node_id, "device": w.device, "pid": w.pid,
                         "state": w.state.value, "exit": w.exit, "job": w.job} for w in self.workers],
            "pools": {k: [list(p) for p in v] for k, v in self.pools.items()},
            "objects": dict(self.objects), "memory": dict(self.memory),
            "jobs": [{"job_id": j.job_id, "name": j.name, "started_at": j.started_at,
                      "workers": j.workers, "stopping": j.stopping} for j in self.jobs],
        }
