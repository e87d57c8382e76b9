"""The object table of one store: what it owns, who holds it, and how much memory it uses.

Reference counting: `add` gives the producer one local reference; other stores register as
holders (`incref`/`decref` over RPC, by store id) and the object is dropped when its local
count and all holders reach zero. `free` drops it at once. A full table raises
`ObjectStoreFullError` rather than spilling: RL objects are short-lived, so a full store means
refs are leaking, and spilling would hide that behind slow disk I/O. The limit counts host
memory only: a GPU object is bounded by its device's allocator, which raises its own error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from objectstore.errors import (
    ObjectNotFoundError,
    ObjectStoreFullError,
    ObjectTypeError,
    ShardRangeError,
)
from objectstore.memory import format_bytes
from objectstore.ref import BATCH, TENSOR, VALUE, ObjectKind, ObjectRef, RowRange
from transport import codec, expose
from transport.dtypes import dtype_name, nbytes


@dataclass
class Entry:
    """One owned object: its ref, its value (a tensor, a dict of tensors, or a plain value)."""

    ref: ObjectRef
    value: Any
    local_refs: int = 1
    holders: dict[str, int] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)

    @property
    def on_host(self) -> bool:
        return not self.ref.device.startswith("cuda")

    def tensors(self) -> dict[str | None, torch.Tensor]:
        """The object's tensors by column name (None for a lone tensor)."""
        return {None: self.value} if self.ref.kind == TENSOR else self.value

    def rows(self, rows: RowRange | None) -> dict[str | None, torch.Tensor]:
        """The tensors of rows [start, stop) (all rows for None), as views."""
        tensors = self.tensors()
        if rows is None:
            return tensors
        return {k: t[rows.start:rows.stop] for k, t in tensors.items()}


def check_rows(ref: ObjectRef, rows: Any) -> RowRange | None:
    """`rows` as a RowRange inside the object's rows (None stays None); ShardRangeError if not."""
    if rows is None:
        return None
    if ref.kind == VALUE or ref.num_rows is None:
        raise ShardRangeError(f"object {ref.object_id} is a {ref.kind} without rows; "
                              "pull it whole (rows=None)")
    try:
        rng = RowRange(*rows)
    except TypeError as e:
        raise ShardRangeError(f"rows must be (start, stop), got {rows!r}") from e
    return rng.check(ref.num_rows, ref.object_id)


