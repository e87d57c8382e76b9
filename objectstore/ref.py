"""`ObjectRef`: a small, frozen handle to an object held by one store (its owner).

A ref carries who owns the object (node, store RPC endpoint, bulk TCP address) and enough
metadata (kind, dtypes, shapes, rows, bytes) for a consumer to plan a pull and check what it
will get without asking the owner. Refs travel inside RPC messages (codec extension `transport.wire.Ext.OBJECT_REF`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

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
    # a small host object's value itself (`ObjectStore(inline_bytes=...)`), or of its rows from
    # `inline_start` on (`narrowed`): it travels with the ref and readers take those rows from it
    # without a pull
    inline: Any = field(default=None, compare=False, repr=False)
    inline_start: int = field(default=0, compare=False)

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

    def inline_rows(self, rows: RowRange | None) -> Any:
        """Rows `rows` (None: all) of the inline value, as tensors of their own; None when the
        ref carries no value or not those rows (then pull them)."""
        if self.inline is None:
            return None
        if self.kind == VALUE:
            return self.inline
        held = _rows_held(self.inline, self.kind)
        lo, hi = (0, self.num_rows or 0) if rows is None else rows
        if held is None:  # a 0-d tensor: whole or nothing
            return self.inline.clone() if rows is None and self.inline_start == 0 else None
        if lo < self.inline_start or hi > self.inline_start + held:
            return None
        cut = slice(lo - self.inline_start, hi - self.inline_start)
        if self.kind == TENSOR:
            return self.inline[cut].clone()
        return {k: t[cut].clone() for k, t in self.inline.items()}

    def narrowed(self, lo: int, hi: int) -> ObjectRef:
        """This ref carrying only rows [lo, hi) of its inline value (what one rank's plan reads)."""
        held = _rows_held(self.inline, self.kind) if self.inline is not None and self.kind != VALUE else None
        if held is None or (lo, hi) == (self.inline_start, self.inline_start + held):
            return self
        if lo < self.inline_start or hi > self.inline_start + held:
            return replace(self, inline=None, inline_start=0)
        cut = slice(lo - self.inline_start, hi - self.inline_start)
        value = self.inline[cut] if self.kind == TENSOR else {k: t[cut] for k, t in self.inline.items()}
        return replace(self, inline=value, inline_start=lo)

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
            ref.num_rows, *([] if ref.inline is None else [ref.inline, ref.inline_start])]


def _ref_from_wire(v: list[Any]) -> ObjectRef:
    if not isinstance(v, list) or len(v) not in (11, 13):
        raise CodecError(f"an ObjectRef travels as 11 or 13 fields, got {type(v).__name__} "
                         f"of {len(v) if isinstance(v, list) else '?'}")
    oid, node, endpoint, bulk, kind, device, nbytes, dt, shape, cols, num_rows = v[:11]
    inline, start = v[11:] if len(v) == 13 else (None, 0)
    if not isinstance(start, int) or start < 0:
        raise CodecError(f"ObjectRef {oid}: inline_start must be an int >= 0, got {start!r}")
    try:
        kind = ObjectKind(kind)
    except ValueError:
        raise CodecError(f"ObjectRef.kind: {kind!r} is not an ObjectKind "
                         f"({[k.value for k in ObjectKind]})") from None
    return ObjectRef(
        oid, node, endpoint, bulk, kind, device, nbytes, dt,
        tuple(shape) if shape is not None else None,
        tuple((n, d, tuple(s)) for n, d, s in cols) if cols is not None else None, num_rows,
        _checked_inline(kind, inline, oid), start)


def _checked_inline(kind: ObjectKind, inline: Any, object_id: str) -> Any:
    """A ref's inline value, if it has the shape its kind says (a tensor; a dict of tensors)."""
    if inline is None or kind == VALUE:
        return inline
    ok = (isinstance(inline, torch.Tensor) if kind == TENSOR else
          isinstance(inline, dict) and all(isinstance(t, torch.Tensor) and t.dim() for t in inline.values())
          and len({t.shape[0] for t in inline.values()}) <= 1)
    if not ok:
        raise CodecError(f"ObjectRef {object_id}: its inline value is a {type(inline).__name__}, "
                         f"not what a {kind.value} object holds")
    return inline


def _rows_held(inline: Any, kind: ObjectKind) -> int | None:
    """Rows an inline tensor or batch holds (None: a 0-d tensor)."""
    if kind == TENSOR:
        return inline.shape[0] if inline.dim() else None
    return next(iter(inline.values())).shape[0] if inline else 0


register_type(ObjectRef, int(Ext.OBJECT_REF), _ref_to_wire, _ref_from_wire)
