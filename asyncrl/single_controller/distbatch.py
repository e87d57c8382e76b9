"""Distributed batches: a `Batch` whose rows live in workers' object stores — the plan only.

A `DistBatch` is a list of row blocks; each block is a few `Piece`s (columns of a stored object,
over a row range) with the same number of rows. Slicing, selecting, unions, concatenation,
padding and resharding between groups of different DP sizes only rewrite these row ranges — the
REAL-style transfer plan — and each rank then pulls exactly its rows from the owners. The
controller holds refs and row numbers, never tensors.

Here too: `materialize` (pull a DistBatch's rows into one `Batch`), `publish` (put a `Batch`
in a store and describe it as a DistBatch) and `RefTracker`, the driver's reference counts that
free a stored object once no DistBatch names it. A DistBatch carries the `RefTracker` it was made
with (the driver's, from its `JobContext`), and everything derived from it carries the same one.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.single_controller.batch import Batch
from objectstore import ObjectRef, ObjectStore
from objectstore.ref import TENSOR, VALUE
from transport import trace
from transport.codec import register_type
from transport.dtypes import torch_dtype
from transport.errors import CodecError
from transport.wire import Ext

log = logging.getLogger(__name__)

EXT_DIST_BATCH = int(Ext.DIST_BATCH)
SMALL_COLUMN_BYTES = 16 * 1024  # a batch's 1-D columns up to this size travel inside their ref


@dataclass(frozen=True, slots=True)
class Piece:
    """Columns `columns` of rows [start, stop) of the stored object `ref`."""

    ref: ObjectRef
    start: int
    stop: int
    columns: tuple[str, ...]

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def rows(self, start: int, stop: int) -> Piece:
        """Rows [start, stop) of this piece, counted from its first row."""
        return Piece(self.ref, self.start + start, self.start + stop, self.columns)

    def only(self, names: Iterable[str]) -> Piece | None:
        keep = tuple(c for c in self.columns if c in set(names))
        return Piece(self.ref, self.start, self.stop, keep) if keep else None


Block = tuple[Piece, ...]


def _block_rows(block: Block) -> int:
    return block[0].num_rows if block else 0


class DistBatch:
    """Row blocks of refs plus inline meta; the driver-side face of a distributed `Batch`.

    `tracker` (None: untracked, e.g. inside a worker or just decoded from the wire) counts this
    object's refs so the stored objects are freed once no tracked DistBatch names them.
    """

    __slots__ = ("blocks", "meta", "tracker", "__weakref__")

    def __init__(self, blocks: Sequence[Block] = (), meta: dict[str, Any] | None = None,
                 tracker: RefTracker | None = None) -> None:
        blocks = [tuple(b) for b in blocks if b]
        # rows only; a lone block of no rows stays (`empty`: no rows, the columns known)
        self.blocks: list[Block] = [b for b in blocks if _block_rows(b) > 0] or blocks[:1]
        self.meta: dict[str, Any] = dict(meta or {})
        for b in self.blocks:
            if len({p.num_rows for p in b}) != 1:
                raise ValueError(f"a block's pieces must cover equal row counts, got {b}")
        self.tracker: RefTracker | None = None
        if tracker is not None:
            tracker.track(self)

    def _derive(self, blocks: Sequence[Block], meta: dict[str, Any] | None = None) -> DistBatch:
        """A new plan over (some of) these rows, tracked by the same tracker."""
        return DistBatch(blocks, self.meta if meta is None else meta, self.tracker)

    # shape ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(_block_rows(b) for b in self.blocks)

    @property
    def columns(self) -> list[str]:
        if not self.blocks:
            return []
        return [c for p in self.blocks[0] for c in p.columns]

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    @property
    def pad_size(self) -> int:
        return int(self.meta.get("pad_size", 0))

    def refs(self) -> dict[str, ObjectRef]:
        return {p.ref.object_id: p.ref for b in self.blocks for p in b}

    def __repr__(self) -> str:
        owners = sorted({p.ref.endpoint for b in self.blocks for p in b})
        return (f"DistBatch({len(self)} rows, columns={self.columns}, {len(self.blocks)} blocks "
                f"on {len(owners)} stores, meta={sorted(self.meta)})")

    # row operations (plans only; no data moves) ------------------------------------------
    def slice(self, start: int, stop: int) -> DistBatch:
        """Rows [start, stop)."""
        start, stop, _ = slice(start, stop).indices(len(self))  # Python semantics, negatives too
        out, offset = [], 0
        for b in self.blocks:
            rows = _block_rows(b)
            lo, hi = max(start - offset, 0), min(stop - offset, rows)
            if lo < hi:
                out.append(tuple(p.rows(lo, hi) for p in b))
            offset += rows
        return self._derive(out)

    def take(self, indices: Sequence[int]) -> DistBatch:
        """Rows in the order of `indices` (consecutive runs stay one block)."""
        n = len(self)
        indices = [operator.index(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]
        bad = [i for i in indices if not -n <= i < n]
        if bad:
            raise IndexError(f"rows {bad[:5]} out of range for a batch of {n} rows")
        indices = [i % n for i in indices] if n else indices
        out: list[Block] = []
        run_start = run_stop = None
        for i in list(indices) + [None]:
            if i is not None and run_stop is not None and i == run_stop:
                run_stop += 1
                continue
            if run_start is not None:
                out.extend(self.slice(run_start, run_stop).blocks)
            if i is not None:
                run_start, run_stop = i, i + 1
        return self._derive(out)

    def empty(self) -> DistBatch:
        """No rows, the same columns: what a rank holding none of a batch's rows works on."""
        return self._derive([tuple(p.rows(0, 0) for p in self.blocks[0])] if self.blocks else [])

    def with_meta(self, **meta: Any) -> DistBatch:
        """The same rows with `meta` entries added or replaced."""
        return self._derive(self.blocks, {**self.meta, **meta})

    def chunk(self, n: int) -> list[DistBatch]:
        if len(self) % n:
            raise ValueError(f"{len(self)} rows do not split into {n} equal chunks; "
                             "use pad_to_divisor first")
        size = len(self) // n
        return [self.slice(i * size, (i + 1) * size) for i in range(n)]

    def split(self, size: int) -> list[DistBatch]:
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[DistBatch]) -> DistBatch:
        if any(b.pad_size for b in batches[:-1]):
            raise ValueError("unpad() batches before concatenating them: pad rows would end up "
                             "in the middle")
        last_pad = batches[-1].pad_size if batches else 0
        trackers = {id(b.tracker): b.tracker for b in batches if b.tracker is not None}
        if len(trackers) > 1:
            raise ValueError("cannot concat DistBatches tracked by different JobContexts")
        tracker = next(iter(trackers.values()), None)
        batches = [b for b in batches if len(b)] or list(batches[:1])
        if not batches:
            return DistBatch(tracker=tracker)
        cols = set(batches[0].columns)
        for b in batches[1:]:
            if set(b.columns) != cols:
                raise ValueError(f"cannot concat batches with columns {sorted(cols)} and {sorted(b.columns)}")
        meta = {**batches[0].meta, "pad_size": last_pad} if last_pad else {
            k: v for k, v in batches[0].meta.items() if k != "pad_size"}
        return DistBatch([blk for b in batches for blk in b.blocks], meta, tracker)

    def repeat(self, times: int, interleave: bool = True) -> DistBatch:
        if interleave:
            return self.take([i for i in range(len(self)) for _ in range(times)])
        return self._derive(self.blocks * times)

    def pad_to_divisor(self, divisor: int) -> DistBatch:
        """Append copies of the first rows (as refs) so len % divisor == 0; meta records pad_size."""
        n = len(self)
        pad = (-n) % divisor if n else 0
        extra = self.take([i % n for i in range(pad)]) if pad else None
        # padding twice adds up, like Batch
        return self._derive(self.blocks + (extra.blocks if extra else []),
                            {**self.meta, "pad_size": self.pad_size + pad})

    def unpad(self) -> DistBatch:
        return self._derive(self.slice(0, len(self) - self.pad_size).blocks, {**self.meta, "pad_size": 0})

    # column operations ------------------------------------------------------------------------
    def select(self, *names: str, meta: bool = True) -> DistBatch:
        missing = [n for n in names if n not in self.columns]
        if missing:
            raise KeyError(f"no columns {missing}; this batch has {self.columns}")
        blocks = [tuple(q for p in b if (q := p.only(names)) is not None) for b in self.blocks]
        return self._derive(blocks, self.meta if meta else {})

    def pop(self, *names: str) -> DistBatch:
        """Remove `names` from this batch and return them as their own batch."""
        popped = self.select(*names)
        keep = [c for c in self.columns if c not in names]
        # the refs stay counted under this object until it dies: tracking is per object, not column
        self.blocks = [tuple(q for p in b if (q := p.only(keep)) is not None) for b in self.blocks]
        return popped

    def union(self, other: DistBatch) -> DistBatch:
        """Columns of both, aligned row by row; a column in both must come from the same place."""
        if len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        cuts = sorted(set(_boundaries(self)) | set(_boundaries(other)))
        mine, theirs = _cut(self, cuts), _cut(other, cuts)
        both = set(self.columns) & set(other.columns)
        blocks = []
        for a, b in zip(mine, theirs, strict=True):
            for name in both:
                pa = next(p for p in a if name in p.columns)
                pb = next(p for p in b if name in p.columns)
                if (pa.ref.object_id, pa.start) != (pb.ref.object_id, pb.start):
                    raise ValueError(f"column {name!r} is in both batches with different data; "
                                     "pop it from one side first")
            extra = tuple(q for p in b if (q := p.only(set(p.columns) - both)) is not None)
            blocks.append(a + extra)
        for k, v in other.meta.items():
            if k in self.meta and self.meta[k] != v and k != "pad_size":
                raise ValueError(f"meta {k!r} differs: {self.meta[k]!r} vs {v!r}")
        return self._derive(blocks, {**other.meta, **self.meta})

    # moving data -------------------------------------------------------------------------------
    def _store(self, store: ObjectStore | None) -> ObjectStore:
        if store is not None:
            return store
        if self.tracker is None:
            raise ValueError("this DistBatch has no tracker (made inside a worker or decoded from "
                             "the wire); pass the store to pull with, e.g. fetch(self.store)")
        return self.tracker.store

    async def fetch(self, store: ObjectStore | None = None) -> Batch:
        """Pull these rows into this process as a `Batch` through `store` (default: the store of
        this batch's tracker, i.e. the driver's). The driver does this only on request."""
        with trace.span("fetch", "store", rows=len(self), columns=len(self.columns)):
            return await materialize(self, self._store(store))

    async def free(self, store: ObjectStore | None = None) -> None:
        """Free the stored objects now (instead of when the last DistBatch naming them is dropped)."""
        store = self._store(store)
        await asyncio.gather(*(store.free(r) for r in self.refs().values()), return_exceptions=True)


