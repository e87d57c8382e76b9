"""A ZeroMQ socket driven by event-loop reader callbacks.

zmq.asyncio wraps every send and receive in a Future; the RPC layer instead drains the socket
in one callback and hands each message to a handler, and sends without waiting (ROUTER and
DEALER with an unlimited high-water mark never block). ZeroMQ's notification descriptor is
edge-triggered, so after any send we re-check the socket's EVENTS before trusting it again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger(__name__)

# Messages handled per callback before yielding to other work on the loop.
MAX_BATCH = 256


class MessageSocket:
    """Delivers each received multipart message to `on_message`; `send` never blocks."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[zmq.Frame]], None],
                 loop: asyncio.AbstractEventLoop | None = None, name: str = "socket") -> None:
        self.sock = sock
        self.name = name
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
        if self.sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
        self.bytes_sent += sum(len(f) for f in frames)
        if not self._outbox:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._outbox.append(frames)
        else:
            self._outbox.append(frames)
        if self._outbox or self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule()

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
            events = sock.getsockopt(zmq.EVENTS)
            if events & zmq.POLLOUT and self._outbox:
                self._flush()
            if not events & zmq.POLLIN:
                return
            if handled >= MAX_BATCH:
                self._schedule()
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("%s: receive failed: %s", self.name, e)
                return
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
