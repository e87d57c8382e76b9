"""Same node, CPU: shared memory.

On the first same-node pull the owner copies the object once into a /dev/shm segment (a spare
pre-faulted one from the store's `SegmentPool` when it fits) and from then on the object lives
there, held once. The reply names the segment and each tensor's page-aligned byte range of the
requested rows; the consumer maps just those pages copy-on-write (zero-copy reads).

When /dev/shm has no room for the segment (Docker's default is 64 MiB) the owner answers with the
TCP path's reply instead and the consumer streams the rows from the owner's bulk port: slower,
but the pull completes, and the owner warns once with what to change.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from objectstore import segments
from objectstore.errors import ObjectNotFoundError, ObjectTypeError, ShmFullError
from objectstore.paths.base import PullKind, PullPath, PullRequest, TensorRegion, Tensors
from objectstore.paths.tcp import TcpReply
from objectstore.ref import TENSOR, ObjectRef, RowRange
from objectstore.table import Entry
from transport.codec import message
from transport.dtypes import dtype_name, nbytes, row_bytes
from transport.wire import Ext

log = logging.getLogger(__name__)

# mmap is a syscall of a few microseconds; a thread hop costs more for small regions.
_THREAD_MAP_BYTES = 64 << 20


@message(Ext.SHM_REPLY)
@dataclass(frozen=True, slots=True)
class ShmReply:
    segment: str  # file name in the owner's shm_dir
    regions: tuple[TensorRegion, ...]


@dataclass
class _Placed:
    segment: segments.Segment
    offsets: dict[str | None, int]


class ShmPath(PullPath):
    kind = PullKind.SHM

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self._placed: dict[str, _Placed] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.fallbacks = 0  # pulls served over TCP because /dev/shm had no room

    # consumer half --------------------------------------------------------------------------
    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Tensors:
        reply: ShmReply | TcpReply = await self.request(ref, rows)
        if isinstance(reply, TcpReply):  # the owner's /dev/shm is full
            return await self.store.paths[PullKind.TCP].receive(ref, reply)
        path = f"{self.store.shm_dir}/{reply.segment}"
        out = {}
        for region in reply.regions:
            buf = await _maybe_thread(self.store.io, region.nbytes, segments.map_region, path,
                                      region.offset, region.nbytes)
            out[region.name] = region.over(buf)
            self.store.counters["bytes_mapped_shm"] += region.nbytes
        self.store.counters["pulls_shm"] += 1
        return out

    # owner half -----------------------------------------------------------------------------
    async def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> ShmReply | TcpReply:
        object_id = entry.ref.object_id
        if entry.ref.device != "cpu":
            raise ObjectTypeError(f"object {object_id} lives on {entry.ref.device}; pull it with CUDA IPC")
        lock = self._locks.setdefault(object_id, asyncio.Lock())
        async with lock:
            if object_id not in self._placed:
                try:
                    await self._place(entry)
                except ShmFullError as e:
                    return self._over_tcp(entry, rows, request, e)
        placed = self._placed.get(object_id)
        if placed is None or object_id not in self.store.table:
            raise ObjectNotFoundError(f"object {object_id} was freed during the pull")
        regions = []
        for name, t in entry.tensors().items():
            rb = row_bytes(t)
            start, count = (rows.start, rows.num_rows) if rows is not None else (0, t.shape[0] if t.dim() else 1)
            shape = (count, *t.shape[1:]) if t.dim() else ()
            regions.append(TensorRegion(name, dtype_name(t.dtype), shape,
                                        offset=placed.offsets[name] + start * rb,
                                        nbytes=count * rb if t.dim() else t.element_size()))
        return ShmReply(placed.segment.name, tuple(regions))

    def _over_tcp(self, entry: Entry, rows: RowRange | None, request: PullRequest, why: ShmFullError) -> TcpReply:
        self.fallbacks += 1
        if self.fallbacks == 1:
            log.warning(
                "%s: %s, so same-node pulls of objects this large go over TCP (slower). Give "
                "shared memory more room: `docker run --shm-size=16g` (or --ipc=host), or "
                "`mount -o remount,size=16G /dev/shm`; this warning is shown once per store",
                self.store.name, why.strerror)
        else:
            log.debug("%s: object %s over TCP: %s", self.store.name, entry.ref.object_id, why.strerror)
        return self.store.paths[PullKind.TCP].serve(entry, rows, request)

    async def _place(self, entry: Entry) -> None:
        """Copy the object into a new segment once; its tensors then live there."""
        tensors = entry.tensors()
        sizes = [nbytes(t) for t in tensors.values()]
        offsets, size = segments.layout(sizes)
        segment = await self.store.segment_pool.take(size, entry.ref.object_id[:8])
        try:
            def copy() -> dict[str | None, torch.Tensor]:
                moved = {}
                for (name, t), off, n in zip(tensors.items(), offsets, sizes, strict=True):
                    dst = segment.view(off, n)
                    if n:
                        dst.copy_(t.reshape(-1).view(torch.uint8))
                    moved[name] = dst.view(t.dtype).view(t.shape) if n else t
                return moved
            moved = await asyncio.get_running_loop().run_in_executor(self.store.io, copy)
        except BaseException:
            segment.unlink()
            raise
        finally:
            self.store.segment_pool.refill()
        if entry.ref.object_id not in self.store.table:  # freed while we copied
            segment.unlink()
            return
        # The segment now holds the object: drop the private copy so memory is held once.
        entry.value = moved[None] if entry.ref.kind == TENSOR else moved
        self._placed[entry.ref.object_id] = _Placed(segment, dict(zip(tensors, offsets, strict=True)))
        self.store.counters["shm_bytes_written"] += sum(sizes)

    # lifecycle --------------------------------------------------------------------------------
    def forget(self, entry: Entry) -> None:
        self._locks.pop(entry.ref.object_id, None)
        placed = self._placed.pop(entry.ref.object_id, None)
        if placed is not None:
            placed.segment.unlink()

    async def close(self) -> None:
        for placed in self._placed.values():
            placed.segment.unlink()
        self._placed.clear()
        self._locks.clear()

    def stats(self) -> dict[str, int]:
        return {"shm_segments": len(self._placed),
                "shm_bytes": sum(p.segment.size for p in self._placed.values()),
                "shm_fallbacks": self.fallbacks}


async def _maybe_thread(executor: Executor, size: int, fn: Any, *args: Any) -> Any:
    if size < _THREAD_MAP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