def _boundaries(d: DistBatch) -> list[int]:
    out, offset = [0], 0
    for b in d.blocks:
        offset += _block_rows(b)
        out.append(offset)
    return out


def _cut(d: DistBatch, cuts: list[int]) -> list[Block]:
    return [blk for lo, hi in zip(cuts, cuts[1:], strict=False) for blk in d.slice(lo, hi).blocks]


# moving bytes and freeing them ------------------------------------------------------------------
async def materialize(dist: DistBatch, store: ObjectStore, tally: list[int] | None = None) -> Batch:
    """Pull every piece's rows from its owner (one pull per stored object) into one Batch
    (`tally`: the bytes pulled from `store` itself and from other stores are added to its two
    entries). A batch of no rows gives its columns with no rows, pulling nothing."""
    if dist.blocks and not len(dist):
        return _no_rows(dist)
    spans: dict[str, tuple[ObjectRef, int, int]] = {}
    for b in dist.blocks:
        for p in b:
            ref, lo, hi = spans.get(p.ref.object_id, (p.ref, p.start, p.stop))
            spans[p.ref.object_id] = (ref, min(lo, p.start), max(hi, p.stop))

    async def pull(ref: ObjectRef, lo: int, hi: int) -> tuple[int, Any]:
        if ref.kind == VALUE:
            return 0, await store.get(ref)
        return lo, await store.get(ref, rows=(lo, hi))

    keys = list(spans)
    pulled = dict(zip(keys, await asyncio.gather(*(pull(*spans[k]) for k in keys)), strict=True))
    if tally is not None:
        for k in keys:
            tally[spans[k][0].endpoint != store.endpoint] += _nbytes(pulled[k][1])
    parts = []
    for b in dist.blocks:
        tensors, values = {}, {}
        for p in b:
            base, data = pulled[p.ref.object_id]
            for c in p.columns:
                if p.ref.kind == VALUE:
                    values[c] = list(data[c][p.start:p.stop])
                else:
                    tensors[c] = data[c][p.start - base:p.stop - base]
        parts.append(Batch(tensors, values))
    meta = {k: v for k, v in dist.meta.items() if k != "pad_size"}
    if not parts:
        return Batch(meta=meta)
    out = parts[0] if len(parts) == 1 else Batch.concat(parts)
    out.meta = meta
    return out


