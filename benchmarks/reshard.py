"""The 3D-HybridEngine reshard (training shards -> generation shards) against Table 2's peers,
measured in the same run on gloo CPU ranks.

    python -m benchmarks.reshard [--ranks 4] [--tp 4] [--gen-tp 2] [--reps 5]
    python -m benchmarks.reshard --ranks 8        # t=4, d=2: FSDP also shards over dp
    python -m benchmarks.reshard --ranks 8 --tp 2 --gen-tp 1 --pp 2   # p=2 pipeline stages

Every rank builds the same random-init fp32 Llama (default 116.7 M parameters: hidden 1024,
intermediate 2048, 8 layers, 16 heads, vocab 32000, tied embeddings, so the embedding/LM head
is one vocabulary-split tensor), applies `apply_tp` over the training TP group (t) and
`apply_fsdp` over dp (d = ranks / t), and then turns the training shards into generation
shards for tg-way generation tensor parallelism (pg = p = 1) four ways (HybridFlow §5.4,
Table 2):

- `hybridflow`: `Resharder.reshard()` with its default settings (one all-gather per bucket
  inside each micro-DP group × dp), then `release()` outside the timer;
- `hybridflow_v`: Table 2's HybridFlow-V: every TP-split weight all-gathered whole inside the
  training TP group (t ranks) into one model-sized buffer (peak M), then this rank's generation
  shard copied out at the naive (consecutive-rank) generation TP coordinate. With d > 1 each
  FSDP chunk is first all-gathered over dp to rebuild the training TP shard;
- `dschat`: DeepSpeed-Chat's all-gather of the whole model over all N ranks: the flattened
  model is cut into buckets of `--bucket-mib` MiB (gather output), each split evenly over the N
  ranks (ZeRO-3 style; these slices are built once, untimed), gathered straight into a
  model-sized buffer, then the generation shards are copied out;
- `full_state`: today's full-state gather, `FSDPEngine(..., optim=None).full_state_dict(
  rank0_only=False)`: every rank gets the whole model (time only; its bytes are implied, not
  counted: (N-1)/N of the TP-split part plus (d-1)/d of the replicated part).

Bytes are counted at each collective call as (group size - 1) × input bytes, the way the
Resharder counts them. Table 2's HybridFlow volume is (t·p - tg·pg)/(tg·pg·t·p)·M; with FSDP over
d it generalises to M/(tg·pg) - M/(t·p·d). Here M is split honestly: `split_bytes` (the
TP-split weights, the formula's M) and `replicated_bytes` (RMSNorm weights, replicated over TP:
never communicated when d = 1 and all-gathered over dp, (d-1)/d of them, when d > 1), so
`formula_bytes = split·(1/(tg·pg) - 1/(t·p·d)) + replicated·(1 - 1/d)`. The peak-memory formula
is the part of the generation partition that cannot alias the training shards:
`peak_formula_bytes = split/(tg·pg)` (+ replicated when d > 1).

Each method's generation shards are checked bit-identical to the reference (each parameter's
`full_tensor()` chunked along its TP dim into tg parts, at the rank's generation TP
coordinate) on the warmup run; a mismatch fails the run. Times are the max over ranks of one
rank's wall time per rep (after a barrier), median over `--reps` after one warmup; the four
methods are interleaved within each rep. Ranks use one torch thread each; on a machine with
fewer cores than ranks they share cores, which slows every method alike.

With `--pp P` (p > 1, pg = 1) every rank builds its training stage with `parallelize(model,
layout)` (stage split, TP, FSDP), the model untied first (`untie_embeddings`: stages cannot
share the tied embedding/LM head; the JSON's model says `untied_for_pp`). The Resharder
gathers inside the stage's micro-DP × dp group, then broadcasts each stage's generation shards
across the stages; HybridFlow-V gathers each stage whole inside its TP group and broadcasts the
stages' whole weights across the pipeline (p ranks of one dp/tp coordinate, peak M); DS-Chat is
unchanged (the whole model over N ranks); `full_state` is `PipelineEngine(..., optim=None)
.full_state_dict(rank0_only=False)`, which gathers the stages. Every method is checked on every
parameter of the FULL model against a plain model built with the same seed (untied the same
way), chunked along `planned_shard_dim`. The embedding sits on the first stage and the LM head on
the last, so stages are unequal while Table 2 assumes M/p each: `formula_bytes` stays Table 2's
value, `expected_bytes` is the Resharder's exact count, `bytes_ratio` = bytes_per_rank /
formula_bytes deviates from 1 by the stage imbalance, reported as `stage_imbalance` (the stage of
the rank receiving most: its stage's bytes / (M/p)) and `stage_imbalance_by_stage`.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from daemons.proc import die_with_parent, exit_reason, free_port, run_spawned

METHODS = ("hybridflow", "hybridflow_v", "dschat", "full_state")


class ReshardCheckError(RuntimeError):
    """A method's generation shard differs from the reference: the reshard is wrong, not slow."""


