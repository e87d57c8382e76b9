"""What a server admits from its peers: size and connection limits, and rate-limited logs of refusals.

`ServerLimits` is the one place their defaults live (the cluster config reads them from here).
`PeerLimiter` caps a ZeroMQ server's TCP connections per peer address: libzmq has no such
option, so it watches the socket's monitor (a connection's ACCEPTED and DISCONNECTED events
carry its file descriptor), reads the peer address of each new connection, and shuts down the
ones above the cap; libzmq then drops them as if the peer had hung up. `RateLimitedLog` turns a
flood of refusals into one WARNING line per interval with a count, instead of a line each.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, fields

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

_ENV_PREFIX = "ASYNCRL_NET_"


@dataclass(frozen=True)
class ServerLimits:
    """Limits every RPC server of a cluster applies to what its peers send."""

    # a message (all its frames) above this gets a MessageTooLarge error reply; bulk data goes
    # through the object store, whose TCP path has no such limit
    max_message_bytes: int = 4 << 30
    # TCP connections one peer address may hold open to one server; more are closed at once
    max_connections_per_peer: int = 256
    # a connection that has not finished the CurveZMQ handshake by then is dropped
    handshake_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0 or self.max_connections_per_peer <= 0 or self.handshake_timeout_s <= 0:
            raise ValueError(f"server limits must be positive: {self}")

    def to_env(self) -> dict[str, str]:
        """Environment variables that hand these limits to a child process."""
        return {_ENV_PREFIX + k.upper(): str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerLimits:
        env = os.environ if env is None else env
        kw = {}
        for f in fields(cls):
            raw = env.get(_ENV_PREFIX + f.name.upper())
            if raw is not None:
                kw[f.name] = float(raw) if f.type in (float, "float") else int(raw)
        return cls(**kw)


class RateLimitedLog:
    """One WARNING per `interval_s` for a repeated event (the first at once), with a count per key.

    `RateLimitedLog(log, "bulk: refused connections").note("10.0.0.7", "unknown token")` logs
    "bulk: refused connections: 1 (10.0.0.7 x1): unknown token"; a thousand more notes within
    the interval become one line at the next note after it, or at `flush()`.
    """

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0) -> None:
        self.logger, self.what, self.interval_s = logger, what, interval_s
        self.total = 0
        self._pending: collections.Counter[str] = collections.Counter()
        self._reason = ""
        self._last = float("-inf")

    def note(self, key: str, reason: str) -> None:
        self.total += 1
        self._pending[key] += 1
        self._reason = reason
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self.flush()
            self._last = now

    def flush(self) -> None:
        if not self._pending:
            return
        count = sum(self._pending.values())
        keys = ", ".join(f"{k} x{n}" for k, n in self._pending.most_common(3))
        more = len(self._pending) - 3
        self.logger.warning("%s: %d (%s%s): %s", self.what, count, keys,
                            f" and {more} more" if more > 0 else "", self._reason)
        self._pending.clear()


def _peer_host(fd: int, local_port: int) -> tuple[str, socket.socket] | None:
    """The peer address of our accepted TCP connection `fd` (and a dup to act on), or None when
    `fd` is no longer such a connection (closed, or reused for something else)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] != local_port:
            sock.close()
            return None
        return sock.getpeername()[0], sock
    except OSError:
        sock.close()
        return None


class PeerLimiter:
    """Closes a server socket's TCP connections above `cap` per peer address (see module docs)."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED

    def __init__(self, sock: zmq.Socket, cap: int, name: str) -> None:
        self.cap, self.name = cap, name
        self.local_port = 0
        self.monitor = sock.get_monitor_socket(self.EVENTS)
        self.open: collections.Counter[str] = collections.Counter()
        self._by_fd: dict[int, str] = {}
        self.refusals = RateLimitedLog(log, f"{name}: refused connections")

    def bound(self, endpoint: str) -> None:
        """Tell the limiter the server's bound endpoint (only tcp:// endpoints are limited)."""
        if endpoint.startswith("tcp://"):
            self.local_port = int(endpoint.rsplit(":", 1)[1])

    @property
    def refused(self) -> int:
        return self.refusals.total

    def on_event(self, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        fd = event["value"]
        if event["event"] == zmq.EVENT_DISCONNECTED:
            host = self._by_fd.pop(fd, None)
            if host is not None:
                self.open[host] -= 1
                if self.open[host] <= 0:
                    del self.open[host]
            return
        if event["event"] != zmq.EVENT_ACCEPTED or not self.local_port:
            return
        found = _peer_host(fd, self.local_port)
        if found is None:
            return
        host, sock = found
        try:
            if self._by_fd.pop(fd, None) is not None:  # a missed disconnect of a reused fd
                self.open[host] -= 1
            self._by_fd[fd] = host
            self.open[host] += 1
            if self.open[host] > self.cap:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # libzmq sees the hang-up and drops it
                except OSError:
                    pass
                self.refusals.note(host, f"over the cap of {self.cap} connections per peer; "
                                         "raise cluster.max_connections_per_peer if this peer is legitimate")
        finally:
            sock.close()  # our dup only
