"""The 3D-HybridEngine reshard (HybridFlow §5.3–5.4): training shards -> generation shards.

The actor trains with tensor parallelism t over its TP group and FSDP over d data-parallel
ranks; generation runs with tg-way tensor parallelism (`asyncrl.single_controller.parallel.generation_layout`).
A rank's generation shard of a TP-split weight is the concatenation, along the split dim, of
the t/tg training TP shards of its micro-DP group, each of which FSDP holds as d row chunks. So
one all-gather inside the group {micro-DP} × {dp} of a bucket of parameters gives every rank
exactly its generation shard, and each rank receives

    M/(tg·pg) - M/(t·p·d)   bytes  (Table 2's (t·p - tg·pg)/(tg·pg·t·p)·M when d = 1)

while holding at most M/(tg·pg) extra: the generation weights, plus one bucket in flight.
Where the layouts coincide (a group of one rank) the generation weights are the training
shards themselves, without a copy. Weights split along dim 0 with d = 1 are gathered straight
into the generation buffer; others go through a bucket and are copied into place.

The generation weights are in the compute dtype (`dtype`: bf16 when training bf16 over fp32
master weights): each rank casts its shard before the gather, so the bytes moved and held are
half the fp32 ones, and where the layouts coincide the cast is the only copy.

Expert-parallel generation (`keep_experts`, asyncrl.rollout.experts): FSDP2 shards a mixture's fused
experts [E, ...] by rows, so each dp rank's shard is a block of whole experts, which it keeps for
generation as trained (cast, never gathered); only the dense weights are gathered.

Switching back to training needs no communication: `release()` drops the generation buffer.
All methods are collectives over the whole training group, called in the same order.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from asyncrl.single_controller.parallel import MICRO_DP_DIMS, ParallelLayout
from asyncrl.train.common import EngineError, owner_stage
from asyncrl.train.experts import FUSED
from asyncrl.train.lora import is_lora_param
from asyncrl.train.tp import planned_shard_dim, tp_shard_dim
from transport import trace

log = logging.getLogger(__name__)
STAGING_FLOOR = 1 << 20  # bytes: below this, collectives' latency costs more than the staging copy

DEFAULT_BUCKET_BYTES = 8 << 20


@dataclass(frozen=True)
class ParamPlan:
    """Where one parameter's generation shard comes from."""

    name: str
    tp_dim: int | None  # training TP split dim (None: replicated over TP)
    local_shape: tuple[int, ...]  # its training TP shard (before FSDP)
    gen_shape: tuple[int, ...]  # its generation shard
    chunk_rows: int  # FSDP's dim-0 chunk, padded (rows of local_shape per dp rank)
    offset: int = -1  # elements into the generation buffer; -1: aliases the training shard
    direct: bool = False  # all-gathered straight into the generation buffer
    stage: int = 0  # the pipeline stage that trains it
    itemsize: int = 4
    expert_local: bool = False  # expert-parallel generation: this rank's FSDP block of experts, as trained

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * math.prod(self.local_shape[1:])

    @property
    def gen_numel(self) -> int:
        return math.prod(self.gen_shape)


@dataclass
class ReshardStats:
    """What the last reshard did on this rank, counted at the collective calls."""

    bytes_received: int = 0
    bytes_sent: int = 0
    collectives: int = 0
    buffer_bytes: int = 0  # the generation buffer
    peak_extra_bytes: int = 0  # generation buffer + largest bucket in flight
    seconds: float = 0.0
    by_group: dict[int, int] = field(default_factory=dict)  # group size -> bytes received


def _chunk_rows(rows: int, d: int) -> list[int]:
    """FSDP2's dim-0 split of `rows` over `d` ranks (torch.chunk sizes, trailing ranks may get 0)."""
    size = math.ceil(rows / d) if rows else 0
    return [max(0, min(size, rows - i * size)) for i in range(d)]