@dataclass(frozen=True)
class Setup:
    ranks: int = 4
    tp: int = 4
    pp: int = 1
    gen_tp: int = 2
    hidden: int = 1024
    intermediate: int = 2048
    layers: int = 8
    heads: int = 16
    vocab: int = 32000
    tied: bool = True
    reps: int = 5
    bucket_mib: float = 8.0
    seed: int = 0

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)


# Table 2 ----------------------------------------------------------------------------------------
def table2(split_bytes: int, replicated_bytes: int, t: int, tg: int, d: int, p: int = 1,
           pg: int = 1) -> dict[str, float]:
    """Bytes each rank receives, and the reshard's extra memory, per Table 2 of HybridFlow with
    FSDP over d: the TP-split weights (`split_bytes`, Table 2's M) and the weights replicated
    over TP (`replicated_bytes`, sharded only by FSDP) counted apart."""
    m = split_bytes + replicated_bytes
    n = t * p * d
    # each rank holds 1/d of its stage's replicated weights, and generation needs 1/pg of all
    dp_part = replicated_bytes * (1 / pg - 1 / (p * d))
    return {
        "hybridflow": split_bytes * (1 / (tg * pg) - 1 / n) + dp_part,
        "hybridflow_v": split_bytes * (1 - 1 / n) + dp_part,  # dp gather, then the TP group's
        "dschat": m * (1 - 1 / n),
        "full_state_implied": split_bytes * (1 - 1 / n) + dp_part,
        "peak_hybridflow": split_bytes / (tg * pg) + (replicated_bytes / pg if d > 1 or p > pg else 0),
    }


# counted collectives ----------------------------------------------------------------------------
class Counter:
    """All-gathers that count what this rank receives, as the Resharder does."""

    def __init__(self) -> None:
        self.bytes_received = 0
        self.collectives = 0

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Any, size: int) -> None:
        from asyncrl.train.reshard import all_gather_single

        all_gather_single(out, inp, group=group)
        self.bytes_received += (size - 1) * inp.numel() * inp.element_size()
        self.collectives += 1

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=src, group=group)
        if dist.get_rank() != src:
            self.bytes_received += tensor.numel() * tensor.element_size()
        self.collectives += 1


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def _unshard_dp(local: torch.Tensor, rows: int, d: int, dp_group: Any, counter: Counter) -> torch.Tensor:
    """The training TP shard (`rows` rows) from this rank's FSDP dim-0 chunk: FSDP2's padded
    chunks all-gathered over dp."""
    if d == 1:
        return local
    chunk = math.ceil(rows / d)
    inp = local
    if local.shape[0] != chunk:  # trailing ranks hold short (or empty) chunks
        inp = torch.zeros(chunk, *local.shape[1:], dtype=local.dtype)
        inp[: local.shape[0]].copy_(local)
    out = torch.empty(d * chunk, *local.shape[1:], dtype=local.dtype)
    counter.all_gather(out, inp.contiguous(), dp_group, d)
    return out[:rows]


