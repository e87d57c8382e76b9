"""Other node, GPU: NCCL point-to-point over one cached two-rank cupy communicator per pair of
stores.

The consumer makes a NCCL unique id the first time it pulls from an owner and sends it with
each request; both sides build the communicator on that first pull (owner rank 0 sends,
consumer rank 1 receives) and keep it, keyed by the owner's endpoint (consumer) or the id
(owner). Transfers of a pair take turns (one lock per channel on each side, so a consumer's
pulls reach the owner in the order it receives them), run on a CUDA stream of the channel's own
(never the training stream; it waits for the device's default stream before sending), and
have a deadline: a transfer that has not finished in `NCCL_TIMEOUT_S` aborts the communicator,
drops it (the next pull builds a new one) and raises `TransferTimeoutError` naming the peer.
Needs CUDA and cupy (the `gpu` extra); both are imported only when used.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch

from objectstore.errors import TransferTimeoutError
from objectstore.paths.base import PullKind, PullPath, PullRequest, Tensors
from objectstore.ref import ObjectRef, RowRange
from objectstore.table import Entry
from transport import RemoteError
from transport.dtypes import nbytes, torch_dtype

SENDER, RECEIVER = 0, 1
NCCL_TIMEOUT_S = 120.0

log = logging.getLogger(__name__)


def available() -> bool:
    """True when this process can pull over NCCL (a GPU and cupy)."""
    if not torch.cuda.is_available():
        return False
    try:
        from cupy.cuda import nccl  # noqa: F401
    except ImportError:
        return False
    return True


def unique_id() -> tuple[int, ...]:
    """A fresh NCCL unique id as unsigned byte values (0-255), the form that travels in a request."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()  # cupy 13: a tuple of signed chars; cupy 14: bytes
    return tuple(b & 0xFF for b in uid)


def open_communicator(uid: tuple[int, ...], rank: int) -> Any:
    """A two-rank NCCL communicator for `uid` (unsigned bytes). cupy 14 takes the id as bytes,
    cupy 13 as a tuple of signed chars; the wrong form is a TypeError raised before NCCL is called."""
    from cupy.cuda import nccl

    try:
        return nccl.NcclCommunicator(2, bytes(b & 0xFF for b in uid), rank)
    except TypeError:
        return nccl.NcclCommunicator(2, tuple((b & 0xFF) - 256 if b & 0x80 else b & 0xFF for b in uid), rank)


class NcclUnavailable(RuntimeError):
    """No NCCL communicator could be built with this owner (the store falls back to TCP)."""


def _no_communicator(error: BaseException) -> bool:
    """Whether `error` says a communicator could not be built, here or on the owner's side."""
    if isinstance(error, NcclUnavailable):
        return True
    return isinstance(error, RemoteError) and error.remote_type.rpartition(".")[2] == "NcclUnavailable"


class Channel:
    """One pair of stores: a two-rank communicator (built on first use), a CUDA stream of its
    own and a lock that makes the pair's transfers take turns."""

    def __init__(self, uid: tuple[int, ...], rank: int, peer: str) -> None:
        self.uid, self.rank, self.peer = uid, rank, peer
        self.comm: Any = None
        self.stream: torch.cuda.Stream | None = None
        self.lock = asyncio.Lock()
        self._guard = threading.Lock()  # the communicator is touched by one thread at a time

    def transfer(self, tensors: list[torch.Tensor]) -> int:
        """Blocking: as SENDER send `tensors` to the peer, as RECEIVER fill them; returns bytes."""
        from cupy.cuda import nccl

        if not tensors:
            return 0
        device = tensors[0].device
        with self._guard, torch.cuda.device(device):
            if self.comm is None:
                try:
                    self.comm = open_communicator(self.uid, self.rank)
                except Exception as e:  # noqa: BLE001 - e.g. both ends on one GPU: ncclInvalidUsage
                    raise NcclUnavailable(f"{type(e).__name__}: {e}") from e
                self.stream = torch.cuda.Stream(device)
            stream = self.stream
            stream.wait_stream(torch.cuda.default_stream(device))  # the tensors' producers are done
            op, peer = (self.comm.send, RECEIVER) if self.rank == SENDER else (self.comm.recv, SENDER)
            total = 0
            with torch.cuda.stream(stream):
                for t in tensors:
                    if t.numel():
                        op(t.data_ptr(), nbytes(t), nccl.NCCL_UINT8, peer, stream.cuda_stream)
                        t.record_stream(stream)
                        total += nbytes(t)
            stream.synchronize()
            return total

    def abort(self) -> None:
        """Unblock a stuck transfer and drop the communicator (called from the event loop)."""
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception as e:  # noqa: BLE001 - the channel is dropped either way
                log.warning("aborting the NCCL communicator with %s failed: %s", self.peer, e)