def _no_rows(dist: DistBatch) -> Batch:
    """The columns of `dist` (which has no rows), each with no rows, from its refs' schemas."""
    tensors, values = {}, {}
    for p in dist.blocks[0]:
        schema = {name: (dtype, shape) for name, dtype, shape in p.ref.columns or ()}
        for c in p.columns:
            if c in schema:
                tensors[c] = torch.empty((0, *schema[c][1][1:]), dtype=torch_dtype(schema[c][0]))
            elif p.ref.kind == TENSOR:
                tensors[c] = torch.empty((0, *(p.ref.shape or (0,))[1:]), dtype=torch_dtype(p.ref.dtype or "float32"))
            else:
                values[c] = []
    return Batch(tensors, values, {k: v for k, v in dist.meta.items() if k != "pad_size"})


def _nbytes(value: Any) -> int:
    """A pulled object's tensor bytes (a value's: its rows' count, a few bytes each)."""
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    return 8 * len(value) if isinstance(value, list) else 8


def publish(batch: Batch, store: ObjectStore, tracker: RefTracker | None = None) -> DistBatch:
    """Put a Batch in `store` (tensors zero-copy; non-tensor columns as one value) -> DistBatch,
    tracked by `tracker` when given (the driver's data). A host batch's one-number-per-row
    columns (scores, token counts) are an object of their own that travels inside its ref when
    it is at most SMALL_COLUMN_BYTES, so the driver and other ranks read them without a pull."""
    n = len(batch)
    pieces = []
    small = {k: t for k, t in batch.tensors.items() if t.dim() == 1 and t.device.type == "cpu"}
    if not n or sum(t.numel() * t.element_size() for t in small.values()) > SMALL_COLUMN_BYTES:
        small = {}
    if small:
        ref = store.put({k: t.contiguous() for k, t in small.items()}, inline=True)
        pieces.append(Piece(ref, 0, n, tuple(small)))
    rest = {k: t for k, t in batch.tensors.items() if k not in small}
    if rest and n:
        ref = store.put({k: t.contiguous() for k, t in rest.items()})
        pieces.append(Piece(ref, 0, n, tuple(rest)))
    if batch.non_tensors and n:
        ref = store.put({k: list(v) for k, v in batch.non_tensors.items()})
        pieces.append(Piece(ref, 0, n, tuple(batch.non_tensors)))
    return DistBatch([tuple(pieces)] if pieces else [], batch.meta, tracker)



