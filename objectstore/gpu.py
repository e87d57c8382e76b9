"""GPU pulls: CUDA IPC on one node, NCCL point-to-point across nodes.

Both need a CUDA build of torch; NCCL pulls also need cupy (the `gpu` extra). Neither is
exercised on a CPU-only machine (their tests are marked `gpu` and skipped with a reason).
"""

from __future__ import annotations

from typing import Any

import torch

from objectstore.ref import dtype_name, torch_dtype


def cuda_ipc_export(t: torch.Tensor) -> list[Any]:
    """An msgpack-safe IPC handle of CUDA tensor `t` (the owner must keep `t` alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes,
     storage_offset, _grad, rc_handle, rc_offset, event_handle, event_sync) = args
    return [list(size), list(stride), offset, dtype_name(dtype), device, handle, storage_bytes,
            storage_offset, rc_handle, rc_offset, event_handle, event_sync]


def cuda_ipc_import(h: list[Any]) -> torch.Tensor:
    """Open an IPC handle made by `cuda_ipc_export`: device memory shared with the owner."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (size, stride, offset, dt, device, handle, storage_bytes, storage_offset, rc_handle,
     rc_offset, event_handle, event_sync) = h
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage,
        torch_dtype(dt), device, bytes(handle), storage_bytes, storage_offset, False,
        bytes(rc_handle), rc_offset, bytes(event_handle) if event_handle else event_handle,
        event_sync)


def nccl_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cupy.cuda import nccl  # noqa: F401
    except ImportError:
        return False
    return True


def nccl_unique_id() -> list[int]:
    from cupy.cuda import nccl

    return list(nccl.get_unique_id())


def _nccl_comm(uid: list[int], rank: int, device: torch.device):
    from cupy.cuda import nccl

    with torch.cuda.device(device):
        return nccl.NcclCommunicator(2, tuple(uid), rank)


def nccl_send(uid: list[int], tensors: list[torch.Tensor]) -> int:
    """Blocking, owner side (rank 0): send `tensors` to the consumer (rank 1)."""
    from cupy.cuda import nccl

    if not tensors:
        return 0
    device = tensors[0].device
    comm = _nccl_comm(uid, 0, device)
    try:
        stream = torch.cuda.current_stream(device)
        total = 0
        for t in tensors:
            if t.numel():
                comm.send(t.data_ptr(), t.numel() * t.element_size(), nccl.NCCL_UINT8, 1,
                          stream.cuda_stream)
                total += t.numel() * t.element_size()
        stream.synchronize()
        return total
    finally:
        comm.destroy()


def nccl_recv(uid: list[int], dests: list[torch.Tensor]) -> int:
    """Blocking, consumer side (rank 1): receive into preallocated CUDA tensors."""
    from cupy.cuda import nccl

    if not dests:
        return 0
    device = dests[0].device
    comm = _nccl_comm(uid, 1, device)
    try:
        stream = torch.cuda.current_stream(device)
        total = 0
        for t in dests:
            if t.numel():
                comm.recv(t.data_ptr(), t.numel() * t.element_size(), nccl.NCCL_UINT8, 0,
                          stream.cuda_stream)
                total += t.numel() * t.element_size()
        stream.synchronize()
        return total
    finally:
        comm.destroy()
