"""Asynchronous RPC over ZeroMQ: `RpcServer` (ROUTER) and `RpcClient` (DEALER).

Every message is a list of frames made by `transport.codec`; its body is an msgpack array
whose first item is the message kind:

    REQUEST  [0, id, method, args, kwargs]      client -> server, answered by REPLY or ERROR
    NOTIFY   [1, 0, method, args, kwargs]       client -> server, never answered
    REPLY    [2, id, result]                    server -> client
    ERROR    [3, id, [type, message, traceback]]
    PING     [4, seq] / PONG [5, seq]           liveness; answered by the server's receive loop
    CANCEL   [6, id]                            the caller gave up on request `id`

Many requests share one connection and are matched by id. A server keeps serving whatever a
single peer sends: garbage is counted and, where a request id can be read, answered with an
error. Sockets are CurveZMQ-authenticated unless the caller passes `insecure=True`.

What a server admits is bounded before anything is allocated for it (`transport.peers`): under
CurveZMQ no frame above `codec.FRAME_BYTES` (libzmq drops the connection on the frame header,
also during the handshake, so a peer without a key makes a server hold at most that per
connection; larger frames travel in chunks), at most `max_connections_per_peer` connections per
peer address, a handshake timeout, and messages above `max_message_bytes` answered with an
error. Without keys (`insecure=True`, a local test setup) any peer is admitted, so frames
travel whole: chunking would bound nothing there and costs a copy on each side.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import itertools
import logging
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from transport import codec
from transport.auth import CurveConfig, secure_client_socket, secure_server_socket
from transport.errors import (
    AuthenticationError,
    CodecError,
    ConnectionLost,
    RemoteError,
    RpcTimeout,
    TransportError,
)
from transport.peers import PeerLimiter, RateLimitedLog, ServerLimits
from transport.socket import MessageSocket

log = logging.getLogger(__name__)

REQUEST, NOTIFY, REPLY, ERROR, PING, PONG, CANCEL = range(7)

DEFAULT_MAX_MESSAGE_BYTES = ServerLimits.max_message_bytes
# ZMQ_MAXMSGSIZE counts a frame as it arrives: under CurveZMQ that is the encrypted frame, a
# chunk of FRAME_BYTES plus the MESSAGE command's nonce, flags and MAC
_FRAME_SLACK = 1024
_SECURITY_HINT = (
    "pass curve=CurveConfig.load(KEY_DIR) (keys from `asyncrl keys generate KEY_DIR`), or "
    "insecure=True for a local-only test setup"
)


def _frame_cap(curve: CurveConfig | None) -> int:
    """ZMQ_MAXMSGSIZE of an RPC socket: one chunk under CurveZMQ, none without keys."""
    return codec.FRAME_BYTES + _FRAME_SLACK if curve is not None else -1


# request ids, process-wide: one encoded request can go to several servers (a group call)
_REQUEST_IDS = itertools.count(1)


def encode_request(method: str, args: tuple | list = (), kwargs: dict | None = None) -> tuple[int, list[Any]]:
    """A request's id and frames, for `RpcClient.send_request` to one or more servers."""
    req_id = next(_REQUEST_IDS)
    return req_id, codec.encode([REQUEST, req_id, method, args, kwargs or {}], split=False)


class ReplySink(Protocol):
    """Where `RpcClient.send_to` delivers a reply: called on the loop, must not raise."""

    def reply(self, key: Any, value: Any) -> None: ...

    def fail(self, key: Any, exc: BaseException) -> None: ...


def shared_context() -> zmq.Context:
    """The process-wide ZeroMQ context."""
    return zmq.Context.instance()


def expose(fn: Callable | None = None, *, blocking: bool = False):
    """Mark a method for `RpcServer.register_object`; `blocking=True` runs it in a thread."""

    def mark(f: Callable) -> Callable:
        f.__rpc_expose__ = {"blocking": blocking}
        return f

    return mark(fn) if fn is not None else mark


@dataclass
class _Handler:
    fn: Callable
    is_async: bool
    blocking: bool


def _error_payload(exc: BaseException) -> list[str]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return [f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb]