def _new_groups(groups: list[list[int]], rank: int) -> tuple[list[int], dist.ProcessGroup | None]:
    """Create every group of a partition (a collective) and return this rank's, its ranks in
    group-rank order (ascending: the order of an all-gather's output)."""
    mine: tuple[list[int], dist.ProcessGroup | None] = ([rank], None)
    for ranks in map(sorted, groups):
        pg = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (ranks, pg)
    return mine


def all_gather_single(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's `inp` into `out`, in rank order: torch 2.13's `all_gather_single`, which earlier
    torch (2.6-2.12, what CUDA builds of vLLM pin) has as `all_gather_into_tensor`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


class Resharder:
    """Builds generation shards of `model` (TP over the train layout's tp dim, FSDP over dp)
    for the generation layout `gen` (see `asyncrl.single_controller.parallel.generation_layout`)."""

    def __init__(self, model: nn.Module, train: ParallelLayout, gen: ParallelLayout, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, full_model: nn.Module | None = None,
                 dtype: torch.dtype | None = None, keep_experts: bool = False) -> None:
        self.p = train.size("pp")
        if self.p > 1 and gen.size("pp") > 1:
            raise EngineError("pipeline-parallel generation (rollout.parallel.pp > 1) is not implemented; "
                              "set rollout.parallel.pp=1 (generation gathers every stage)")
        if self.p > 1 and full_model is None:
            raise EngineError("the reshard of a pipeline stage needs the full model's parameter list: "
                              "pass full_model (e.g. the weightless generation model)")
        self.model = model
        self.train, self.gen = train, gen
        self.rank = dist.get_rank()
        self.bucket_bytes = bucket_bytes
        self.t, self.d = train.size("tp"), train.size("dp")
        self.tg = gen.size("tp")
        self.stage = train.coord(self.rank, "pp")
        # the gather group: this rank's micro-DP group within its stage × its dp replicas
        self.gather_ranks, self.gather_group = _new_groups(gen.groups(("micro_tp", "dp")), self.rank)
        self.dp_ranks, self.dp_group = _new_groups(train.groups(("dp",)), self.rank)
        # the stages' generation shards then travel inside the micro-DP group across stages
        self.stage_ranks, self.stage_group = _new_groups(gen.groups(("micro_pp",)), self.rank)
        self.micro_dp = len(gen.group_of(self.rank, MICRO_DP_DIMS))
        # the generation model's weights (LoRA adapters are merged by the caller: asyncrl.train.lora)
        self.params = {n: p for n, p in model.named_parameters() if not is_lora_param(n)}
        self.full_model = full_model
        stored = next(iter(self.params.values())).dtype
        self.dtype = dtype or stored  # the generation weights' (bf16 from fp32 masters: half the bytes moved)
        self.cast = self.dtype != stored
        self.plans, self.buffer_numel = self._plan(keep_experts)  # keep_experts: asyncrl.rollout.experts
        self.plans = self._bucket_small(self.plans)
        self.stage_spans = self._stage_spans()
        self.stats = ReshardStats()
        self._buffer: Tensor | None = None

    # planning ---------------------------------------------------------------------------------
    def _plan(self, keep_experts: bool) -> tuple[list[ParamPlan], int]:
        if self.p == 1:
            params = [(name, p, 0) for name, p in self.params.items()]
        else:  # every stage's weights, the stages' in order (each stage one contiguous span)

            config = self.full_model.config
            params = sorted(((name, p, owner_stage(name, config.num_hidden_layers, self.p))
                             for name, p in self.full_model.named_parameters()), key=lambda x: x[2])
        plans, offset = [], 0
        for name, p, stage in params:
            shape = tuple(p.shape)
            k = self._split_dim(name, p, stage)
            local = list(shape)
            gen_shape = list(shape)
            if k is not None:
                if shape[k] % self.t:
                    raise EngineError(f"{name}: dim {k} of size {shape[k]} does not divide by tp={self.t}")
                local[k] = shape[k] // self.t
                gen_shape[k] = shape[k] // self.tg
            chunk = math.ceil(local[0] / self.d) if local else 1
            group = len(self.gather_ranks if k is not None else self.dp_ranks)
            itemsize = self.dtype.itemsize
            if keep_experts and FUSED.match(name):  # each dp rank's block of whole experts, not gathered
                gen_shape[0] = self._expert_block(name, shape)
                kept = ParamPlan(name, k, tuple(local), tuple(gen_shape), chunk, itemsize=itemsize, expert_local=True)
                if self.cast:  # cast into the generation buffer
                    kept = replace(kept, offset=offset, stage=stage)
                    offset += math.prod(gen_shape)
                plans.append(kept)
                continue
            if group == 1 and self.p == 1 and not self.cast:  # the training shard is the generation shard
                plans.append(ParamPlan(name, k, tuple(local), tuple(gen_shape), chunk, itemsize=itemsize))
                continue
            direct = k in (0, None) and local[0] % self.d == 0 if local else False
            plans.append(ParamPlan(name, k, tuple(local), tuple(gen_shape), chunk, offset, direct, stage, itemsize))
            offset += math.prod(gen_shape)
        return plans, offset

    def _expert_block(self, name: str, shape: tuple[int, ...]) -> int:
        """The experts of `name` each dp rank holds, which generation keeps where they are."""
        if self.t > 1 or self.p > 1 or shape[0] % self.d:
            raise EngineError(f"{name}: expert-parallel generation keeps each of the {self.d} data-parallel ranks' "
                              f"experts where FSDP holds them, which needs tp=pp=1 and the {shape[0]} experts "
                              f"divisible by {self.d}; set rollout.parallel.ep=1")
        return shape[0] // self.d

    def _split_dim(self, name: str, param: Any, stage: int) -> int | None:
        """The TP split dim of a weight: read from its DTensor placement on this rank's stage,
        from the TP plan for the other stages' (which this rank never holds)."""
        if self.t == 1:
            return None
        planned = planned_shard_dim(name, self.full_model if self.full_model is not None else self.model, self.t)
        if stage == self.stage:
            held = tp_shard_dim(self.params[name])
            if held != planned:
                raise EngineError(f"{name}: trained split along dim {held}, but the TP plan says {planned}")
            return held
        return planned

    def _stage_spans(self) -> list[tuple[int, int]]:
        """Each stage's [start, end) in the generation buffer (elements)."""
        spans = []
        for stage in range(self.p):
            mine = [pl for pl in self.plans if pl.stage == stage and pl.offset >= 0]
            spans.append((mine[0].offset, mine[-1].offset + mine[-1].gen_numel) if mine else (0, 0))
        return spans

    def expected_bytes_received(self) -> int:
        """Table 2's volume for this rank: each gathered weight's generation shard minus the part
        this rank already holds, counted in the padded units the collectives move."""
        total = 0
        for plan in self.plans:
            if plan.offset < 0 or plan.stage != self.stage:
                continue
            total += (len(self._group_for(plan)[0]) - 1) * plan.chunk_numel * plan.itemsize
        for stage, (start, end) in enumerate(self.stage_spans):
            if stage != self.stage:  # the other stages' generation shards, from the stage group
                total += (end - start) * self.plans[0].itemsize
        return total

    def _dtype_size(self, plan: ParamPlan) -> int:
        return plan.itemsize

    # the reshard ------------------------------------------------------------------------------
    def _shard(self, name: str) -> Tensor:
        """This rank's training shard of `name`, as stored."""
        p = self.params[name]
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    def _local(self, name: str) -> Tensor:
        """This rank's training shard of `name` in the generation dtype (itself when they match)."""
        return self._shard(name).to(self.dtype)

    def _all_gather(self, out: Tensor, inp: Tensor, ranks: list[int], group: dist.ProcessGroup | None) -> None:
        with trace.span("all_gather weights", "collective", bytes=inp.numel() * inp.element_size()):
            all_gather_single(out, inp, group=group)
        self._count(inp, ranks)

    def _count(self, inp: Tensor, ranks: list[int]) -> None:
        moved = (len(ranks) - 1) * inp.numel() * inp.element_size()
        self.stats.bytes_received += moved
        self.stats.bytes_sent += moved
        self.stats.collectives += 1
        self.stats.by_group[len(ranks)] = self.stats.by_group.get(len(ranks), 0) + moved

    @torch.no_grad()
    def reshard(self) -> dict[str, Tensor]:
        """The generation shard of every parameter (views into one buffer, or the training shards
        themselves where the layouts coincide). A collective over the training group."""
        import time

        t0 = time.perf_counter()
        self.release()
        self.stats = ReshardStats()
        device = next(iter(self.params.values())).device
        buffer = torch.empty(self.buffer_numel, dtype=self.dtype, device=device)
        self._buffer = buffer
        self.stats.buffer_bytes = self.stats.peak_extra_bytes = buffer.numel() * buffer.element_size()
        out: dict[str, Tensor] = {}
        pending: list[ParamPlan] = []
        for plan in self.plans:
            if plan.offset < 0:
                out[plan.name] = self._local(plan.name)
                continue
            view = buffer[plan.offset: plan.offset + plan.gen_numel].view(plan.gen_shape)
            out[plan.name] = view
            if plan.stage != self.stage:
                continue  # another stage's: arrives below
            if len(self._group_for(plan)[0]) == 1:  # a pipeline stage's shard, already whole
                view.copy_(self._local(plan.name))
            elif plan.direct:
                self._gather_direct(plan, view)
            else:
                pending.append(plan)
        for tp_split in (True, False):  # TP-split weights gather over the micro-DP × dp group, the rest over dp
            todo = [p for p in pending if (p.tp_dim is not None) == tp_split]
            for bucket in self._buckets(todo):
                self._gather_bucket(bucket, out, tp_split)
        for stage, (start, end) in enumerate(self.stage_spans):
            if self.p > 1 and end > start:  # each stage's shards to the same generation-TP rank of the others
                span = buffer[start:end]
                dist.broadcast(span, src=self.stage_ranks[stage], group=self.stage_group)
                nbytes = span.numel() * span.element_size()
                if stage == self.stage:
                    self.stats.bytes_sent += (self.p - 1) * nbytes
                else:
                    self.stats.bytes_received += nbytes
                self.stats.collectives += 1
        self.stats.seconds = time.perf_counter() - t0
        return out

    def _bucket_small(self, plans: list[ParamPlan]) -> list[ParamPlan]:
        """Weights whose shard and gathered copy fit one bucket's staging go with the buckets
        instead of a collective each (norms, biases, a small model's every weight): the same
        bytes move in far fewer collectives, and the staging peak stays within its budget."""
        out = []
        for plan in plans:
            group = len(self._group_for(plan)[0])
            if plan.direct and plan.chunk_numel * plan.itemsize * (group + 1) <= self.staging_bytes():
                plan = replace(plan, direct=False)
            out.append(plan)
        return out

    def _buckets(self, plans: list[ParamPlan]) -> list[list[tuple[ParamPlan, int, int]]]:
        """Pieces (plan, first row, end row) of the padded training chunks, grouped so that one
        bucket's input plus gathered output stays within the staging budget: a large weight is
        split by rows, so the peak stays near the generation buffer's size."""
        group = len(self._group_for(plans[0])[0]) if plans else 1
        budget = max(1, self.staging_bytes() // (group + 1))  # input bytes per bucket
        buckets: list[list[tuple[ParamPlan, int, int]]] = [[]]
        room = budget
        for plan in plans:
            row_bytes = max(1, plan.chunk_numel // max(1, plan.chunk_rows)) * self._dtype_size(plan)
            row = 0
            while row < plan.chunk_rows:
                take = min(plan.chunk_rows - row, max(1, room // row_bytes))
                if take * row_bytes > room and buckets[-1]:
                    buckets.append([])
                    room = budget
                    continue
                buckets[-1].append((plan, row, row + take))
                room -= take * row_bytes
                row += take
                if room <= 0:
                    buckets.append([])
                    room = budget
        return [b for b in buckets if b]

    def staging_bytes(self) -> int:
        """The bucket budget (input + gathered output): `bucket_bytes`, and at most 1/32 of the
        generation buffer so the reshard's peak stays within ~3 % of it (at least STAGING_FLOOR:
        a small model's weights then gather in a few collectives, not one each)."""
        return min(self.bucket_bytes, max(STAGING_FLOOR, self.buffer_numel * self.dtype.itemsize // 32))

    def _gather_direct(self, plan: ParamPlan, view: Tensor) -> None:
        """A weight split evenly along dim 0: every member's shard is a row block of the
        generation shard, gathered in place (no staging)."""
        ranks, group = self._group_for(plan)
        layout = self.gen if plan.tp_dim is not None else self.train
        slots = [layout.coord(r, "micro_tp") * self.d + layout.coord(r, "dp") for r in ranks]
        local = self._local(plan.name).contiguous()
        if slots == sorted(slots):
            self._all_gather(view, local, ranks, group)
        else:  # group-rank order differs from generation order: gather into the row blocks
            blocks = view.chunk(len(ranks))
            dist.all_gather([blocks[i] for i in slots], local, group=group)
            self._count(local, ranks)

    def _group_for(self, plan: ParamPlan) -> tuple[list[int], dist.ProcessGroup | None]:
        """TP-split weights gather over the micro-DP × dp group, replicated ones over dp, kept
        experts over none."""
        if plan.expert_local:
            return [self.rank], None
        if plan.tp_dim is not None:
            return self.gather_ranks, self.gather_group
        return self.dp_ranks, self.dp_group

    def _gather_bucket(self, bucket: list[tuple[ParamPlan, int, int]], out: dict[str, Tensor], tp_split: bool) -> None:
        ranks, group = self._group_for(bucket[0][0])
        widths = [(b - a) * math.prod(plan.local_shape[1:]) for plan, a, b in bucket]
        numel = sum(widths)
        inp = torch.zeros(numel, dtype=self.dtype, device=self._shard(bucket[0][0].name).device)
        at = 0
        for (plan, a, b), width in zip(bucket, widths, strict=True):
            rows = self._shard(plan.name)[a:b].reshape(-1)  # FSDP's last chunks may be short: zero padded
            inp[at: at + rows.numel()].copy_(rows)
            at += width
        gathered = torch.empty(len(ranks) * numel, dtype=inp.dtype, device=inp.device)
        self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, self.stats.buffer_bytes
                                          + (inp.numel() + gathered.numel()) * inp.element_size())
        self._all_gather(gathered, inp, ranks, group)
        gathered = gathered.view(len(ranks), numel)
        layout = self.gen if tp_split else self.train
        at = 0
        for (plan, a, b), width in zip(bucket, widths, strict=True):
            rows = _chunk_rows(plan.local_shape[0], self.d)
            for member, rank in enumerate(ranks):
                c = layout.coords(rank)
                dst = out[plan.name]
                if plan.tp_dim is not None:  # this member's training TP shard inside the generation shard
                    size = plan.local_shape[plan.tp_dim]
                    dst = dst.narrow(plan.tp_dim, c["micro_tp"] * size, size)
                valid = min(b, rows[c["dp"]]) - a  # rows of this piece the member really holds
                if valid > 0:
                    piece = gathered[member, at: at + width].view(b - a, *plan.local_shape[1:])
                    dst.narrow(0, c["dp"] * plan.chunk_rows + a, valid).copy_(piece[:valid])
            at += width

    def release(self) -> None:
        """Drop the generation buffer (before training, or to free memory)."""
        self._buffer = None


__all__ = ["DEFAULT_BUCKET_BYTES", "ParamPlan", "ReshardStats", "Resharder"]
