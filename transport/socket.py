"""A ZeroMQ socket driven by event-loop reader callbacks.

zmq.asyncio wraps every send and receive in a Future; the RPC layer instead drains the socket
in one callback and hands each message to a handler, and sends without waiting (ROUTER and
DEALER with an unlimited high-water mark never block). ZeroMQ's notification descriptor is
edge-triggered, so after any send we re-check the socket's EVENTS before trusting it again.

A message cut into chunks (`codec.split_frames`: no frame on the wire above `FRAME_BYTES`) is
received chunk by chunk straight into one buffer per logical frame (`recv_into`), so a bulk
message costs one copy out of ZeroMQ, as a single large frame would, instead of a Frame object
per chunk and a join. The buffer is sized from the header's chunk counts only up to
`max_bytes`; a larger claim takes the plain path, where the server refuses it by size.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from transport import codec

log = logging.getLogger(__name__)

# Messages handled per callback before yielding to other work on the loop.
MAX_BATCH = 256
_COPY_BELOW = 1 << 16  # pyzmq's copy_threshold: below it a zero-copy send copies anyway
# plain ints: pyzmq's flag enums cost a microsecond per operation, several per message
_POLLIN, _POLLOUT, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.EVENTS), int(zmq.NOBLOCK)


class Joined:
    """One logical frame received from its chunks: `buffer`, `bytes` and `len()` as a zmq.Frame
    has them; `get` reads the message's metadata (the CURVE User-Id) from the header frame."""

    __slots__ = ("buffer", "_header")

    def __init__(self, buffer: memoryview, header: zmq.Frame) -> None:
        self.buffer, self._header = buffer, header

    def __len__(self) -> int:
        return self.buffer.nbytes

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()

    def get(self, key: str) -> Any:
        return self._header.get(key)


def receive(sock: zmq.Socket, envelope: int, max_bytes: int) -> list[Any]:
    """One multipart message (zmq.Again when none is waiting): its first `envelope` frames
    (a ROUTER's peer identity) and small messages as zmq.Frames; a chunked message's logical
    frames as `Joined` buffers, each filled by `recv_into` from its chunks."""
    frames = [sock.recv(_NOBLOCK, copy=False)]
    while frames[-1].more and len(frames) <= envelope:
        frames.append(sock.recv(copy=False))
    if len(frames) <= envelope or not frames[-1].more:
        return frames
    header = frames[-1]
    counts = codec.chunk_counts(header.buffer)
    if counts is None or sum(counts) * codec.FRAME_BYTES > max_bytes:
        return _rest(sock, frames)
    try:
        return _receive_chunks(sock, frames, header, counts)
    except BaseException:  # a failed allocation, say: never leave the socket inside a message
        _drain(sock)
        raise


def _receive_chunks(sock: zmq.Socket, frames: list[Any], header: zmq.Frame, counts: list[int]) -> list[Any]:
    out = frames[:-1]
    for i, n in enumerate(counts):
        buf = np.empty(n * codec.FRAME_BYTES, dtype=np.uint8)  # numpy: huge pages for large buffers
        view, at = memoryview(buf), 0
        for j in range(n):
            got = sock.recv_into(view[at:at + codec.FRAME_BYTES])
            at += got
            more = sock.getsockopt(zmq.RCVMORE)
            last = i == len(counts) - 1 and j == n - 1
            if got > codec.FRAME_BYTES or (got < codec.FRAME_BYTES and j < n - 1) or bool(more) == last:
                _drain(sock)  # not what split_frames makes: drop the rest of the message
                return [*frames[:-1], header]  # a header without its chunks: decode reports it malformed
        out.append(Joined(view[:at], header))
    return out


def _drain(sock: zmq.Socket) -> None:
    """Drop the rest of the message being received."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(copy=False)


def _rest(sock: zmq.Socket, frames: list[Any]) -> list[Any]:
    """`frames` and the rest of the message being received."""
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


class MessageSocket:
    """Delivers each received multipart message to `on_message`; `send` never blocks. With
    `chunked`, a message with a frame above `codec.FRAME_BYTES` goes out in chunks."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[zmq.Frame]], None],
                 loop: asyncio.AbstractEventLoop | None = None, name: str = "socket",
                 max_bytes: int = 0, chunked: bool = True) -> None:
        self.sock = sock
        self.name = name
        self.chunked = chunked
        self._envelope = 1 if sock.type == zmq.ROUTER else 0
        self._max_bytes = max_bytes  # the largest chunked message received into one buffer (0: none)
        self._on_message = on_message
        self._loop = loop or asyncio.get_running_loop()
        self._outbox: collections.deque[list[Any]] = collections.deque()
        self._scheduled = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._service)
        self._schedule()

    @property
    def closed(self) -> bool:
        return self.sock.closed

    def send(self, frames: list[Any]) -> None:
        sock = self.sock
        if sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
        if self.chunked:
            frames = self._cut(frames)
        self.bytes_sent += len(frames[0]) if len(frames) == 1 else sum(len(f) for f in frames)
        if not self._outbox:
            try:
                if len(frames) == 1:  # most messages: one frame, without send_multipart's loop
                    frame = frames[0]  # a small one copied: cheaper than wrapping it in a zmq.Frame
                    sock.send(frame, _NOBLOCK, copy=type(frame) is bytes and len(frame) < _COPY_BELOW)
                else:
                    sock.send_multipart(frames, flags=_NOBLOCK, copy=False)
            except zmq.Again:
                self._outbox.append(frames)
        else:
            self._outbox.append(frames)
        if self._outbox or sock.getsockopt(_EVENTS) & _POLLIN:
            self._schedule()

    def _cut(self, frames: list[Any]) -> list[Any]:
        """`frames` with the message's frames above FRAME_BYTES in chunks (the envelope kept)."""
        for f in frames:
            if len(f) > codec.FRAME_BYTES:
                break
        else:
            return frames
        env = self._envelope
        return frames[:env] + codec.split_frames(frames[env:])

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._service)

    def _flush(self) -> None:
        while self._outbox:
            try:
                self.sock.send_multipart(self._outbox[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._outbox.popleft()

    def _service(self) -> None:
        self._scheduled = False
        sock = self.sock
        handled = 0
        while not sock.closed:
            events = sock.getsockopt(_EVENTS)
            if events & _POLLOUT and self._outbox:
                self._flush()
            if not events & _POLLIN:
                return
            if handled >= MAX_BATCH:
                self._schedule()
                return
            try:
                frames = (receive(sock, self._envelope, self._max_bytes) if self._max_bytes else
                          sock.recv_multipart(_NOBLOCK, copy=False))
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("%s: receive failed: %s", self.name, e)
                return
            except MemoryError:  # a chunked message's buffer: the message is dropped, the socket goes on
                log.warning("%s: no memory to receive a large message; dropped", self.name)
                continue
            handled += 1
            self.bytes_received += sum(len(f) for f in frames)
            try:
                self._on_message(frames)
            except Exception:  # a handler bug must not stop the socket
                log.exception("%s: message handler failed", self.name)

    def close(self) -> None:
        if not self.sock.closed:
            try:
                self._loop.remove_reader(self._fd)
            except (ValueError, OSError, RuntimeError):
                pass
            self.sock.close(0)
        self._outbox.clear()
