"""Moving a distributed batch's bytes: `materialize` pulls a `DistBatch`'s rows through a store
into one `Batch`; `publish` puts a `Batch` into a store and describes it as a `DistBatch`.
Both take the store as an argument: inside a worker it is the worker's, on the driver the
`JobContext`'s."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrl.batch import Batch
from asyncrl.distbatch import DistBatch, Piece
from asyncrl.refs import RefTracker
from asyncrl.tree import tree_map, tree_map_async
from objectstore import ObjectRef, ObjectStore
from objectstore.ref import VALUE


async def materialize(dist: DistBatch, store: ObjectStore) -> Batch:
    """Pull every piece's rows from its owner (one pull per stored object) into one Batch."""
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


def to_device(value: Any, device: str | torch.device) -> Any:
    """`value` with every Batch in it (nested in lists, tuples, dicts) on `device`; on a CPU
    device nothing moves (pulled rows arrive in host memory)."""
    device = torch.device(device)
    if device.type == "cpu":
        return value
    return tree_map(lambda b: b.to(device), value, Batch)


def publish(batch: Batch, store: ObjectStore, tracker: RefTracker | None = None) -> DistBatch:
    """Put a Batch in `store` (tensors zero-copy; non-tensor columns as one value) -> DistBatch,
    tracked by `tracker` when given (the driver's data)."""
    n = len(batch)
    pieces = []
    if batch.tensors and n:
        ref = store.put({k: t.contiguous() for k, t in batch.tensors.items()})
        pieces.append(Piece(ref, 0, n, tuple(batch.tensors)))
    if batch.non_tensors and n:
        ref = store.put({k: list(v) for k, v in batch.non_tensors.items()})
        pieces.append(Piece(ref, 0, n, tuple(batch.non_tensors)))
    return DistBatch([tuple(pieces)] if pieces else [], batch.meta, tracker)


async def materialize_all(value: Any, store: ObjectStore) -> Any:
    """`value` with every DistBatch in it (nested in lists, tuples, dicts) pulled into a Batch."""
    return await tree_map_async(lambda d: materialize(d, store), value, DistBatch)


def publish_all(value: Any, store: ObjectStore) -> Any:
    """`value` with every Batch in it put in `store` and replaced by its DistBatch."""
    return tree_map(lambda b: publish(b, store), value, Batch)