def _storable(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it can be stored as is (so a same-process get returns it), else a
    detached contiguous version (pulls send raw bytes, and must not drag autograd along)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def describe(value: Any, **owner: Any) -> tuple[ObjectRef, Any]:
    """The ref of `value` (owner fields: object_id, node_id, endpoint, bulk_addr) and the value
    as it will be stored."""
    if isinstance(value, torch.Tensor):
        value = _storable(value)
        ref = ObjectRef(kind=TENSOR, device=str(value.device), nbytes=nbytes(value),
                        dtype=dtype_name(value.dtype), shape=tuple(value.shape),
                        num_rows=value.shape[0] if value.dim() else None, **owner)
        return ref, value
    if isinstance(value, dict) and value and all(
            isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in value.items()):
        if any(_storable(t) is not t for t in value.values()):
            value = {k: _storable(t) for k, t in value.items()}
        rows = {t.shape[0] if t.dim() else None for t in value.values()}
        devices = {str(t.device) for t in value.values()}
        if len(rows) != 1 or None in rows:
            raise ObjectTypeError(
                "a batch's tensors must all have at least one dimension and share dim 0 "
                f"(rows); got shapes { {k: list(t.shape) for k, t in value.items()} }")
        if len(devices) != 1:
            raise ObjectTypeError(f"a batch's tensors must be on one device, got {sorted(devices)}")
        ref = ObjectRef(kind=BATCH, device=devices.pop(),
                        nbytes=sum(nbytes(t) for t in value.values()),
                        columns=tuple((k, dtype_name(t.dtype), tuple(t.shape)) for k, t in value.items()),
                        num_rows=rows.pop(), **owner)
        return ref, value
    try:
        frames = codec.encode(value)
    except Exception as e:
        raise ObjectTypeError(f"cannot store a {type(value).__qualname__}: {e}") from e
    size = sum(memoryview(f).nbytes for f in frames)
    return ObjectRef(kind=ObjectKind.VALUE, nbytes=size, **owner), value


class ObjectTable:
    """Owned objects by id, their reference counts and the memory they use.

    Its `@expose` methods are the owner's RPC endpoints for refcounts (`incref`, `decref`,
    `free`, `release_holder`) and metadata (`meta`).
    """

    def __init__(self, *, name: str, node_id: str, memory_limit_bytes: int | None = None,
                 on_drop: Callable[[Entry], None] | None = None) -> None:
        self.name, self.node_id = name, node_id
        self.memory_limit_bytes = memory_limit_bytes
        self.bytes_used = 0
        self.host_bytes_used = 0  # what the limit counts
        self.frees = 0
        self._on_drop = on_drop
        self._entries: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, object_id: object) -> bool:
        return object_id in self._entries

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def add(self, ref: ObjectRef, value: Any) -> Entry:
        """Own `value` under `ref` with one local reference; ObjectStoreFullError past the limit."""
        entry = Entry(ref, value)
        limit = self.memory_limit_bytes
        if limit is not None and entry.on_host and self.host_bytes_used + ref.nbytes > limit:
            raise ObjectStoreFullError(self._full_message(ref.nbytes, limit))
        self.bytes_used += ref.nbytes
        if entry.on_host:
            self.host_bytes_used += ref.nbytes
        self._entries[ref.object_id] = entry
        return entry

    def _full_message(self, wanted: int, limit: int, top: int = 5) -> str:
        """What is full, the biggest objects with who holds them, and what to do."""
        held = sorted((e for e in self._entries.values() if e.on_host), key=lambda e: -e.ref.nbytes)
        now = time.monotonic()
        lines = []
        for e in held[:top]:
            holders = [f"this store ({e.local_refs} local ref{'s' * (e.local_refs != 1)})"] if e.local_refs > 0 else []
            holders += [f"{h} ({n})" for h, n in sorted(e.holders.items())]
            lines.append(f"{e.ref.object_id} ({e.ref.kind}, {format_bytes(e.ref.nbytes)}, "
                         f"{now - e.created:.0f}s old) held by {', '.join(holders) or 'nobody'}")
        if wanted > limit:
            return (f"store {self.name} on node {self.node_id} cannot take an object of "
                    f"{format_bytes(wanted)}: that alone is over its {format_bytes(limit)} memory limit; "
                    "raise objectstore.memory_limit (bytes per store; memory_limit_bytes= for an "
                    "ObjectStore of your own) or split the object")
        biggest = "; ".join(lines) if lines else "none"
        more = f" and {len(held) - top} more" if len(held) > top else ""
        return (f"store {self.name} on node {self.node_id} cannot take {format_bytes(wanted)} more: "
                f"{format_bytes(self.host_bytes_used)} of its {format_bytes(limit)} memory limit are held by "
                f"{len(held)} objects. Biggest first: {biggest}{more}. Free the objects you no longer "
                "need (ObjectStore.free/decref; in a job, drop the batches that name them so their "
                "objects are freed), or raise objectstore.memory_limit (bytes per store; "
                "memory_limit_bytes= for an ObjectStore of your own)")

    def entry(self, object_id: Any) -> Entry:
        """The entry of `object_id`; ObjectNotFoundError when it is not here."""
        entry = self._entries.get(object_id) if isinstance(object_id, str) else None
        if entry is None:
            raise ObjectNotFoundError(
                f"object {object_id!r} is not in store {self.name} on {self.node_id}: it was freed "
                "or never existed; keep a reference (incref) until every consumer has pulled it")
        return entry

    def drop(self, object_id: str) -> bool:
        """Forget the object now; False when it was already gone."""
        entry = self._entries.pop(object_id, None)
        if entry is None:
            return False
        self.bytes_used -= entry.ref.nbytes
        if entry.on_host:
            self.host_bytes_used -= entry.ref.nbytes
        self.frees += 1
        if self._on_drop is not None:
            self._on_drop(entry)
        return True

    def drop_all(self) -> None:
        for object_id in list(self._entries):
            self.drop(object_id)

    def add_local_ref(self, object_id: str) -> None:
        self.entry(object_id).local_refs += 1

    def release_local_ref(self, object_id: str) -> None:
        entry = self.entry(object_id)
        entry.local_refs -= 1
        self._maybe_drop(entry)

    def _maybe_drop(self, entry: Entry) -> None:
        if entry.local_refs <= 0 and not entry.holders:
            self.drop(entry.ref.object_id)

    # owner endpoints ------------------------------------------------------------------------
    @expose
    def meta(self, object_id: str) -> ObjectRef:
        return self.entry(object_id).ref

    @expose
    def incref(self, object_id: str, holder: str) -> None:
        entry = self.entry(object_id)
        entry.holders[holder] = entry.holders.get(holder, 0) + 1

    @expose
    def decref(self, object_id: str, holder: str) -> None:
        entry = self.entry(object_id)
        count = entry.holders.get(holder, 0) - 1
        if count > 0:
            entry.holders[holder] = count
        else:
            entry.holders.pop(holder, None)
        self._maybe_drop(entry)

    @expose
    def free(self, object_id: str) -> bool:
        return self.drop(object_id)

    @expose
    def free_many(self, object_ids: list[str]) -> int:
        """`free` each of `object_ids`; how many were still here."""
        if not isinstance(object_ids, list) or not all(isinstance(o, str) for o in object_ids):
            raise TypeError(f"free_many takes a list of object ids, got {type(object_ids).__name__}")
        return sum(self.drop(o) for o in object_ids)

    @expose
    def release_holder(self, holder: str) -> int:
        """Drop every hold of a store that died (called by whoever noticed it)."""
        released = 0
        for entry in list(self._entries.values()):
            if entry.holders.pop(holder, None) is not None:
                released += 1
                self._maybe_drop(entry)
        return released
