"""Other node, CPU (and GPU objects when NCCL is absent): the bulk TCP stream.

The pull request travels over the (CURVE-authenticated) RPC; the owner answers with a one-time
token and `offer`s the bytes (GPU objects are staged through host memory). The consumer opens a
plain TCP stream to the owner's bulk port, presents the token, and receives the bytes straight
into preallocated tensors (`recv_into`). A connection with an unknown, used or expired token
gets one NAK byte and is closed. The stream itself is not encrypted: run it on a trusted network.
Refusals are logged at most once per interval with a count (a scan of the port makes one line,
not one per connection), and a peer address holds at most `max_connections_per_peer`.

Socket I/O runs in threads (it releases the GIL), so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from objectstore.errors import ObjectTypeError
from objectstore.paths.base import PullKind, PullPath, PullRequest, TensorRegion, Tensors
from objectstore.ref import VALUE, ObjectRef, RowRange
from objectstore.table import Entry
from transport.codec import message
from transport.dtypes import dtype_name, tensor_bytes, torch_dtype, writable_bytes
from transport.peers import RateLimitedLog, ServerLimits
from transport.wire import Ext

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
ACK, NAK = b"\x01", b"\x00"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BulkServer:
    """The owner side: serves offered byte buffers to token holders."""

    def __init__(self, host: str, port: int, executor: Executor, *, token_ttl: float = 60.0,
                 name: str = "bulk",
                 max_connections_per_peer: int = ServerLimits.max_connections_per_peer) -> None:
        self.host, self.port = host, port
        self.name = name
        self.token_ttl = token_ttl
        self._executor = executor
        self._offers: dict[bytes, tuple[float, list[memoryview]]] = {}
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self.max_connections_per_peer = max_connections_per_peer
        self._per_peer: dict[str, int] = {}
        self.refusals = RateLimitedLog(log, f"{name}: refused bulk connections")
        self.stats = {"bytes_sent": 0, "transfers": 0, "rejected": 0}

    async def start(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(),
                                                                   name=f"{self.name}-accept")
        return f"{self.host}:{self.port}"

    def offer(self, views: list[memoryview]) -> bytes:
        """Register `views` for one transfer; returns the token that unlocks them."""
        now = time.monotonic()
        for tok in [t for t, (deadline, _) in self._offers.items() if deadline < now]:
            del self._offers[tok]  # expired: the consumer gave up
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[token] = (now + self.token_ttl, views)
        return token

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                log.warning("%s: accept failed: %s", self.name, e)
                await asyncio.sleep(0.05)
                continue
            peer = str(addr[0])
            if self._per_peer.get(peer, 0) >= self.max_connections_per_peer:
                self.stats["rejected"] += 1
                self.refusals.note(peer, f"over the cap of {self.max_connections_per_peer} connections per peer")
                conn.close()
                continue
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            task = loop.create_task(self._serve(conn, peer))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            token = b""
            async with asyncio.timeout(10.0):
                while len(token) < TOKEN_BYTES:
                    chunk = await loop.sock_recv(conn, TOKEN_BYTES - len(token))
                    if not chunk:
                        return
                    token += chunk
            offer = self._offers.pop(token, None)
            if offer is None or offer[0] < time.monotonic():
                self.stats["rejected"] += 1
                self.refusals.note(peer, "unknown, used or expired token")
                await loop.sock_sendall(conn, NAK)
                return
            conn.setblocking(True)
            sent = await loop.run_in_executor(self._executor, _send_views, conn, offer[1])
            self.stats["bytes_sent"] += sent
            self.stats["transfers"] += 1
        except TimeoutError:
            self.stats["rejected"] += 1
            self.refusals.note(peer, "no token within 10 s")
        except OSError as e:
            log.warning("%s: bulk transfer to %s aborted: %s", self.name, peer, e)
        finally:
            conn.close()
            left = self._per_peer.pop(peer, 1) - 1
            if left > 0:
                self._per_peer[peer] = left

    async def close(self) -> None:
        for task in [self._accept_task, *self._conns]:
            if task is not None:
                task.cancel()
        for task in [self._accept_task, *self._conns]:
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._accept_task = None
        self.refusals.flush()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._offers.clear()


def _send_views(conn: socket.socket, views: list[memoryview]) -> int:
    _tune(conn)
    conn.sendall(ACK)
    total = 0
    for v in views:
        if v.nbytes:
            conn.sendall(v)
            total += v.nbytes
    conn.shutdown(socket.SHUT_WR)
    return total


def fetch(addr: str, token: bytes, dests: list[Any], timeout: float | None = 30.0) -> int:
    """Blocking: receive an offer into `dests` (writable buffers, filled in order)."""
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        _tune(sock)
        sock.sendall(token)
        status = sock.recv(1)
        if status != ACK:
            raise ConnectionRefusedError(f"bulk server {addr} refused the transfer token")
        total = 0
        for dest in dests:
            mv = memoryview(dest).cast("B")
            pos, size = 0, mv.nbytes
            while pos < size:
                n = sock.recv_into(mv[pos:], size - pos)
                if n == 0:
                    raise ConnectionResetError(
                        f"bulk server {addr} closed the stream after {total + pos} bytes")
                pos += n
            total += size
        return total


@message(Ext.TCP_REPLY)
@dataclass(frozen=True, slots=True)
class TcpReply:
    token: bytes  # presented on the bulk stream; valid once
    regions: tuple[TensorRegion, ...]  # in stream order


class TcpPath(PullPath):
    kind = PullKind.TCP

    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Tensors:
        return await self.receive(ref, await self.request(ref, rows))

    async def receive(self, ref: ObjectRef, reply: TcpReply) -> Tensors:
        """Stream the offer `reply` names from the owner of `ref` into new tensors."""
        out = {r.name: torch.empty(r.shape, dtype=torch_dtype(r.dtype)) for r in reply.regions}
        dests = [writable_bytes(t) for t in out.values()]
        loop = asyncio.get_running_loop()
        n = await loop.run_in_executor(self.store.io, fetch, ref.bulk_addr, reply.token, dests,
                                       self.store.bulk_timeout)
        self.store.counters["bytes_received_tcp"] += n
        self.store.counters["pulls_tcp"] += 1
        return out

    def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> TcpReply:
        if entry.ref.kind == VALUE:
            raise ObjectTypeError(f"object {entry.ref.object_id} is a value; pull it with get()")
        # Host staging for GPU objects when NCCL is not available.
        tensors = {k: t.cpu() for k, t in entry.rows(rows).items()}
        token = self.store.bulk.offer([tensor_bytes(t) for t in tensors.values()])
        return TcpReply(token, tuple(TensorRegion(k, dtype_name(t.dtype), tuple(t.shape))
                                     for k, t in tensors.items()))