class RpcServer:
    """Serves registered handlers on one ROUTER socket.

    Sync handlers run inline on the event loop (keep them short); `blocking=True` handlers run
    in a thread pool; `async def` handlers run as tasks and can be cancelled by the caller.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveConfig | None = None,
        insecure: bool = False,
        limits: ServerLimits | None = None,
        max_threads: int = 4,
        name: str = "rpc",
        context: zmq.Context | None = None,
    ) -> None:
        if curve is None and not insecure:
            raise AuthenticationError(f"RpcServer({endpoint}) has no keys: {_SECURITY_HINT}")
        self.requested_endpoint = endpoint
        self.endpoint = endpoint
        self.name = name
        self.curve = curve
        self.limits = limits or ServerLimits()
        self.max_message_bytes = self.limits.max_message_bytes
        self._peers: PeerLimiter | None = None
        self._peer_monitor: MessageSocket | None = None
        self._ctx = context or shared_context()
        self._handlers: dict[str, _Handler] = {}
        self._restricted: dict[str, frozenset[str]] = {}  # client key (z85) -> methods it may call
        self._inflight: dict[tuple[bytes, int], asyncio.Future] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=f"{name}-h")
        self._sock: MessageSocket | None = None
        self.stats: dict[str, int] = dict.fromkeys(
            ("requests", "notifications", "pings", "cancels", "handler_errors", "malformed",
             "unknown_method", "too_large", "dropped"), 0)
        self._malformed = RateLimitedLog(log, f"{name}: malformed messages dropped")

    # registration -----------------------------------------------------------------------
    def register(self, name: str, fn: Callable, *, blocking: bool = False) -> None:
        self._handlers[name] = _Handler(fn, inspect.iscoroutinefunction(fn), blocking)

    def register_object(self, obj: Any, prefix: str = "") -> list[str]:
        """Register every method of `obj` marked with `@expose`; returns their names."""
        names = []
        for attr in dir(type(obj)):
            meta = getattr(getattr(type(obj), attr, None), "__rpc_expose__", None)
            if meta is not None:
                self.register(prefix + attr, getattr(obj, attr), blocking=meta["blocking"])
                names.append(prefix + attr)
        return names

    def restrict_client(self, public_key: bytes, methods: set[str] | frozenset[str]) -> None:
        """Let the CurveZMQ client presenting `public_key` call only `methods` (a key shared
        with less trusted processes, say); other clients are unaffected."""
        self._restricted[public_key.decode()] = frozenset(methods)

    @property
    def methods(self) -> list[str]:
        return sorted(self._handlers)

    @property
    def bytes_transferred(self) -> tuple[int, int]:
        """(bytes sent, bytes received) by this server so far, identity frames included."""
        return (self._sock.bytes_sent, self._sock.bytes_received) if self._sock else (0, 0)

    # lifecycle --------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and start serving; returns the bound endpoint (tcp port 0 is resolved)."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = False
        sock.rcvhwm = 0
        sock.sndhwm = 0
        # Under CurveZMQ no frame above FRAME_BYTES is ever allocated (senders cut larger ones into
        # chunks), so a peer without a key holds at most that per connection; see the module
        # docstring. Without keys there is no handshake to protect: frames travel whole.
        sock.maxmsgsize = _frame_cap(self.curve)
        sock.handshake_ivl = int(self.limits.handshake_timeout_s * 1000)
        self._peers = PeerLimiter(sock, self.limits.max_connections_per_peer, self.name)
        if self.curve is not None:
            secure_server_socket(sock, self.curve, domain=f"asyncrl-{self.name}-{os.getpid()}-{id(self)}")
        try:
            sock.bind(self.requested_endpoint)
        except zmq.ZMQError as e:
            self._peers.monitor.close(0)
            sock.close(0)
            raise TransportError(f"cannot bind {self.requested_endpoint}: {e}") from e
        self.endpoint = sock.get_string(zmq.LAST_ENDPOINT)
        self._peers.bound(self.endpoint)
        self._peer_monitor = MessageSocket(self._peers.monitor, self._peers.on_event,
                                           name=f"{self.name}-peers")
        self._sock = MessageSocket(sock, self._on_message, name=self.name, max_bytes=self.max_message_bytes,
                                   chunked=self.curve is not None)
        return self.endpoint

    @property
    def refused_connections(self) -> int:
        """Connections closed for exceeding the per-peer cap."""
        return self._peers.refused if self._peers is not None else 0

    async def close(self) -> None:
        for fut in list(self._inflight.values()):
            fut.cancel()
        self._inflight.clear()
        if self._sock is not None:
            try:
                self._sock.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close()
            self._sock = None
        if self._peer_monitor is not None:
            self._peer_monitor.close()
            self._peer_monitor = None
            self._peers.refusals.flush()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # serving ----------------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        try:
            self._dispatch(frames)
        except Exception:  # the server must survive anything a peer sends
            self.stats["dropped"] += 1
            log.exception("%s: unexpected failure handling a message", self.name)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send([identity, *frames])
        except zmq.ZMQError as e:
            self.stats["dropped"] += 1
            log.warning("%s: reply could not be sent: %s", self.name, e)

    def _reply_error(self, identity: bytes, req_id: int, etype: str, message: str, tb: str = "") -> None:
        self._send(identity, codec.encode([ERROR, req_id, [etype, message, tb]], split=False))

    def _drop_malformed(self, why: str) -> None:
        self.stats["malformed"] += 1
        self._malformed.note(why, "a peer sent messages that are not asyncrl RPC (wrong version or "
                                  "a stray client?); nothing was answered")

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            self._drop_malformed("no body")
            return
        size = sum(len(f) for f in frames[1:])
        if size > self.max_message_bytes:
            self.stats["too_large"] += 1
            req_id = self._peek_request_id(frames[1:])
            if req_id is not None:
                self._reply_error(identity, req_id, "transport.MessageTooLarge",
                                  f"message of {size} bytes exceeds this server's limit of "
                                  f"{self.max_message_bytes} (cluster.max_message_bytes); send bulk "
                                  "data through the object store")
            return
        try:
            msg = codec.decode([f.buffer for f in frames[1:]])
            kind = msg[0] if isinstance(msg, list) and msg else None
        except CodecError as e:
            req_id = self._peek_request_id(frames[1:])
            if req_id is None:
                self._drop_malformed("undecodable")
            else:
                self.stats["malformed"] += 1
                self._reply_error(identity, req_id, "transport.MalformedMessage", str(e))
            return
        if kind == REQUEST or kind == NOTIFY:
            if not (len(msg) == 5 and isinstance(msg[1], int) and isinstance(msg[2], str)
                    and isinstance(msg[3], list) and isinstance(msg[4], dict)):
                if kind == REQUEST and len(msg) > 1 and isinstance(msg[1], int):
                    self.stats["malformed"] += 1
                    self._reply_error(identity, msg[1], "transport.MalformedMessage",
                                      "a request must be [0, id, method, args, kwargs]")
                else:
                    self._drop_malformed("bad request")
                return
            allowed = self._allowed_methods(frames[1]) if self._restricted else None
            if allowed is not None and msg[2] not in allowed:
                self.stats["unknown_method"] += 1
                if kind == REQUEST:
                    self._reply_error(identity, msg[1], "transport.NotPermitted",
                                      f"{self.name} does not let this client's key call {msg[2]!r}, only "
                                      f"{', '.join(sorted(allowed))}; use a key with more rights")
                return
            self._handle_call(identity, kind, msg[1], msg[2], msg[3], msg[4])
        elif kind == PING:
            seq = msg[1] if len(msg) > 1 else 0
            if not isinstance(seq, int):
                self._drop_malformed("bad ping")
                return
            self.stats["pings"] += 1
            self._send(identity, codec.encode([PONG, seq], split=False))
        elif kind == CANCEL:
            if len(msg) != 2 or not isinstance(msg[1], int):
                self._drop_malformed("bad cancel")
                return
            self.stats["cancels"] += 1
            fut = self._inflight.pop((identity, msg[1]), None)
            if fut is not None:
                fut.cancel()
        else:
            self._drop_malformed("unknown kind")

    def _allowed_methods(self, frame: zmq.Frame) -> frozenset[str] | None:
        """The methods the client that sent `frame` is limited to; None: no limit."""
        try:
            key = frame.get("User-Id")  # set by the ZAP handler: the client's z85 public key
        except zmq.ZMQError:
            return None
        return self._restricted.get(key)

    @staticmethod
    def _peek_request_id(body: list[zmq.Frame]) -> int | None:
        """Best effort: the request id of a body that failed to decode, so the caller hears back."""
        try:
            (first,) = codec.join_frames([f.buffer for f in body], first=1)
            msg = msgpack.unpackb(first, ext_hook=lambda code, data: None, raw=False,
                                  strict_map_key=False)
        except Exception:
            return None
        if isinstance(msg, list) and len(msg) >= 2 and msg[0] == REQUEST and isinstance(msg[1], int):
            return msg[1]
        return None

    def _handle_call(self, identity: bytes, kind: int, req_id: int, method: str,
                     args: list, kwargs: dict) -> None:
        is_request = kind == REQUEST
        self.stats["requests" if is_request else "notifications"] += 1
        handler = self._handlers.get(method)
        if handler is None:
            self.stats["unknown_method"] += 1
            if is_request:
                known = ", ".join(self.methods[:20])
                self._reply_error(identity, req_id, "transport.MethodNotFound",
                                  f"{self.name} has no method {method!r}; it serves: {known}")
            else:
                log.warning("%s: notification for unknown method %r dropped", self.name, method)
            return
        if handler.is_async or handler.blocking:
            loop = asyncio.get_running_loop()
            if handler.is_async:
                try:
                    coro = handler.fn(*args, **kwargs)
                except Exception as e:  # wrong arguments fail before a coroutine exists
                    self._handler_failed(identity, req_id, is_request, method, e)
                    return
                fut = loop.create_task(coro, name=f"{self.name}:{method}")
            else:
                fut = loop.run_in_executor(self._executor, lambda: handler.fn(*args, **kwargs))
            if is_request:
                key = (identity, req_id)
                self._inflight[key] = fut
                fut.add_done_callback(lambda f: self._finish(identity, req_id, key, f, method))
            else:
                fut.add_done_callback(lambda f: self._finish_notify(f, method))
            return
        try:
            result = handler.fn(*args, **kwargs)
        except Exception as e:
            self._handler_failed(identity, req_id, is_request, method, e)
            return
        if is_request:
            self._send_result(identity, req_id, result, method)

    def _handler_failed(self, identity: bytes, req_id: int, is_request: bool, method: str,
                        e: Exception) -> None:
        self.stats["handler_errors"] += 1
        if is_request:
            self._send(identity, codec.encode([ERROR, req_id, _error_payload(e)], split=False))
        else:
            log.warning("%s: notification %s failed: %r", self.name, method, e)

    def _send_result(self, identity: bytes, req_id: int, result: Any, method: str) -> None:
        try:
            frames = codec.encode([REPLY, req_id, result], split=False)
        except CodecError as e:
            self.stats["handler_errors"] += 1
            self._reply_error(identity, req_id, "transport.CodecError",
                              f"the result of {method!r} cannot be sent: {e}")
            return
        self._send(identity, frames)

    def _finish(self, identity: bytes, req_id: int, key: tuple, fut: asyncio.Future, method: str) -> None:
        self._inflight.pop(key, None)
        if fut.cancelled() or self._sock is None:
            return
        exc = fut.exception()
        if exc is not None:
            self.stats["handler_errors"] += 1
            self._send(identity, codec.encode([ERROR, req_id, _error_payload(exc)], split=False))
        else:
            self._send_result(identity, req_id, fut.result(), method)

    def _finish_notify(self, fut: asyncio.Future, method: str) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self.stats["handler_errors"] += 1
            log.warning("%s: notification %s failed: %r", self.name, method, fut.exception())


class RpcClient:
    """One DEALER connection to an `RpcServer`; any number of calls in flight.

    A call fails with `ConnectionLost` once the server has been silent for `heartbeat_timeout`
    seconds while the call waits, with `AuthenticationError` when the CURVE handshake is
    refused, and with `RpcTimeout` after its own `timeout`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveConfig | None = None,
        insecure: bool = False,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        name: str = "client",
        context: zmq.Context | None = None,
    ) -> None:
        if curve is None and not insecure:
            raise AuthenticationError(f"RpcClient({endpoint}) has no keys: {_SECURITY_HINT}")
        self.endpoint = endpoint
        self.name = name
        self.curve = curve
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._ctx = context or shared_context()
        self._pending: dict[int, asyncio.Future | tuple[ReplySink, Any]] = {}
        self._sock: MessageSocket | None = None
        self._monitor: MessageSocket | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_heard = 0.0
        self._waiting_since = 0.0
        self._auth_failure: AuthenticationError | None = None
        self._closed = False
        self._closed_bytes = (0, 0)
        # requests this client sent by method, their bytes and their replies' (heartbeats not counted)
        self.requests: collections.Counter[str] = collections.Counter()
        self.request_bytes = self.reply_bytes = 0
        self._handshake_ok = False
        self._dropped = False  # the connection dropped and has not come back
        self.authenticated_once = False  # a handshake with this server succeeded at least once

    @property
    def connection_dropped(self) -> bool:
        """Whether the server's connection dropped (it exited?) and has not been re-established."""
        return self._dropped

    def _ensure_open(self) -> MessageSocket:
        if self._sock is not None:
            return self._sock
        if self._closed:
            raise ConnectionLost(f"client for {self.endpoint} is closed")
        self._loop = asyncio.get_running_loop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.maxmsgsize = _frame_cap(self.curve)  # a hostile server is bounded too
        if self.curve is not None:
            secure_client_socket(sock, self.curve)
        # A dropped connection loses whatever was in flight on it, so pending calls must fail
        # then rather than wait for replies that cannot come.
        monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._monitor = MessageSocket(monitor, self._on_monitor_event, name=f"{self.name}-monitor")
        sock.connect(self.endpoint)
        self._sock = MessageSocket(sock, self._on_message, name=self.name, max_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                                   chunked=self.curve is not None)
        self._last_heard = self._loop.time()
        self._heartbeat_task = self._loop.create_task(self._heartbeat(), name=f"{self.name}-heartbeat")
        return self._sock

    @property
    def bytes_transferred(self) -> tuple[int, int]:
        """(bytes sent, bytes received) on this connection so far, all frames counted."""
        if self._sock is None:
            return self._closed_bytes
        return self._sock.bytes_sent, self._sock.bytes_received

    async def connect(self, timeout: float = 10.0) -> None:
        """Open the connection and wait until the server answers a ping."""
        sock = self._ensure_open()
        fut = self._loop.create_future()
        self._pending[0] = fut
        sock.send(codec.encode([PING, 0], split=False))
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise RpcTimeout(f"no answer from {self.endpoint} within {timeout}s; is the server "
                             "running and reachable?") from None
        finally:
            self._pending.pop(0, None)

    async def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call `method(*args, **kwargs)` on the server and return its result."""
        return await self.call_with(method, args, kwargs, timeout=timeout)

    async def call_with(self, method: str, args: tuple | list = (), kwargs: dict | None = None,
                        *, timeout: float | None = None) -> Any:
        req_id, frames = encode_request(method, args, kwargs)
        return await self.send_request(req_id, frames, method, timeout)

    def send_request(self, req_id: int, frames: list[Any], method: str, timeout: float | None = None) -> asyncio.Future:
        """Send a request made by `encode_request` (the same frames may go to several servers) and
        return the future of its reply; cancelling the future cancels the call on the server."""
        sock = self._ensure_open()
        fut = self._loop.create_future()
        self._send(sock, req_id, frames, fut, method)
        timer = None if timeout is None else self._loop.call_later(timeout, self._expire, req_id, method, timeout)
        fut.add_done_callback(functools.partial(self._settled, req_id, timer))  # one callback per call
        return fut

    def send_to(self, req_id: int, frames: list[Any], sink: ReplySink, key: Any, method: str = "") -> None:
        """`send_request` without a future or a deadline: the reply goes to `sink.reply(key,
        value)` and a failure (an error reply, the connection lost, the client closed) to
        `sink.fail(key, exc)`, called as the message is read. The caller keeps one deadline for
        everything it sent and `withdraw`s what is late (a group call's fast path)."""
        self._send(self._ensure_open(), req_id, frames, (sink, key), method)

    def _send(self, sock: MessageSocket, req_id: int, frames: list[Any],
              waiter: asyncio.Future | tuple[ReplySink, Any], method: str) -> None:
        if self._auth_failure is not None:
            raise self._auth_failure
        if not self._pending:
            self._waiting_since = self._loop.time()
        self._pending[req_id] = waiter
        self.requests[method] += 1
        self.request_bytes += sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)
        sock.send(frames)

    def withdraw(self, req_id: int) -> bool:
        """Stop waiting for a `send_to` request and ask the server to cancel it; False when it
        was no longer waited for (answered, failed or withdrawn)."""
        if self._pending.pop(req_id, None) is None:
            return False
        if self._sock is not None:
            self._sock.send(codec.encode([CANCEL, req_id], split=False))
        return True

    def _settled(self, req_id: int, timer: asyncio.TimerHandle | None, fut: asyncio.Future) -> None:
        if timer is not None:
            timer.cancel()
        if fut.cancelled():
            self.withdraw(req_id)

    def notify(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Send a one-way message; no reply, no error back."""
        self._ensure_open().send(codec.encode([NOTIFY, 0, method, args, kwargs], split=False))

    def _expire(self, req_id: int, method: str, timeout: float) -> None:
        fut = self._pending.get(req_id)
        if fut is not None and not fut.done() and self.withdraw(req_id):
            fut.set_exception(RpcTimeout(f"{method} on {self.endpoint} did not answer within {timeout}s"))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        self._last_heard = self._loop.time()
        try:
            msg = codec.decode([f.buffer for f in frames])
            kind, req_id = msg[0], msg[1]
        except (CodecError, TypeError, IndexError) as e:
            log.warning("%s: undecodable reply from %s dropped: %s", self.name, self.endpoint, e)
            return
        if kind == PONG:
            fut = self._pending.pop(0, None) if req_id == 0 else None
        else:
            fut = self._pending.pop(req_id, None)
            self.reply_bytes += sum(len(f) for f in frames)
        if kind == ERROR:
            etype, message, tb = msg[2]
            error = RemoteError(etype, message, tb)
        if type(fut) is tuple:  # send_to's (sink, key)
            sink, key = fut
            if kind == REPLY:
                sink.reply(key, msg[2])
            elif kind == ERROR:
                sink.fail(key, error)
            return
        if fut is None or fut.done():
            return
        if kind == REPLY:
            fut.set_result(msg[2])
        elif kind == ERROR:
            fut.set_exception(error)
        elif kind == PONG:
            fut.set_result(None)

    async def _heartbeat(self) -> None:
        ping = codec.encode([PING, 1], split=False)
        last = self._loop.time()
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = self._loop.time()
            late = now - last > 2 * self.heartbeat_interval + 0.5
            last = now
            if not self._pending or self._sock is None:
                continue
            self._sock.send(ping)
            if late:
                # our own loop was blocked: replies that came meanwhile are still unread, so the
                # server gets until the next tick before its silence counts
                continue
            silent = now - max(self._last_heard, self._waiting_since)
            if silent > self.heartbeat_timeout:
                self._fail_all(ConnectionLost(
                    f"{self.endpoint} has not answered for {silent:.1f}s (heartbeat timeout "
                    f"{self.heartbeat_timeout}s); the server process is probably dead or unreachable"))

    def _on_monitor_event(self, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._auth_failure = None
            self._handshake_ok = self.authenticated_once = True
            self._dropped = False
            return
        if event["event"] == zmq.EVENT_DISCONNECTED and not self._handshake_ok and self.authenticated_once:
            # it accepted our keys before: a reconnect cut short means the server went away
            self._fail_all(ConnectionLost(
                f"{self.endpoint} closed the connection while we reconnected, after it had accepted "
                "our keys: the server exited or is restarting"))
            return
        if event["event"] == zmq.EVENT_DISCONNECTED and not self._handshake_ok:
            self._fail_all(AuthenticationError(
                f"{self.endpoint} closed the connection during the handshake: its security "
                "settings differ from ours (CurveZMQ keys on one side only, or a key it does not accept)"))
            return
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._handshake_ok = False
            self._dropped = True
            self._fail_all(ConnectionLost(
                f"connection to {self.endpoint} dropped with calls in flight: the server exited, "
                "or refused a message above its size limit (send bulk data through the object store)"))
            return
        self._auth_failure = AuthenticationError(
            f"{self.endpoint} refused the CurveZMQ handshake: its cluster key differs from "
            "ours, or our public key is not in its authorized/ directory")
        self._fail_all(self._auth_failure)

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every call in flight with `exc` (the caller learned the peer is gone)."""
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if type(fut) is tuple:
                fut[0].fail(fut[1], exc)
            elif not fut.done():
                fut.set_exception(exc)

    async def close(self) -> None:
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            try:
                await self._heartbeat_task
            except (asyncio.CancelledError, Exception):
                pass
            self._heartbeat_task = None
        self._fail_all(ConnectionLost(f"client for {self.endpoint} was closed"))
        if self._sock is not None:
            try:
                self._sock.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close()
            self._monitor = None
            self._closed_bytes = (self._sock.bytes_sent, self._sock.bytes_received)
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> RpcClient:
        self._ensure_open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
