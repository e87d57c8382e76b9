"""Typed errors of the daemons layer; each says what to do next."""

from __future__ import annotations

from transport.errors import TransportError


class DaemonError(Exception):
    """Base class of errors raised by daemons/."""


class ConfigError(DaemonError, ValueError):
    """A configuration value is wrong; the message names the key and how to fix it."""


class WorkerDiedError(DaemonError, TransportError):
    """A worker process exited (or stopped answering) while a call on it was pending."""

    def __init__(self, worker_id: str, node_id: str, rank: int, reason: str, log_tail: str = "") -> None:
        self.worker_id, self.node_id, self.rank, self.reason = worker_id, node_id, rank, reason
        self.log_tail = log_tail
        text = f"worker {worker_id} (rank {rank} on node {node_id}) died: {reason}"
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
