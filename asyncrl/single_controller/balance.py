"""Balanced partitions of rows by token count: data-parallel shards and micro-batches whose
tokens are near equal, so no rank or micro-batch sets the step's pace with the long tail."""

from __future__ import annotations

import bisect
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


def balanced_shards(tokens: Sequence[float], shards: int, tolerance: float = 0.01) -> list[int]:
    """A row order whose `shards` equal consecutive chunks (the dispatch's split) carry
    near-equal tokens, moving few rows: each chunk keeps its own rows but for pairs swapped
    between the heaviest and the lightest chunk while a swap narrows their gap, until the
    largest load is within `tolerance` of the mean. Rows that stay keep their order, so a
    chunk remains mostly one run of the rows its rank already holds; the rows must divide by
    `shards`. Where the swaps stall above what Karmarkar-Karp reaches, its order is taken."""
    n = len(tokens)
    if n % shards:
        raise ValueError(f"{n} rows do not split into {shards} equal shards")
    size = n // shards
    members = [list(range(k * size, (k + 1) * size)) for k in range(shards)]
    loads = [float(sum(tokens[i] for i in m)) for m in members]
    mean = sum(loads) / max(1, shards)
    for _ in range(n):
        hi, lo = loads.index(max(loads)), loads.index(min(loads))
        if mean <= 0 or loads[hi] <= mean * (1 + tolerance) or hi == lo:
            break
        swap = _best_swap(tokens, members[hi], members[lo], loads[hi] - loads[lo])
        if swap is None:
            break
        a, b = swap
        members[hi].remove(a), members[lo].remove(b)
        members[hi].append(b), members[lo].append(a)
        moved = float(tokens[a]) - float(tokens[b])
        loads[hi] -= moved
        loads[lo] += moved
    if mean > 0 and max(loads) > mean * (1 + tolerance):
        sets = karmarkar_karp(tokens, shards, equal_size=True)
        if imbalance([sum(tokens[i] for i in s) for s in sets]) < max(loads) / mean:
            return [i for s in sets for i in s]
    return [i for m in members for i in m]


def _best_swap(tokens: Sequence[float], heavy: list[int], light: list[int], gap: float) -> tuple[int, int] | None:
    """The pair (row of `heavy`, row of `light`) whose swap leaves the two loads closest, if
    any swap narrows their gap: moving d = w[a] - w[b] leaves |gap - 2d|, best at d = gap / 2."""
    ranked = sorted(light, key=lambda i: tokens[i])
    weights = [float(tokens[i]) for i in ranked]
    best, best_left = None, gap
    for a in heavy:
        want = float(tokens[a]) - gap / 2  # the light row's ideal weight
        j = bisect.bisect_left(weights, want)
        for k in (j - 1, j):
            if 0 <= k < len(ranked):
                left = abs(gap - 2 * (float(tokens[a]) - weights[k]))
                if left < best_left - 1e-9:
                    best, best_left = (a, ranked[k]), left
    return best


__all__ = ["balanced_shards", "imbalance", "karmarkar_karp"]
