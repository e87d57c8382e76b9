"""The 3D-HybridEngine reshard from Megatron's TP shards into the generation layout's HF-named
shards (pp = 1; see `asyncrl.train.reshard` for the FSDP2 one and the layouts).

A generation TP rank j of tg holds the HF slice that the t/tg consecutive Megatron TP shards of
its micro-DP group hold together (whole query groups, gate and up rows, o/down columns), so one
all-gather inside that group builds it: each rank receives M/tg - M/t bytes (Table 2 with p = pg
= 1, d = 1: Megatron's DP ranks hold whole TP shards). The vocabulary tensors are the exception
when the vocabulary was padded for tp or does not divide by tg: they are gathered over the whole
TP group and trimmed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.single_controller.parallel import ParallelLayout
from asyncrl.train.experts import fuse_experts, in_memory_names
from asyncrl.train.fsdp import EngineError
from asyncrl.train.megatron.convert import COPY, ROW, VOCAB, hf_tensors
from asyncrl.train.reshard import ReshardStats


@dataclass(frozen=True)
class HFPlan:
    """One generation tensor: its HF name and the dim generation TP splits it along (None: whole)."""

    name: str
    tp_dim: int | None


class MegatronResharder:
    """Generation shards (HF names, `dtype`) from a `MegatronEngine`'s TP shards."""

    def __init__(self, engine, gen: ParallelLayout, dtype: torch.dtype, keep_experts: bool = False) -> None:
        self.engine, self.dtype = engine, dtype
        self.keep_experts = keep_experts  # expert-parallel generation over the EP group: each rank its own experts
        self.tg = gen.size("tp")
        if engine.shape.experts and self.tg > 1:
            raise EngineError("a mixture-of-experts model generates at rollout.parallel.tp=1 for now (the "
                              "generation model keeps every expert whole); set rollout.parallel.tp=1")
        t = engine.tp
        self.span = t // self.tg  # training TP shards per generation shard
        first = engine.tp_rank // self.span * self.span
        base = dist.get_rank() - engine.tp_rank  # TP ranks are consecutive (TP innermost)
        self.micro_ranks = [base + first + i for i in range(self.span)]
        self.micro_group = None
        for start in range(0, dist.get_world_size(), self.span):  # every rank makes every group
            ranks = list(range(start, start + self.span))
            group = dist.new_group(ranks) if self.span > 1 else None
            if ranks == self.micro_ranks:
                self.micro_group = group
        self.gen_rank = engine.tp_rank // self.span
        vocab = engine.shape.vocab
        self.gen_splits_vocab = self.tg > 1 and vocab % self.tg == 0  # as GenerationModel splits it
        self.vocab_whole = engine.shape.padded_vocab(t) != vocab or vocab % self.tg != 0
        self.plans = [HFPlan(name, self._gen_dim(rule.kind)) for rule in engine.shape.rules() for name in rule.hf]
        if engine.shape.experts:  # tg = 1: every generation tensor whole, experts fused
            self.plans = [HFPlan(name, None) for name in in_memory_names([p.name for p in self.plans], engine.shape.names)]
        self.stats = ReshardStats()
        self._held: dict[str, Tensor] | None = None

    def _gen_dim(self, kind: str) -> int | None:
        if self.tg == 1 or kind == COPY or (kind == VOCAB and not self.gen_splits_vocab):
            return None
        return 1 if kind == ROW else 0

    def expected_bytes_received(self) -> int:
        """Table 2's volume: this stage's generation shard minus the part this rank holds, plus the
        other stages' generation shards."""
        size, total = self.dtype.itemsize, 0
        local = self.engine.local_tensors()
        for rule in self.engine.rules:
            if rule.kind != COPY:
                ranks = self.engine.tp if rule.kind == VOCAB and self.vocab_whole else self.span
                total += (ranks - 1) * local[rule.megatron].numel() * size
            if ".local_experts." in rule.megatron and not self.keep_experts:  # the other EP ranks' experts (tg = 1)
                total += (self.engine.experts.size - 1) * local[rule.megatron].numel() * self.engine.tp * size
        for stage in range(self.engine.pp):
            if stage != self.engine.pp_rank:
                total += sum(self._gen_numel(rule) for rule in self.engine.shape.rules(stage, self.engine.pp)) * size
        return total

    def _gen_numel(self, rule) -> int:
        numel = self.engine.shape.hf_numel(rule)
        return numel // self.tg if self._gen_dim(rule.kind) is not None else numel

    @torch.no_grad()
    def reshard(self) -> dict[str, Tensor]:
        """This rank's generation tensors by HF name (a collective over the TP and PP groups)."""
        t0 = time.perf_counter()
        self.stats = ReshardStats()
        out = self._stage_tensors()
        if self.engine.pp > 1:  # every stage's tensors to every stage (pg = 1)
            out = self._from_stages(out)
        self.stats.seconds = time.perf_counter() - t0
        self._held = out
        return out

    def _stage_tensors(self) -> dict[str, Tensor]:
        """This stage's generation tensors: experts fused as the generation model holds them."""
        local, out = self.engine.local_tensors(), {}
        shape, tp = self.engine.shape, self.engine.tp
        for i, rule in enumerate(self.engine.rules):
            shard = local[rule.megatron].detach().to(self.dtype)
            if rule.kind == COPY:
                out.update(hf_tensors(rule, [shard], shape, tp))
            elif rule.kind == VOCAB and self.vocab_whole:
                full = hf_tensors(rule, self._gather(shard, tp, self.engine.tp_group), shape, tp)
                out.update({k: v.chunk(self.tg)[self.gen_rank] if self.gen_splits_vocab else v for k, v in full.items()})
            else:
                parts = hf_tensors(rule, self._gather(shard, self.span, self.micro_group), shape, tp)
                out.update(parts if self.keep_experts else self.engine.gather_ep(i, parts, self.stats))
        if shape.experts:
            fuse_experts(out, None, shape.names)
        return out

    def _from_stages(self, mine: dict[str, Tensor]) -> dict[str, Tensor]:
        from asyncrl.train.pipeline import broadcast_value

        engine, out = self.engine, {}
        for stage in range(engine.pp):
            src = dist.get_global_rank(engine.pp_group, stage)
            got = broadcast_value({k: v.cpu() for k, v in mine.items()} if stage == engine.pp_rank else None,
                                  src, engine.pp_group, engine.device)
            if stage != engine.pp_rank:
                self.stats.bytes_received += sum(t.numel() * t.element_size() for t in got.values())
                self.stats.collectives += 1
                got = {k: v.to(engine.device) for k, v in got.items()}
            out.update(got)
        return out

    def _gather(self, shard: Tensor, ranks: int, group) -> list[Tensor]:
        if ranks == 1:
            return [shard]
        parts = [torch.empty_like(shard) for _ in range(ranks)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        moved = (ranks - 1) * shard.numel() * shard.element_size()
        self.stats.bytes_received += moved
        self.stats.bytes_sent += moved
        self.stats.collectives += 1
        self.stats.by_group[ranks] = self.stats.by_group.get(ranks, 0) + moved
        return parts

    def release(self) -> None:
        self._held = None
