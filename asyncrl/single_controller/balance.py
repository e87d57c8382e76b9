"""Balanced partitions of rows by token count: data-parallel shards and micro-batches whose
tokens are near equal, so no rank or micro-batch sets the step's pace with the long tail."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def karmarkar_karp(weights: Sequence[float], parts: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` in `parts` sets with near-equal sums (the largest differencing
    method, k-way); with `equal_size` every set gets len(weights) / parts items (it must divide).
    Each set's indices are in ascending order; sets are ordered by their smallest index."""
    n = len(weights)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if equal_size and n % parts:
        raise ValueError(f"{n} items do not split into {parts} equal sets")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    if equal_size:  # each starting state: `parts` consecutive items, one per set
        starts = [order[j:j + parts] for j in range(0, n, parts)]
    else:
        starts = [[i] for i in order]
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for tie, items in enumerate(starts):
        sets = [(float(weights[i]), [i]) for i in items] + [(0.0, []) for _ in range(parts - len(items))]
        heapq.heappush(heap, _entry(sets, tie))
    tie = len(starts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda s: -s[0])
        b.sort(key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b, strict=True)]
        heapq.heappush(heap, _entry(merged, tie))
        tie += 1
    sets = [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(parts)]
    return sorted(sets, key=lambda s: (s[0] if s else n, len(s)))


def _entry(sets: list[tuple[float, list[int]]], tie: int) -> tuple[float, int, list[tuple[float, list[int]]]]:
    sums = [s for s, _ in sets]
    return (-(max(sums) - min(sums)), tie, sets)


def imbalance(loads: Sequence[float]) -> float:
    """The largest load over the mean (1.0: perfectly balanced)."""
    mean = sum(loads) / max(1, len(loads))
    return max(loads) / mean if mean > 0 else 1.0


def balanced_shards(tokens: Sequence[float], shards: int) -> list[int]:
    """A row order whose `shards` equal consecutive chunks (the dispatch's split) carry
    near-equal tokens; the rows must divide by `shards`."""
    sets = karmarkar_karp(tokens, shards, equal_size=True)
    return [i for s in sets for i in s]


__all__ = ["balanced_shards", "imbalance", "karmarkar_karp"]
