"""The `PullPath` interface, the pull request and the tensor-region reply part they share."""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from objectstore.ref import ObjectRef, RowRange
from objectstore.table import Entry, check_rows
from transport import expose
from transport.codec import message
from transport.dtypes import tensor_from_bytes
from transport.wire import Ext

if TYPE_CHECKING:
    from objectstore.store import ObjectStore

Tensors = dict[str | None, torch.Tensor]


class PullKind(enum.StrEnum):
    """The ways an object moves from its owner to a consumer."""

    LOCAL = "local"  # the consumer is the owner: the object itself
    INLINE = "inline"  # a plain value, inside the RPC reply
    SHM = "shm"  # same node, CPU: shared memory
    TCP = "tcp"  # other node (or forced): bulk TCP stream
    CUDA_IPC = "cuda_ipc"  # same node, GPU: CUDA IPC
    NCCL = "nccl"  # other node, GPU: NCCL point-to-point


@message(Ext.PULL_REQUEST)
@dataclass(frozen=True, slots=True)
class PullRequest:
    """Consumer -> owner: rows [start, stop) of an object (None: all of it)."""

    object_id: str
    rows: tuple[int, int] | None = None
    nccl_uid: tuple[int, ...] | None = None  # NCCL only: the communicator the consumer opened


@message(Ext.TENSOR_REGION)
@dataclass(frozen=True, slots=True)
class TensorRegion:
    """Where one tensor of a reply lies: column name (None for a lone tensor), dtype and shape,
    and for shared memory its byte range in the segment."""

    name: str | None
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0

    def over(self, buf: Any) -> torch.Tensor:
        """The tensor this region describes, viewing `buf` (no copy)."""
        return tensor_from_bytes(buf, self.dtype, list(self.shape))


def wire_rows(rows: RowRange | None) -> tuple[int, int] | None:
    return None if rows is None else (rows.start, rows.stop)


class PullPath:
    """One pull path: the consumer's `fetch` and the owner's `serve`.

    The owner's half is reached through the `pull` endpoint, registered as `<kind>.pull` on the
    store's RPC server; `fetch` sends a `PullRequest` there (or none, for in-process paths).
    """

    kind: ClassVar[PullKind]
    remote: ClassVar[bool] = True  # has an owner half reached over RPC

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @classmethod
    def endpoint(cls) -> str:
        return f"{cls.kind.value}.pull"

    # consumer half --------------------------------------------------------------------------
    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Any:
        """Pull `ref` (or its rows) from the owner: tensors by column name, or a value."""
        raise NotImplementedError

    async def request(self, ref: ObjectRef, rows: RowRange | None, **fields: Any) -> Any:
        """Send this path's PullRequest to the owner of `ref`; returns its typed reply."""
        return await self.store.call_owner(
            ref, self.endpoint(), PullRequest(ref.object_id, wire_rows(rows), **fields))

    # owner half -----------------------------------------------------------------------------
    def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> Any:
        """Answer a consumer's request for `rows` of `entry` (may be a coroutine)."""
        raise NotImplementedError

    @expose
    async def pull(self, request: PullRequest) -> Any:
        if not isinstance(request, PullRequest):
            raise TypeError(f"{self.endpoint()} takes a PullRequest, got a {type(request).__qualname__}")
        entry = self.store.table.entry(request.object_id)
        result = self.serve(entry, check_rows(entry.ref, request.rows), request)
        if inspect.isawaitable(result):
            result = await result
        return result

    # lifecycle --------------------------------------------------------------------------------
    def forget(self, entry: Entry) -> None:
        """The table dropped `entry`: release whatever this path holds for it."""

    async def close(self) -> None:
        """The store is closing."""

    def stats(self) -> dict[str, int]:
        return {}