class RefTracker:
    """Counts, per stored object, the live DistBatches tracked here that name it; frees the
    object through `store` (the driver's, which reaches every owner) when the count drops to 0."""

    def __init__(self, store: ObjectStore, loop: asyncio.AbstractEventLoop) -> None:
        self.store, self.loop = store, loop
        self.counts: dict[str, int] = {}
        self.refs: dict[str, ObjectRef] = {}
        self.lock = threading.Lock()  # finalizers run on whichever thread drops the last reference
        self.freed = 0
        self.dropped: list[ObjectRef] = []  # refs to free at the end of this turn of the loop
        self.closed = False

    def track(self, d: DistBatch) -> DistBatch:
        """Count `d`'s refs until it dies; `d` then carries this tracker (and so does all that
        is derived from it)."""
        if d.tracker is self:
            return d
        if d.tracker is not None:
            raise ValueError("this DistBatch is tracked by another JobContext already")
        d.tracker = self
        refs = d.refs()
        with self.lock:
            for oid, ref in refs.items():
                self.counts[oid] = self.counts.get(oid, 0) + 1
                self.refs[oid] = ref
        weakref.finalize(d, self.release, list(refs))
        return d

    def release(self, object_ids: list[str]) -> None:
        dead = []
        with self.lock:
            for oid in object_ids:
                left = self.counts.get(oid, 0) - 1
                if left > 0:
                    self.counts[oid] = left
                elif oid in self.refs:
                    self.counts.pop(oid, None)
                    dead.append(self.refs.pop(oid))
        if dead and not self.closed and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._free_soon, dead)

    def _free_soon(self, refs: list[ObjectRef]) -> None:
        """Free `refs` with the others dropped in this turn of the loop: one call per owner."""
        if self.closed:
            return
        if not self.dropped:
            self.loop.call_soon(self._free_dropped)
        self.dropped.extend(refs)

    def _free_dropped(self) -> None:
        refs, self.dropped = self.dropped, []

        async def free() -> None:
            try:
                await self.store.free_many(refs)
                self.freed += len(refs)
            except Exception as e:  # noqa: BLE001 - an owner may be gone already: nothing left to free
                log.debug("free %d objects: %s", len(refs), e)
        if refs and not self.closed:
            self.loop.create_task(free())

    def close(self) -> None:
        """Stop freeing (the job is over; the stores go with their workers)."""
        self.closed = True

    @property
    def live(self) -> int:
        return len(self.counts)