# the peers --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # None: replicated over TP
    stage: int = 0  # the pipeline stage that trains it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@torch.no_grad()
def hybridflow_v(model: torch.nn.Module, params: list[Param], t: int, tg: int, d: int, tp_coord: int,
                 tp_group: Any, dp_group: Any, counter: Counter) -> tuple[dict[str, torch.Tensor], int]:
    """Table 2's HybridFlow-V: gather every TP-split weight whole inside the training TP group
    (into one buffer the size of those weights), then copy out the generation shard at the naive
    generation TP coordinate (generation TP groups of consecutive ranks: `tp_coord % tg`).
    Returns the shards and the extra bytes held at the peak."""
    named = dict(model.named_parameters())
    split = [q for q in params if q.tp_dim is not None]
    full = torch.empty(sum(q.numel for q in split), dtype=torch.float32)
    stacked: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (t training shards, split dim)
    out: dict[str, torch.Tensor] = {}
    at = 0
    for q in params:
        local = _local(named[q.name])
        if q.tp_dim is None:  # the whole weight is the generation weight
            out[q.name] = _unshard_dp(local, q.shape[0], d, dp_group, counter)
            continue
        local_shape = list(q.shape)
        local_shape[q.tp_dim] //= t
        shard = _unshard_dp(local, local_shape[0], d, dp_group, counter).contiguous()
        slot = full[at: at + q.numel]  # gloo wants the output as t row blocks of the input's shape
        counter.all_gather(slot.view(t * shard.shape[0], *shard.shape[1:]), shard, tp_group, t)
        stacked[q.name] = (slot.view(t, *local_shape), q.tp_dim)
        at += q.numel
    g = tp_coord % tg
    per = t // tg
    gen_bytes = 0
    for name, (parts, dim) in stacked.items():
        out[name] = torch.cat(list(parts[g * per: (g + 1) * per]), dim=dim)
        gen_bytes += out[name].nbytes
    peak = full.nbytes + gen_bytes
    del full, stacked
    return out, peak


@torch.no_grad()
def hybridflow_v_stages(model: torch.nn.Module, params: list[Param], t: int, tg: int, d: int, stage: int,
                        tp_coord: int, tp_group: Any, dp_group: Any, pp_ranks: list[int], pp_group: Any,
                        counter: Counter) -> tuple[dict[str, torch.Tensor], int]:
    """HybridFlow-V over pipeline stages: this stage's weights gathered whole inside the training
    TP group (FSDP chunks over dp first) into its span of one model-sized buffer, then every
    stage's span broadcast across the pipeline (`pp_ranks`: the p ranks of this rank's dp and tp
    coordinates, stage order), then the generation shards copied out at the naive generation TP
    coordinate. `params` is the full model's, grouped by stage. Returns the shards and the extra
    bytes held at the peak."""
    named = dict(model.named_parameters())
    full = torch.empty(sum(q.numel for q in params), dtype=torch.float32)
    slots: dict[str, torch.Tensor] = {}
    spans: dict[int, list[int]] = {}  # stage -> [start, end) in `full`
    at = 0
    for q in params:
        slots[q.name] = full[at: at + q.numel]
        spans.setdefault(q.stage, [at, at])[1] = at + q.numel
        at += q.numel
    for q in params:
        if q.stage != stage:
            continue
        local = _local(named[q.name])
        if q.tp_dim is None:
            slots[q.name].copy_(_unshard_dp(local, q.shape[0], d, dp_group, counter).reshape(-1))
            continue
        local_shape = list(q.shape)
        local_shape[q.tp_dim] //= t
        shard = _unshard_dp(local, local_shape[0], d, dp_group, counter).contiguous()
        counter.all_gather(slots[q.name].view(t * shard.shape[0], *shard.shape[1:]), shard, tp_group, t)
    for s, (start, end) in sorted(spans.items()):
        counter.broadcast(full[start:end], pp_ranks[s], pp_group)
    g, per = tp_coord % tg, t // tg
    out: dict[str, torch.Tensor] = {}
    gen_bytes = 0
    for q in params:
        if q.tp_dim is None:  # the whole weight is the generation weight
            out[q.name] = slots[q.name].view(q.shape)
            continue
        local_shape = list(q.shape)
        local_shape[q.tp_dim] //= t
        parts = slots[q.name].view(t, *local_shape)  # the t training shards, stacked
        out[q.name] = torch.cat(list(parts[g * per: (g + 1) * per]), dim=q.tp_dim)
        gen_bytes += out[q.name].nbytes
    return out, full.nbytes + gen_bytes


