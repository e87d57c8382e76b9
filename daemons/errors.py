"""Typed errors of the daemons layer; each says what to do next."""

from __future__ import annotations

from transport.errors import TransportError


class DaemonError(Exception):
    """Base class of errors raised by daemons/."""


class WorkerDiedError(DaemonError, TransportError):
    """A worker process exited (or stopped answering) while a call on it was pending."""

    def __init__(self, worker_id: str, node_id: str, rank: int, reason: str, log_tail: str = "",
                 consequences: list[str] | None = None, call: str = "") -> None:
        self.worker_id, self.node_id, self.rank, self.reason = worker_id, node_id, rank, reason
        self.log_tail = log_tail
        self.consequences = list(consequences or [])  # the other ranks' errors it caused
        text = f"worker {worker_id} (rank {rank} on node {node_id}) died: {reason}"
        if self.consequences:
            text += (f"\nthe other ranks' errors in {call or 'this call'} followed from it (a collective lost "
                     "its peer): " + "; ".join(self.consequences))
        if log_tail:
            text += f"\n--- last lines of its log ---\n{log_tail.rstrip()}"
        super().__init__(text)


class NodeDiedError(DaemonError):
    """A node daemon stopped heartbeating; its workers are gone."""


class JobError(DaemonError):
    """A job id names no running job, is taken, or several jobs run and none was named."""


class NotAllowedError(DaemonError, PermissionError):
    """A worker was asked to run a function or class outside its allow-list."""


class PlacementError(DaemonError):
    """A resource pool cannot be placed on the devices the cluster has."""


class CallTimeoutError(DaemonError, TimeoutError):
    """A call on a worker group did not finish within its deadline (`worker.call_timeout_s`)."""

    def __init__(self, label: str, ranks: list[int], timeout_s: float, finished: list[int]) -> None:
        self.label, self.ranks, self.timeout_s, self.finished = label, ranks, timeout_s, finished
        done = f" (ranks {finished} finished)" if finished else ""
        super().__init__(
            f"{label} did not finish on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"within {timeout_s:g}s{done}: a collective may be hung or a peer stalled (see those ranks' "
            "worker logs). Raise worker.call_timeout_s if the call needs longer (0 = no deadline).")
