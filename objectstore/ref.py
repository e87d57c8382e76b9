"""`ObjectRef`: a small, frozen handle to an object held by one store (its owner).

A ref carries who owns the object (node, store RPC endpoint, bulk TCP address) and enough
metadata (kind, dtypes, shapes, rows, bytes) for a consumer to plan a pull and check what it
will get without asking the owner. Refs travel inside RPC messages (codec extension `transport.wire.Ext.OBJECT_REF`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from objectstore.errors import ShardRangeError
from transport.codec import register_type
from transport.dtypes import element_size
from transport.errors import CodecError
from transport.wire import Ext


class ObjectKind(enum.StrEnum):
    """What an object is: one tensor, a batch (named tensors sharing rows), or any msgpack value."""

    TENSOR = "tensor"
    BATCH = "batch"
    VALUE = "value"


TENSOR, BATCH, VALUE = ObjectKind.TENSOR, ObjectKind.BATCH, ObjectKind.VALUE


class RowRange(NamedTuple):
    """Rows [start, stop) of a tensor or batch: a DP-local shard (travels as a 2-item list)."""

    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def check(self, num_rows: int, object_id: str = "") -> RowRange:
        """Return self if it lies inside [0, num_rows], else raise ShardRangeError."""
        if not (isinstance(self.start, int) and isinstance(self.stop, int)
                and 0 <= self.start <= self.stop <= num_rows):
            raise ShardRangeError(
                f"rows [{self.start}, {self.stop}) are out of bounds for object {object_id} with "
                f"{num_rows} rows; ask for a range inside [0, {num_rows})")
        return self


def shard_rows(num_rows: int, rank: int, world_size: int) -> RowRange:
    """The contiguous rows DP rank `rank` of `world_size` owns (earlier ranks take the remainder)."""
    if not 0 <= rank < world_size:
        raise ShardRangeError(f"rank {rank} is outside a DP group of size {world_size}")
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return RowRange(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """A handle to one object; equal and hashable by `object_id`."""

    object_id: str
    node_id: str = field(compare=False)
    endpoint: str = field(compare=False)  # owner store's RPC endpoint
    bulk_addr: str = field(compare=False)  # owner's bulk TCP "host:port"
    kind: ObjectKind = field(compare=False)
    device: str = field(default="cpu", compare=False)
    nbytes: int = field(default=0, compare=False)
    dtype: str | None = field(default=None, compare=False)  # tensor only
    shape: tuple[int, ...] | None = field(default=None, compare=False)  # tensor only
    # batch only: column name -> (dtype, full shape); every column has num_rows rows
    columns: tuple[tuple[str, str, tuple[int, ...]], ...] | None = field(default=None, compare=False)
    num_rows: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ObjectKind):  # a plain "tensor" string is accepted
            object.__setattr__(self, "kind", ObjectKind(self.kind))

    @property
    def column_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{name: (dtype, shape)} of a batch's columns (empty for other kinds)."""
        return {name: (dt, shape) for name, dt, shape in self.columns or ()}

    def tensor_specs(self) -> dict[str | None, tuple[str, tuple[int, ...]]]:
        """Every tensor of the object as {column name or None: (dtype, shape)}."""
        if self.kind == TENSOR:
            return {None: (self.dtype, self.shape)}
        return dict(self.column_specs)

    def row_bytes(self, rows: RowRange | None) -> int:
        """Bytes a pull of `rows` (None = all) moves."""
        if rows is None or self.kind == VALUE:
            return self.nbytes
        total = 0
        for dt, shape in self.tensor_specs().values():
            per_row = math.prod(shape[1:]) * element_size(dt)
            total += per_row * rows.num_rows
        return total

    def __repr__(self) -> str:
        if self.kind == TENSOR:
            what = f"{self.dtype}{list(self.shape or ())}"
        elif self.kind == BATCH:
            what = f"batch[{self.num_rows} rows x {len(self.columns or ())} cols]"
        else:
            what = "value"
        return f"ObjectRef({self.object_id[:12]} {what} on {self.node_id}/{self.device})"


def _ref_to_wire(ref: ObjectRef) -> list[Any]:
    return [ref.object_id, ref.node_id, ref.endpoint, ref.bulk_addr, ref.kind.value, ref.device,
            ref.nbytes, ref.dtype, list(ref.shape) if ref.shape is not None else None,
            [[n, d, list(s)] for n, d, s in ref.columns] if ref.columns is not None else None,
            ref.num_rows]


def _ref_from_wire(v: list[Any]) -> ObjectRef:
    oid, node, endpoint, bulk, kind, device, nbytes, dt, shape, cols, num_rows = v
    try:
        kind = ObjectKind(kind)
    except ValueError:
        raise CodecError(f"ObjectRef.kind: {kind!r} is not an ObjectKind "
                         f"({[k.value for k in ObjectKind]})") from None
    return ObjectRef(
        oid, node, endpoint, bulk, kind, device, nbytes, dt,
        tuple(shape) if shape is not None else None,
        tuple((n, d, tuple(s)) for n, d, s in cols) if cols is not None else None, num_rows)


register_type(ObjectRef, int(Ext.OBJECT_REF), _ref_to_wire, _ref_from_wire)