def dschat_slices(full: dict[str, torch.Tensor], params: list[Param], world: int, rank: int,
                  bucket_numel: int) -> tuple[torch.Tensor, list[tuple[int, int]], int]:
    """This rank's 1/N of the flattened model, bucket by bucket (each bucket split evenly over
    the N ranks, as ZeRO-3 partitions a flattened group), the buckets (start, length) and the
    padded total. Built once, outside the timer."""
    total = sum(q.numel for q in params)
    padded = math.ceil(total / world) * world
    bucket = max(world, bucket_numel // world * world)
    buckets = [(s, min(bucket, padded - s)) for s in range(0, padded, bucket)]
    flat = torch.zeros(padded, dtype=torch.float32)
    at = 0
    for q in params:
        flat[at: at + q.numel].copy_(full[q.name].reshape(-1))
        at += q.numel
    mine = torch.cat([flat[s + rank * (n // world): s + (rank + 1) * (n // world)] for s, n in buckets])
    return mine, buckets, padded


@torch.no_grad()
def dschat(mine: torch.Tensor, buckets: list[tuple[int, int]], padded: int, params: list[Param],
           world: int, tg: int, rank: int, counter: Counter) -> tuple[dict[str, torch.Tensor], int]:
    """DeepSpeed-Chat's transition: all-gather the whole model over all N ranks, then copy out
    the generation shards (naive generation TP coordinate `rank % tg`). Returns the shards and
    the extra bytes held at the peak."""
    full = torch.empty(padded, dtype=mine.dtype)
    at = 0
    for start, n in buckets:
        counter.all_gather(full[start: start + n], mine[at: at + n // world], None, world)
        at += n // world
    out: dict[str, torch.Tensor] = {}
    at = 0
    for q in params:
        whole = full[at: at + q.numel].view(q.shape)
        piece = whole if q.tp_dim is None else whole.chunk(tg, dim=q.tp_dim)[rank % tg]
        out[q.name] = piece.clone(memory_format=torch.contiguous_format)
        at += q.numel
    peak = full.nbytes + sum(v.nbytes for v in out.values())
    del full
    return out, peak


# one rank ---------------------------------------------------------------------------------------
def build_model(s: Setup) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
        max_position_embeddings=256, tie_word_embeddings=s.tied,
    )
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(config).float()
    if s.pp > 1:  # pipeline stages cannot share the tied embedding/LM head
        from asyncrl.train.pipeline import untie_embeddings

        untie_embeddings(model)
    return model


def _check(method: str, shards: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
           params: list[Param], tg: int, coord: int, rank: int) -> None:
    for q in params:
        want = reference[q.name]
        if q.tp_dim is not None:
            want = want.chunk(tg, dim=q.tp_dim)[coord]
        got = shards.get(q.name)
        if got is None or got.shape != want.shape or not torch.equal(got, want):
            raise ReshardCheckError(
                f"rank {rank}: {method} generation shard of {q.name} differs from the reference "
                f"(full_tensor() chunk {coord} of {tg} along dim {q.tp_dim}); got shape "
                f"{None if got is None else tuple(got.shape)}, want {tuple(want.shape)}")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()` after a barrier, and the slowest rank's wall time for it."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return result, float(elapsed)


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _min_over_ranks(value: float) -> float:
    return -_max_over_ranks(-value)


def _rank_job(rank: int, s: Setup) -> dict[str, Any] | None:
    import torch.distributed as dist

    from asyncrl.rollout.tp import GenerationModel
    from asyncrl.single_controller.parallel import (
        GenerationParallelConfig,
        ParallelConfig,
        ParallelLayout,
        generation_layout,
    )
    from asyncrl.train.fsdp import FSDPEngine, apply_fsdp
    from asyncrl.train.parallelize import parallelize
    from asyncrl.train.pipeline import PipelineEngine, owner_stage
    from asyncrl.train.reshard import Resharder
    from asyncrl.train.tp import apply_tp, planned_shard_dim, tp_shard_dim

    dist.init_process_group("gloo", rank=rank, world_size=s.ranks)
    layout = ParallelLayout.from_config(ParallelConfig(pp=s.pp, tp=s.tp), s.ranks)
    gen = generation_layout(layout, GenerationParallelConfig(tp=s.gen_tp))
    t, tg, d = s.tp, s.gen_tp, s.dp
    stage = layout.coord(rank, "pp")
    if s.pp == 1:
        model = build_model(s)
        tp_group = None
        if t > 1:
            apply_tp(model, layout.submesh("tp"))
            tp_group = layout.submesh("tp").get_group()
        apply_fsdp(model, layout.submesh("dp"))
        params = [Param(n, tuple(p.shape), tp_shard_dim(p)) for n, p in model.named_parameters()]
        # untimed setup: the reference, DS-Chat's slices, the Resharder, the engine
        reference = {n: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach().clone()
                     for n, p in model.named_parameters()}
        resharder = Resharder(model, layout, gen)
        engine = FSDPEngine(model, layout, optim=None, device="cpu")
    else:  # this rank's stage; the reference is a plain full model from the same seed
        model, plain = parallelize(build_model(s), layout), build_model(s)
        tp_group = layout.submesh("tp").get_group() if t > 1 else None
        gen_tp_group = None
        for ranks in gen.groups(("tp",)):
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            gen_tp_group = g if rank in ranks else gen_tp_group
        generation = GenerationModel(plain.config, model, gen_tp_group)  # weightless full-model skeleton
        params = sorted((Param(n, tuple(p.shape), planned_shard_dim(n, plain, t),
                               owner_stage(n, s.layers, s.pp)) for n, p in plain.named_parameters()),
                        key=lambda q: q.stage)
        reference = {n: p.detach() for n, p in plain.named_parameters()}
        del plain
        resharder = Resharder(model, layout, gen, full_model=generation.model)
        engine = PipelineEngine(model, layout, optim=None, device="cpu")
        pp_ranks = next(r for r in layout.groups(("pp",)) if rank in r)
        pp_group = layout.submesh("pp").get_group()
    dp_group = layout.submesh("dp").get_group()
    bucket_numel = int(s.bucket_mib * (1 << 20)) // 4
    mine, buckets, padded = dschat_slices(reference, params, s.ranks, rank, bucket_numel)
    tp_coord = layout.coord(rank, "tp")

    counters = {m: Counter() for m in ("hybridflow_v", "dschat")}
    peaks: dict[str, int] = {}

    def run_v() -> dict[str, torch.Tensor]:
        counters["hybridflow_v"] = Counter()
        if s.pp > 1:
            out, peaks["hybridflow_v"] = hybridflow_v_stages(model, params, t, tg, d, stage, tp_coord, tp_group,
                                                             dp_group, pp_ranks, pp_group, counters["hybridflow_v"])
        else:
            out, peaks["hybridflow_v"] = hybridflow_v(model, params, t, tg, d, tp_coord, tp_group,
                                                      dp_group, counters["hybridflow_v"])
        return out

    def run_dschat() -> dict[str, torch.Tensor]:
        counters["dschat"] = Counter()
        out, peaks["dschat"] = dschat(mine, buckets, padded, params, s.ranks, tg, rank, counters["dschat"])
        return out

    runs: dict[str, Callable[[], Any]] = {"hybridflow": resharder.reshard, "hybridflow_v": run_v, "dschat": run_dschat,
            "full_state": lambda: engine.full_state_dict(rank0_only=False)}
    coords = {"hybridflow": gen.coord(rank, "tp"), "hybridflow_v": tp_coord % tg,
              "dschat": rank % tg, "full_state": None}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(1 + s.reps):
        for method in METHODS:
            shards, seconds = _timed(runs[method])
            if rep == 0:  # warmup: check, do not time
                if method == "full_state":
                    _check(method, shards, reference, [Param(q.name, q.shape, None) for q in params],
                           1, 0, rank)
                else:
                    _check(method, shards, reference, params, tg, coords[method], rank)
            else:
                times[method].append(seconds)
            del shards
            if method == "hybridflow":
                resharder.release()
        if rep == 0:
            del reference

    stats = resharder.stats
    split = sum(q.numel * 4 for q in params if q.tp_dim is not None)
    replicated = sum(q.numel * 4 for q in params if q.tp_dim is None)
    measured = {
        "bytes_per_rank": _max_over_ranks(stats.bytes_received),
        "bytes_per_rank_min": _min_over_ranks(stats.bytes_received),
        "expected_bytes": _max_over_ranks(resharder.expected_bytes_received()),
        "peak_extra_bytes": _max_over_ranks(stats.peak_extra_bytes),
        "buffer_bytes": _max_over_ranks(stats.buffer_bytes),
        "collectives_hybridflow": _max_over_ranks(stats.collectives),
        "bytes_per_rank_v": _max_over_ranks(counters["hybridflow_v"].bytes_received),
        "collectives_v": _max_over_ranks(counters["hybridflow_v"].collectives),
        "peak_extra_bytes_v": _max_over_ranks(peaks["hybridflow_v"]),
        "bytes_per_rank_dschat": _max_over_ranks(counters["dschat"].bytes_received),
        "collectives_dschat": _max_over_ranks(counters["dschat"].collectives),
        "peak_extra_bytes_dschat": _max_over_ranks(peaks["dschat"]),
    }
    staging = resharder.staging_bytes()
    per_rank = None
    if s.pp > 1:  # (stage, received, expected) of every rank: the stages receive unequal volumes
        mine_row = torch.tensor([stage, stats.bytes_received, resharder.expected_bytes_received()],
                                dtype=torch.int64)
        rows = [torch.empty(3, dtype=torch.int64) for _ in range(s.ranks)]
        dist.all_gather(rows, mine_row)
        per_rank = [tuple(int(x) for x in row) for row in rows]
    dist.barrier()
    if rank != 0:
        return None
    result = {"measured": measured, "times": times, "split_bytes": split, "replicated_bytes": replicated,
              "params": sum(q.numel for q in params),
              "params_split": sum(q.numel for q in params if q.tp_dim is not None),
              "staging_bytes": staging}
    if per_rank is not None:
        result["per_rank"] = per_rank
        result["stage_bytes"] = [sum(q.numel * 4 for q in params if q.stage == st) for st in range(s.pp)]
    return result


def _rank_main(rank: int, s: Setup, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(s.ranks))
    torch.set_num_threads(1)
    try:
        result = _rank_job(rank, s)
        if result is not None:
            torch.save(result, Path(out_dir) / "result.pt")
    except BaseException:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# driver -----------------------------------------------------------------------------------------
def run_ranks(s: Setup, timeout_s: float) -> dict[str, Any]:
    """Spawn the ranks, wait for them, and return rank 0's result; every process is reaped on
    return, and a failing rank stops the others (they would wait in a collective forever)."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="asyncrl-reshard-") as out_dir:
        port = free_port()
        # the ranks fork from one server that imported this module (and torch) once
        multiprocessing.set_forkserver_preload(["benchmarks.reshard"])
        codes = run_spawned(_rank_main, [(r, s, port, out_dir) for r in range(s.ranks)], timeout_s,
                            start_method="forkserver")
        errors = [f.read_text() for f in sorted(Path(out_dir).glob("error*.txt"))]
        if errors or any(codes):
            reasons = ", ".join(f"rank {r} {exit_reason(c)}" for r, c in enumerate(codes))
            raise SystemExit(f"reshard benchmark failed ({reasons}; killed ranks were stopped "
                             f"because a peer failed or the run passed {timeout_s:.0f}s)\n"
                             + "\n".join(errors))
        result = torch.load(Path(out_dir) / "result.pt", weights_only=False)
    result["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def summarize(s: Setup, r: dict[str, Any]) -> dict[str, Any]:
    m, times = r["measured"], r["times"]
    split, replicated = r["split_bytes"], r["replicated_bytes"]
    formula = table2(split, replicated, s.tp, s.gen_tp, s.dp, p=s.pp)
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 4) if b else None

    def paired(peer: str) -> float:
        return round(statistics.median(p / h for p, h in zip(times[peer], times["hybridflow"], strict=True)), 4)

    out = {
        "benchmark": "reshard", "ranks": s.ranks, "p": s.pp, "t": s.tp, "d": s.dp, "pg": 1, "tg": s.gen_tp,
        "micro_dp": s.tp // s.gen_tp, "reps": s.reps, "cores": os.cpu_count(),
        "model": {"hidden": s.hidden, "intermediate": s.intermediate, "layers": s.layers,
                  "heads": s.heads, "vocab": s.vocab, "tied": s.tied, "dtype": "float32"},
        "params": r["params"], "params_split": r["params_split"],
        "M_bytes": split + replicated, "split_bytes": split, "replicated_bytes": replicated,
        "replicated_fraction": round(replicated / (split + replicated), 6),
        "bytes_per_rank": int(m["bytes_per_rank"]), "bytes_per_rank_min": int(m["bytes_per_rank_min"]),
        "expected_bytes": int(m["expected_bytes"]), "formula_bytes": round(formula["hybridflow"]),
        "bytes_ratio": ratio(m["bytes_per_rank"], formula["hybridflow"]),
        "peak_extra_bytes": int(m["peak_extra_bytes"]), "buffer_bytes": int(m["buffer_bytes"]),
        "staging_bytes": r["staging_bytes"],
        "peak_formula_bytes": round(formula["peak_hybridflow"]),
        "peak_ratio": ratio(m["peak_extra_bytes"], formula["peak_hybridflow"]),
        "collectives_hybridflow": int(m["collectives_hybridflow"]),
        "bytes_per_rank_v": int(m["bytes_per_rank_v"]), "formula_bytes_v": round(formula["hybridflow_v"]),
        "peak_extra_bytes_v": int(m["peak_extra_bytes_v"]), "collectives_v": int(m["collectives_v"]),
        "bytes_per_rank_dschat": int(m["bytes_per_rank_dschat"]),
        "formula_bytes_dschat": round(formula["dschat"]),
        "peak_extra_bytes_dschat": int(m["peak_extra_bytes_dschat"]),
        "collectives_dschat": int(m["collectives_dschat"]),
        "bytes_full_state_implied": round(formula["full_state_implied"]),
        "time_hybridflow_s": round(med["hybridflow"], 4),
        "time_hybridflow_v_s": round(med["hybridflow_v"], 4),
        "time_dschat_s": round(med["dschat"], 4),
        "time_full_state_s": round(med["full_state"], 4),
        "speedup_vs_v": ratio(med["hybridflow_v"], med["hybridflow"]),
        "speedup_vs_dschat": ratio(med["dschat"], med["hybridflow"]),
        "speedup_vs_full_state": ratio(med["full_state"], med["hybridflow"]),
        # the same ratios rep by rep (the methods run back to back in each rep), then the median:
        # steadier than the ratio of medians when other work shares the cores in bursts
        "speedup_vs_v_paired": paired("hybridflow_v"), "speedup_vs_dschat_paired": paired("dschat"),
        "speedup_vs_full_state_paired": paired("full_state"),
        "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "loadavg_1m": r["loadavg_1m"],  # before and after: other work on the machine skews times
        "correct": True,  # every method's shards matched the reference on the warmup (else no JSON)
    }
    if s.pp > 1:
        out["model"]["untied_for_pp"] = True  # pipeline stages cannot share the tied embedding/LM head
        out.update(pipeline_summary(s, r))
    return out


def pipeline_summary(s: Setup, r: dict[str, Any]) -> dict[str, Any]:
    """The stages' unequal shares (embedding on the first, LM head on the last) against Table 2's
    M/p each: the bytes each stage's ranks receive, expected and measured."""
    total = r["split_bytes"] + r["replicated_bytes"]
    imbalance = [round(b / (total / s.pp), 4) for b in r["stage_bytes"]]
    received = [max(b for st, b, _ in r["per_rank"] if st == stage) for stage in range(s.pp)]
    expected = [max(e for st, _, e in r["per_rank"] if st == stage) for stage in range(s.pp)]
    top = max(range(s.pp), key=lambda st: received[st])  # the stage whose rank sets bytes_per_rank
    return {"stage_bytes": r["stage_bytes"], "stage_imbalance": imbalance[top], "stage_of_max_bytes": top,
            "stage_imbalance_by_stage": imbalance, "bytes_per_stage": received,
            "expected_bytes_per_stage": expected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tp", type=int, default=4, help="training tensor parallel size t")
    parser.add_argument("--gen-tp", type=int, default=2, help="generation tensor parallel size tg")
    parser.add_argument("--pp", type=int, default=1,
                        help="training pipeline stages p (generation pg = 1); p > 1 unties the embeddings")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 2 × hidden")
    parser.add_argument("--layers", type=int, default=None, help="default: 8, rounded up to a multiple of pp")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--untied", action="store_true", help="separate embedding and LM head")
    parser.add_argument("--bucket-mib", type=float, default=8.0,
                        help="DS-Chat's gather output per collective")
    parser.add_argument("--timeout-s", type=float, default=1800)
    args = parser.parse_args()
    if args.pp < 1 or args.ranks % (args.tp * args.pp) or args.tp % args.gen_tp \
            or (args.gen_tp >= args.tp and args.pp == 1):
        parser.error(f"need pp·tp | ranks and gen-tp | tp with gen-tp < tp or pp > 1 (else nothing is "
                     f"resharded); got ranks={args.ranks} pp={args.pp} tp={args.tp} gen-tp={args.gen_tp}")
    layers = args.layers if args.layers is not None else -(-8 // args.pp) * args.pp
    if layers < args.pp:
        parser.error(f"--layers {layers} < --pp {args.pp}: every pipeline stage needs a decoder layer")
    tied = not args.untied
    if args.pp > 1 and tied:
        print("--pp > 1: untying the embedding and LM head (pipeline stages cannot share a weight)",
              file=sys.stderr)
        tied = False
    s = Setup(ranks=args.ranks, tp=args.tp, pp=args.pp, gen_tp=args.gen_tp, hidden=args.hidden,
              intermediate=args.intermediate or 2 * args.hidden, layers=layers, heads=args.heads,
              vocab=args.vocab, tied=tied, reps=args.reps, bucket_mib=args.bucket_mib)
    print(json.dumps({"setup": asdict(s)}), flush=True)
    print(json.dumps(summarize(s, run_ranks(s, args.timeout_s))))


if __name__ == "__main__":
    main()
