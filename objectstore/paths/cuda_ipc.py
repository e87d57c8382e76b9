"""Same node, GPU: CUDA IPC. The consumer opens the owner's device memory and copies it into
memory of its own (a consumer's in-place op must never change the owner's object); a caller
that promises not to write may ask for the shared memory itself (`ObjectStore.get(view=True)`).
Where the consumer's device cannot reach the owner's (no peer access, or the handle does not
open: another container, MIG), `usable` says so and the store pulls over TCP instead.

Needs a CUDA build of torch; not exercised on a CPU-only machine (its tests are marked `gpu`
and skipped with a reason). torch's IPC machinery is imported only when the path is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from objectstore.errors import ObjectTypeError
from objectstore.paths.base import PullKind, PullPath, PullRequest, Tensors
from objectstore.ref import ObjectRef, RowRange
from objectstore.table import Entry
from transport.codec import message
from transport.dtypes import dtype_name, torch_dtype
from transport.wire import Ext


@message(Ext.CUDA_IPC_REPLY)
@dataclass(frozen=True, slots=True)
class CudaIpcReply:
    names: tuple[str | None, ...]
    handles: tuple[list[Any], ...]  # one `export` handle per name


def export(t: torch.Tensor) -> list[Any]:
    """An msgpack-safe IPC handle of CUDA tensor `t` (the owner must keep `t` alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes,
     storage_offset, _grad, rc_handle, rc_offset, event_handle, event_sync) = args
    return [list(size), list(stride), offset, dtype_name(dtype), device, handle, storage_bytes,
            storage_offset, rc_handle, rc_offset, event_handle, event_sync]


def open_handle(h: list[Any]) -> torch.Tensor:
    """Open an IPC handle made by `export`: device memory shared with the owner."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (size, stride, offset, dt, device, handle, storage_bytes, storage_offset, rc_handle,
     rc_offset, event_handle, event_sync) = h
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage,
        torch_dtype(dt), device, bytes(handle), storage_bytes, storage_offset, False,
        bytes(rc_handle), rc_offset, bytes(event_handle) if event_handle else event_handle,
        event_sync)


def peer_access(consumer: int, owner: int) -> bool:
    """Whether device `consumer` can map memory of device `owner` (always for the same one)."""
    return consumer == owner or torch.cuda.can_device_access_peer(consumer, owner)


class CudaIpcUnavailable(RuntimeError):
    """This pull cannot use CUDA IPC (the store falls back to another path)."""


class CudaIpcPath(PullPath):
    kind = PullKind.CUDA_IPC

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.broken: str | None = None  # why IPC failed here once: later pulls skip it

    def usable(self, ref: ObjectRef) -> bool:
        """Whether a pull of `ref` can use IPC from this process (else: TCP)."""
        if self.broken is not None or not torch.cuda.is_available():
            return False
        owner = torch.device(ref.device).index or 0
        return peer_access(torch.cuda.current_device(), owner)

    async def fetch(self, ref: ObjectRef, rows: RowRange | None, view: bool = False) -> Tensors:
        reply: CudaIpcReply = await self.request(ref, rows)
        try:
            shared = {name: open_handle(h) for name, h in zip(reply.names, reply.handles, strict=True)}
        except RuntimeError as e:  # e.g. "invalid resource handle": another container, MIG
            self.broken = f"{type(e).__name__}: {e}"
            raise CudaIpcUnavailable(self.broken) from e
        self.store.counters["pulls_cuda_ipc"] += 1
        if view:
            return shared
        # copy on the consumer's device; the owner's memory is released with `shared`
        return {name: t.clone(memory_format=torch.preserve_format) for name, t in shared.items()}

    def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> CudaIpcReply:
        if not entry.ref.device.startswith("cuda"):
            raise ObjectTypeError(f"object {entry.ref.object_id} lives on {entry.ref.device}, not a GPU")
        tensors = entry.rows(rows)
        return CudaIpcReply(tuple(tensors), tuple(export(t) for t in tensors.values()))