class NcclPath(PullPath):
    kind = PullKind.NCCL

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.pulling: dict[str, Channel] = {}  # consumer side: by the owner's endpoint
        self.serving: dict[tuple[int, ...], Channel] = {}  # owner side: by the consumer's id
        self.timeout_s = NCCL_TIMEOUT_S
        self.refused: dict[str, str] = {}  # owners no communicator could be built with: why

    def usable(self, ref: ObjectRef) -> bool:
        """Whether a pull of `ref` can use NCCL (else: TCP)."""
        return available() and ref.endpoint not in self.refused

    async def _run(self, channel: Channel, tensors: list[torch.Tensor], drop: Any, *also: Any) -> list[Any]:
        loop = asyncio.get_running_loop()
        moving = loop.run_in_executor(self.store.io, channel.transfer, tensors)
        try:
            return await asyncio.wait_for(asyncio.gather(moving, *also), self.timeout_s)
        except TimeoutError:
            channel.abort()
            drop()
            raise TransferTimeoutError(
                f"{self.store.name}: an NCCL transfer with {channel.peer} did not finish in {self.timeout_s:.0f}s; "
                "the communicator was dropped (the next pull builds a new one). Check that the peer's "
                "process is alive and its GPU not stuck in a collective") from None

    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Tensors:
        device = torch.device("cuda", torch.cuda.current_device())
        channel = self.pulling.get(ref.endpoint)
        if channel is None:
            channel = self.pulling[ref.endpoint] = Channel(unique_id(), RECEIVER, ref.endpoint)
        out = {}
        for name, (dt, shape) in ref.tensor_specs().items():
            shape = (rows.num_rows, *shape[1:]) if rows is not None else shape
            out[name] = torch.empty(tuple(shape), dtype=torch_dtype(dt), device=device)
        async with channel.lock:
            try:
                await self._run(channel, list(out.values()), lambda: self.pulling.pop(ref.endpoint, None),
                                self.request(ref, rows, nccl_uid=channel.uid))
            except Exception as e:
                if not _no_communicator(e):
                    raise  # a timeout, a freed object...: the next pull tries NCCL again
                # the communicator could not be built on one end (both ends on one GPU, no NCCL
                # path between them): this owner is served over TCP from now on
                self.pulling.pop(ref.endpoint, None)
                self.refused[ref.endpoint] = f"{type(e).__name__}: {e}".splitlines()[0]
                raise NcclUnavailable(self.refused[ref.endpoint]) from e
        self.store.counters["bytes_received_gpu"] += ref.row_bytes(rows)
        self.store.counters["pulls_nccl"] += 1
        return out

    async def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> int:
        if request.nccl_uid is None:
            raise ValueError("an NCCL pull request needs the consumer's nccl_uid")
        uid = tuple(request.nccl_uid)
        channel = self.serving.get(uid)
        if channel is None:
            channel = self.serving[uid] = Channel(uid, SENDER, f"a consumer of {entry.ref.object_id}")
        tensors = [t.contiguous() for t in entry.rows(rows).values()]
        async with channel.lock:
            try:
                (sent,) = await self._run(channel, tensors, lambda: self.serving.pop(uid, None))
            except NcclUnavailable:
                self.serving.pop(uid, None)  # the consumer falls back to TCP
                raise
        return sent

    async def close(self) -> None:
        for channel in [*self.pulling.values(), *self.serving.values()]:
            channel.abort()
        self.pulling.clear()
        self.serving.clear()
