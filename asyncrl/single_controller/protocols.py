"""Transfer protocols (HybridFlow Table 3): how one driver call fans out to a group's ranks
(`distribute`) and how their outputs become one result (`collect`).

Both run on the driver over refs: a batch argument is split by rewriting row ranges of a
`DistBatch`, and each rank pulls its own rows from the owners. The nD protocols read the
group's `ParallelLayout`s (the same values its workers built their device meshes from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.parallel import DATA_DIMS, ROLLOUT, TRAIN, ParallelLayout, pure_dp

ONE_TO_ALL = "ONE_TO_ALL"
DP_PROTO = "DP_PROTO"
THREE_D_PROTO = "3D_PROTO"
THREE_D_ALL_MICRO_DP = "3D_ALL_MICRO_DP"
THREE_D_PP_ONLY = "3D_PP_ONLY"
ALL_TO_ALL = "ALL_TO_ALL"
RANK_ZERO = "RANK_ZERO"
LOCAL_ROWS = "LOCAL_ROWS"

RankCalls = dict[int, tuple[tuple, dict]]  # rank -> (args, kwargs)


@dataclass
class CallContext:
    """What a protocol sees of one call: the group's size, parallel layouts and each rank's
    object-store endpoint, and a scratch dict where `distribute` leaves notes for `collect`
    (e.g. the pad size)."""

    group: str
    method: str
    world_size: int
    layouts: dict[str, ParallelLayout] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    stores: list[str] = field(default_factory=list)  # rank -> its store's endpoint

    def layout(self, name: str = TRAIN) -> ParallelLayout:
        """Layout `name`; a group without it falls back to its train layout, then to pure DP."""
        if name in self.layouts:
            return self.layouts[name]
        if TRAIN in self.layouts:
            return self.layouts[TRAIN]
        return pure_dp(self.world_size)


@dataclass(frozen=True)
class Protocol:
    """`stays_local(ctx, plan)` (after `distribute`): whether each rank's output is exactly its
    part of the collected result, in the same order, for a LOCAL_ROWS call that consumes it —
    what lets such a call be sent before this one's replies (`WorkerGroup`'s pipelining)."""

    name: str
    distribute: Callable[[CallContext, tuple, dict], RankCalls]
    collect: Callable[[CallContext, dict[int, Any]], Any]
    stays_local: Callable[[CallContext, RankCalls], bool] | None = None


_PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(name: str, distribute: Callable[[CallContext, tuple, dict], RankCalls],
                      collect: Callable[[CallContext, dict[int, Any]], Any],
                      stays_local: Callable[[CallContext, RankCalls], bool] | None = None) -> Protocol:
    """Add a user protocol usable as `@register(protocol=name)`."""
    proto = Protocol(name, distribute, collect, stays_local)
    _PROTOCOLS[name] = proto
    return proto


def get_protocol(name: str) -> Protocol:
    try:
        return _PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown transfer protocol {name!r}; known: {sorted(_PROTOCOLS)} "
                         "(add your own with asyncrl.register_protocol)") from None


def known_protocols() -> list[str]:
    return sorted(_PROTOCOLS)


# building blocks ---------------------------------------------------------------------------------
def _is_batch(v: Any) -> bool:
    return isinstance(v, (DistBatch, Batch))


def split_batch(v: DistBatch | Batch, n: int) -> tuple[list[Any], int]:
    """`n` equal shards of a batch (padded by repeating leading rows, by reference for a
    DistBatch) and the pad size."""
    padded = v.pad_to_divisor(n)
    return padded.chunk(n), padded.pad_size


def scatter(ctx: CallContext, args: tuple, kwargs: dict, n: int,
            index_of: Callable[[int], int | None]) -> RankCalls:
    """Split batch arguments into `n` shards; rank r gets shard `index_of(r)` (None: not called).
    Other arguments are broadcast."""
    shards_a = [split_batch(a, n) if _is_batch(a) else None for a in args]
    shards_k = {k: split_batch(v, n) if _is_batch(v) else None for k, v in kwargs.items()}
    first = next((s for s in [*shards_a, *shards_k.values()] if s is not None), None)
    if first is not None:  # pad rows sit at the end: which shards hold how many of them
        shards, pad = first
        size = len(shards[0]) if shards else 0
        total = size * n
        ctx.state["shard_rows"] = size
        ctx.state["shard_pads"] = [max(0, min(size, (i + 1) * size - (total - pad))) for i in range(n)]
    ctx.state["shards"] = n
    calls: RankCalls = {}
    for rank in range(ctx.world_size):
        i = index_of(rank)
        if i is None:
            continue
        a = tuple(s[0][i] if s is not None else v for v, s in zip(args, shards_a, strict=True))
        k = {name: shards_k[name][0][i] if shards_k[name] is not None else v
             for name, v in kwargs.items()}
        calls[rank] = (a, k)
    return calls


def gather(ctx: CallContext, outputs: list[Any]) -> Any:
    """Concatenate batch outputs (in shard order), dropping the rows that came from padding;
    other outputs as a list.

    A shard's output may have k rows per input row (e.g. n samples per prompt): the pad rows'
    k·pad outputs are dropped from the end of that shard's output.
    """
    batches = outputs and all(isinstance(o, (DistBatch, Batch)) for o in outputs)
    if not batches:
        return outputs
    pads = ctx.state.get("shard_pads")
    if pads and any(pads):
        if len(outputs) != len(pads):
            raise ValueError(f"{ctx.group}.{ctx.method}: {len(outputs)} outputs for {len(pads)} "
                             "padded shards; the collect ranks must cover every shard")
        size = ctx.state["shard_rows"]
        trimmed = []
        for out, pad in zip(outputs, pads, strict=True):
            if pad and size:
                per_row, rest = divmod(len(out), size)
                if rest:
                    raise ValueError(f"{ctx.group}.{ctx.method} returned {len(out)} rows for a "
                                     f"padded shard of {size}; a DP method's output rows must be "
                                     "a whole multiple of its input rows")
                out = out.slice(0, len(out) - pad * per_row)
            trimmed.append(out)
        outputs = trimmed
    if all(isinstance(o, DistBatch) for o in outputs):
        return with_slowest_timings(DistBatch.concat(outputs), outputs)
    return with_slowest_timings(Batch.concat(outputs), outputs)


def with_slowest_timings(out: Any, parts: list[Any]) -> Any:
    """`out` (the ranks' outputs concatenated, meta from the first) with each `timing/` entry of
    the slowest rank: a phase lasts as long as its slowest rank, which the step waits for."""
    slowest: dict[str, float] = {}
    for part in parts:
        for k, v in part.meta.items():
            if k.startswith("timing/"):
                slowest[k] = max(v, slowest.get(k, v))
    if not slowest:
        return out
    if isinstance(out, DistBatch):
        return out.with_meta(**slowest)
    out.meta.update(slowest)
    return out


def _all(ctx: CallContext, args: tuple, kwargs: dict) -> RankCalls:
    return {r: (args, kwargs) for r in range(ctx.world_size)}


def _in_rank_order(outputs: dict[int, Any]) -> list[Any]:
    return [outputs[r] for r in sorted(outputs)]


# the built-in protocols ----------------------------------------------------------------------------
def _all_to_all(ctx: CallContext, args: tuple, kwargs: dict) -> RankCalls:
    for v in [*args, *kwargs.values()]:
        if not isinstance(v, (list, tuple)) or len(v) != ctx.world_size:
            raise ValueError(f"{ctx.group}.{ctx.method} is ALL_TO_ALL: every argument must be a "
                             f"list with one entry per rank ({ctx.world_size})")
    return {r: (tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()})
            for r in range(ctx.world_size)}


def _dp(ctx: CallContext, args: tuple, kwargs: dict) -> RankCalls:
    return scatter(ctx, args, kwargs, ctx.world_size, lambda r: r)


def _three_d(layout_name: str, data_dims: tuple[str, ...]) -> Callable[[CallContext, tuple, dict], RankCalls]:
    def distribute(ctx: CallContext, args: tuple, kwargs: dict) -> RankCalls:
        layout = ctx.layout(layout_name)
        ctx.state["layout"] = layout
        ctx.state["data_dims"] = data_dims
        return scatter(ctx, args, kwargs, layout.data_shards(data_dims),
                       lambda r: layout.data_index(r, data_dims))
    return distribute


def _collect_3d(ctx: CallContext, outputs: dict[int, Any]) -> Any:
    layout, dims = ctx.state["layout"], ctx.state["data_dims"]
    keep = {layout.data_index(r, dims): outputs[r] for r in sorted(outputs)
            if layout.is_collect_rank(r, dims)}
    return gather(ctx, [keep[i] for i in sorted(keep)])


def _collect_pp_only(ctx: CallContext, outputs: dict[int, Any]) -> list[Any]:
    """One output per pipeline stage (the rank at 0 on every other dim), in stage order."""
    layout = ctx.layout(TRAIN)
    firsts = [r for r in sorted(outputs)
              if all(c == 0 for d, c in layout.coords(r).items() if d != "pp")]
    return [outputs[r] for r in sorted(firsts, key=lambda r: layout.coord(r, "pp"))]


def _owner(block: tuple, stores: dict[str, int]) -> str:
    """The store holding most of a row block's columns (the first such piece's on a tie)."""
    held: dict[str, int] = {}
    for piece in block:
        held[piece.ref.endpoint] = held.get(piece.ref.endpoint, 0) + len(piece.columns)
    return max(held, key=lambda e: (held[e], e in stores))


def owned_rows(batch: DistBatch, stores: list[str]) -> list[list[int]]:
    """Row indices per rank: each row goes to the rank whose store holds most of its columns;
    rows held outside the group (the driver's, another pool's) go, a store at a time, to the
    rank with the fewest rows so far."""
    rank_of = {e: r for r, e in enumerate(stores)}
    rows: list[list[int]] = [[] for _ in stores]
    foreign: dict[str, int] = {}
    start = 0
    for block in batch.blocks:
        n = block[0].num_rows
        owner = _owner(block, rank_of)
        if owner in rank_of:
            r = rank_of[owner]
        else:
            r = foreign.setdefault(owner, min(range(len(stores)), key=lambda i: len(rows[i])))
        rows[r].extend(range(start, start + n))
        start += n
    return rows


def _local_rows(ctx: CallContext, args: tuple, kwargs: dict) -> RankCalls:
    """Every rank gets the rows its store holds (the first batch argument decides; a batch with
    1/k as many rows goes along by row // k); ranks holding none get empty batches."""
    batches = [v for v in [*args, *kwargs.values()] if _is_batch(v)]
    if not batches or not isinstance(batches[0], DistBatch):
        raise ValueError(f"{ctx.group}.{ctx.method} is LOCAL_ROWS: its first batch argument must be a "
                         "DistBatch (rows in the workers' stores)")
    if len(ctx.stores) != ctx.world_size:
        raise ValueError(f"{ctx.group}.{ctx.method} is LOCAL_ROWS but the group knows "
                         f"{len(ctx.stores)} store endpoints for {ctx.world_size} ranks")
    lead = batches[0]
    per_rank = owned_rows(lead, ctx.stores)
    ctx.state["order"] = [i for rows in per_rank for i in rows]

    def part(v: Any, rows: list[int]) -> Any:
        if not _is_batch(v):
            return v
        if not rows:
            return v.empty()
        if len(v) == len(lead):
            return v.take(rows)
        k, rest = divmod(len(lead), len(v)) if len(v) else (0, 1)
        if rest or len(rows) % k or any(rows[i] // k != rows[i - i % k] // k for i in range(len(rows))):
            raise ValueError(f"{ctx.group}.{ctx.method}: a batch of {len(v)} rows goes along a batch of "
                             f"{len(lead)} only when each of its rows has k whole consecutive rows there")
        return v.take([i // k for i in rows[::k]])

    return {r: (tuple(part(a, rows) for a in args), {k: part(v, rows) for k, v in kwargs.items()})
            for r, rows in enumerate(per_rank)}


def _shards_stay_local(ctx: CallContext, plan: RankCalls) -> bool:
    """A split call's outputs are the ranks' own parts when every rank got a shard, collects it,
    and none was padded."""
    if len(plan) != ctx.world_size or ctx.state.get("shards") != ctx.world_size or any(ctx.state.get("shard_pads", ())):
        return False
    layout = ctx.state.get("layout")
    return layout is None or all(layout.is_collect_rank(r, ctx.state["data_dims"]) for r in plan)


def _collect_local_rows(ctx: CallContext, outputs: dict[int, Any]) -> Any:
    """The ranks' batches back in the rows' original order (a plan over refs: nothing moves)."""
    parts = _in_rank_order(outputs)
    if not all(isinstance(o, (DistBatch, Batch)) for o in parts):
        return parts
    order = ctx.state["order"]
    out = with_slowest_timings(DistBatch.concat(parts) if all(isinstance(o, DistBatch) for o in parts)
                               else Batch.concat(parts), parts)
    if len(out) != len(order):
        raise ValueError(f"{ctx.group}.{ctx.method} is LOCAL_ROWS: it returned {len(out)} rows for "
                         f"{len(order)}; each rank must return one row per row it got")
    where = {row: i for i, row in enumerate(order)}
    return out.take([where[row] for row in range(len(order))])


register_protocol(ONE_TO_ALL, _all, lambda ctx, out: _in_rank_order(out))
register_protocol(ALL_TO_ALL, _all_to_all, lambda ctx, out: _in_rank_order(out))
register_protocol(RANK_ZERO, lambda ctx, a, k: {0: (a, k)}, lambda ctx, out: out[0])
# where the rows live: each rank works on the rows its own store holds (advantages, rule rewards)
register_protocol(LOCAL_ROWS, _local_rows, _collect_local_rows, lambda ctx, plan: True)
register_protocol(DP_PROTO, _dp, lambda ctx, out: gather(ctx, _in_rank_order(out)), _shards_stay_local)
register_protocol(THREE_D_PROTO, _three_d(TRAIN, ("dp",)), _collect_3d, _shards_stay_local)
# Generation layouts split each training model-parallel group into micro-DP groups (HybridFlow
# §5.3): data splits over dp × micro-DP, is broadcast inside each generation TP group, and
# comes back from generation-TP rank 0 of the last generation stage.
register_protocol(THREE_D_ALL_MICRO_DP, _three_d(ROLLOUT, DATA_DIMS), _collect_3d, _shards_stay_local)
register_protocol(THREE_D_PP_ONLY, _all, _collect_pp_only)
