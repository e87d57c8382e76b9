"""Other node, GPU: NCCL point-to-point through a two-rank cupy communicator per pull.

The consumer allocates the destination tensors, makes a NCCL unique id and sends it in the
request; both sides then join the communicator (owner rank 0 sends, consumer rank 1 receives)
in a thread. Needs CUDA and cupy (the `gpu` extra); both are imported only when used.
"""

from __future__ import annotations

import asyncio

import torch

from objectstore.paths.base import PullKind, PullPath, PullRequest, Tensors
from objectstore.ref import ObjectRef, RowRange
from objectstore.table import Entry
from transport.dtypes import nbytes, torch_dtype

SENDER, RECEIVER = 0, 1


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
    from cupy.cuda import nccl

    return tuple(nccl.get_unique_id())


def transfer(uid: tuple[int, ...], tensors: list[torch.Tensor], rank: int) -> int:
    """Blocking: as `rank` SENDER send `tensors` to the peer, as RECEIVER fill them; returns bytes."""
    from cupy.cuda import nccl

    if not tensors:
        return 0
    device = tensors[0].device
    with torch.cuda.device(device):
        comm = nccl.NcclCommunicator(2, tuple(uid), rank)
    try:
        stream = torch.cuda.current_stream(device)
        op, peer = (comm.send, RECEIVER) if rank == SENDER else (comm.recv, SENDER)
        total = 0
        for t in tensors:
            if t.numel():
                op(t.data_ptr(), nbytes(t), nccl.NCCL_UINT8, peer, stream.cuda_stream)
                total += nbytes(t)
        stream.synchronize()
        return total
    finally:
        comm.destroy()


class NcclPath(PullPath):
    kind = PullKind.NCCL

    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Tensors:
        device = torch.device("cuda", torch.cuda.current_device())
        out = {}
        for name, (dt, shape) in ref.tensor_specs().items():
            shape = (rows.num_rows, *shape[1:]) if rows is not None else shape
            out[name] = torch.empty(tuple(shape), dtype=torch_dtype(dt), device=device)
        uid = unique_id()
        loop = asyncio.get_running_loop()
        recv = loop.run_in_executor(self.store.io, transfer, uid, list(out.values()), RECEIVER)
        await asyncio.gather(self.request(ref, rows, nccl_uid=uid), recv)
        self.store.counters["bytes_received_gpu"] += ref.row_bytes(rows)
        self.store.counters["pulls_nccl"] += 1
        return out

    async def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> int:
        if request.nccl_uid is None:
            raise ValueError("an NCCL pull request needs the consumer's nccl_uid")
        tensors = [t.contiguous() for t in entry.rows(rows).values()]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.store.io, transfer, request.nccl_uid, tensors, SENDER)