# wire format -----------------------------------------------------------------------------------
def _to_wire(d: DistBatch) -> list[Any]:
    """Each ref once (an inline ref with only the rows these pieces read), then the pieces
    naming refs by index."""
    index: dict[str, int] = {}
    refs: list[ObjectRef] = []
    spans: dict[int, tuple[int, int]] = {}
    for b in d.blocks:
        for p in b:
            i = index.setdefault(p.ref.object_id, len(refs))
            if i == len(refs):
                refs.append(p.ref)
            lo, hi = spans.get(i, (p.start, p.stop))
            spans[i] = (min(lo, p.start), max(hi, p.stop))
    refs = [r.narrowed(*spans[i]) if r.inline is not None else r for i, r in enumerate(refs)]
    return [refs, [[[index[p.ref.object_id], p.start, p.stop, list(p.columns)] for p in b] for b in d.blocks], d.meta]


def _from_wire(v: list[Any]) -> DistBatch:
    refs, blocks, meta = v
    try:
        return DistBatch([tuple(Piece(refs[i], s, e, tuple(c)) for i, s, e, c in b) for b in blocks], meta)
    except (IndexError, TypeError) as e:
        raise CodecError(f"a DistBatch piece names a ref it does not carry: {e}") from None


register_type(DistBatch, EXT_DIST_BATCH, _to_wire, _from_wire)


