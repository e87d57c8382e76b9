"""Expert-parallel generation of a mixture of experts (`rollout.parallel.ep`): each of the ep
ranks of an expert group holds experts/ep whole experts of every MoE layer (rank r the r-th
block: the ones it trains where the layouts coincide) and decodes its own rows. At each MoE
layer the group's tokens (hidden states, chosen experts, gate weights) are all-gathered, every
rank applies its own experts to all of them (the others' as transformers' expert-parallel
sentinel, which costs no expert compute), and the partial outputs are summed back to the rank
that owns each token (a reduce-scatter on NCCL, an all-reduce elsewhere: gloo has no
reduce-scatter).

The ranks meet at every MoE layer, so they run the same number of forwards: a rank whose rows
are done answers the others' layers with no tokens (`drain`) until every rank is done; a
generation phase (one call of the worker's generate) ends with `drain` on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl.train.common import EngineError
from asyncrl.train.reshard import all_gather_single


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The fused expert modules (transformers 5's `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
    of every MoE layer, in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
            and isinstance(getattr(m, "gate_up_proj", None), Tensor) and isinstance(getattr(m, "down_proj", None), Tensor)]


@dataclass
class ExpertStats:
    """What the expert exchange moved on this rank since the last `reset`."""

    bytes_sent: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0


class ExpertParallelGeneration:
    """Splits `model`'s experts over `group` (the generation model binds each rank's block)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.modules = expert_modules(model)
        if not self.modules:
            raise EngineError(f"rollout.parallel.ep={self.size}: {type(model).__name__} has no fused expert "
                              "modules (a mixture of experts in transformers 5); set rollout.parallel.ep=1")
        experts = self.modules[0].num_experts
        if experts % self.size:
            raise EngineError(f"rollout.parallel.ep={self.size} must divide the model's {experts} experts "
                              "(each rank holds a whole block of them)")
        self.experts, self.local = experts, experts // self.size
        self.top_k = int(model.config.num_experts_per_tok)
        self.first = self.rank * self.local
        self.nccl = dist.get_backend(group) == "nccl"
        self.stats = ExpertStats()
        for module in self.modules:
            module.num_experts = self.local
            module._is_expert_parallel = True  # transformers' kernels then skip sentinel experts
            module.forward = self._forward_for(module)

    def expert_range(self) -> range:
        """The experts this rank holds (global indices)."""
        return range(self.first, self.first + self.local)

    # the exchange ---------------------------------------------------------------------------
    def _forward_for(self, module: nn.Module) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        def forward(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            counts, _ = self._meet(hidden.shape[0], done=False, device=hidden.device)
            return self._exchange(module, hidden, top_k_index, top_k_weights, counts)
        return forward

    def _meet(self, tokens: int, done: bool, device: torch.device) -> tuple[list[int], bool]:
        """Every rank's token count at this layer, and whether every rank is done."""
        mine = torch.tensor([tokens, int(done)], dtype=torch.int64, device=device)
        every = torch.empty(2 * self.size, dtype=torch.int64, device=device)
        all_gather_single(every, mine, group=self.group)
        pairs = every.view(self.size, 2).tolist()
        return [n for n, _ in pairs], all(d for _, d in pairs)

    def _exchange(self, module: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor, counts: list[int]) -> Tensor:
        """This rank's tokens' MoE output: the group's tokens through this rank's experts (the
        module's own forward, as transformers defines it), summed over the ranks."""
        width, n = max(counts), hidden.shape[0]
        if width == 0:
            return hidden.new_zeros(hidden.shape)
        every_h, every_i, every_w = self._gather_tokens(hidden, index, weights, width)
        local = every_i - self.first
        outside = (local < 0) | (local >= self.local)
        local = local.masked_fill(outside, self.local)  # the sentinel: no expert of this rank
        out = type(module).forward(module, every_h, local, every_w.masked_fill(outside, 0).to(every_h.dtype))
        mine = out.new_empty((width, *out.shape[1:]))
        if self.nccl:
            _reduce_scatter(mine, out, self.group)
        else:
            dist.all_reduce(out, group=self.group)
            mine = out[self.rank * width:(self.rank + 1) * width]
        self.stats.bytes_sent += out.numel() * out.element_size()
        return mine[:n]

    def _gather_tokens(self, hidden: Tensor, index: Tensor, weights: Tensor, width: int
                       ) -> tuple[Tensor, Tensor, Tensor]:
        """Every rank's hidden states, chosen experts and gate weights, `width` rows each: in one
        all-gather where the hidden dtype holds the expert indices exactly (fp32; bf16 up to 256
        experts, fp16 2048), else in three."""
        exact = {torch.float32: 1 << 24, torch.float16: 2048, torch.bfloat16: 256}.get(hidden.dtype, 0)
        k, h = index.shape[-1], hidden.shape[-1]
        if self.experts <= exact:
            packed = torch.cat([_pad(hidden, width, 0), _pad(weights.to(hidden.dtype), width, 0),
                                _pad(index.to(hidden.dtype), width, -1)], -1)
            every = self._gather(packed, width)
            return every[:, :h], every[:, h + k:].long(), every[:, h:h + k].float()
        return (self._gather(_pad(hidden, width, 0), width), self._gather(_pad(index.long(), width, -1), width),
                self._gather(_pad(weights.float(), width, 0), width))

    def _gather(self, t: Tensor, width: int) -> Tensor:
        out = t.new_empty((self.size * width, *t.shape[1:]))
        all_gather_single(out, t.contiguous(), group=self.group)
        self.stats.bytes_sent += t.numel() * t.element_size()
        return out

    # the end of a phase -----------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self) -> Iterator[ExpertStats]:
        """One generation phase on this rank (its stats reset), drained at its end, also when it
        raises (the others' layers then still get their answer)."""
        self.stats.reset()
        try:
            yield self.stats
        finally:
            self.drain()

    @torch.no_grad()
    def drain(self) -> int:
        """Answer the other ranks' MoE layers with no tokens until every rank is done (a
        collective: every rank calls it once at the end of each generation phase, its experts
        bound); returns how many of the others' forwards this rank served."""
        like = self.modules[0].gate_up_proj  # the generation weights' dtype and device
        hidden = like.new_zeros((0, like.shape[-1]))
        index = torch.zeros((0, self.top_k), dtype=torch.int64, device=like.device)
        weights = torch.zeros((0, self.top_k), dtype=torch.float32, device=like.device)
        served = 0
        while True:
            for i, module in enumerate(self.modules):
                counts, everyone = self._meet(0, done=True, device=like.device)
                if everyone:
                    return served
                served += i == 0
                self._exchange(module, hidden, index, weights, counts)


def _reduce_scatter(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    """torch 2.13's `reduce_scatter_single`, `reduce_scatter_tensor` in earlier torch."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, inp, group=group)


def _pad(t: Tensor, width: int, value: float) -> Tensor:
    """`t` with rows appended up to `width`, filled with `value`."""
    if t.shape[0] == width:
        return t
    return torch.cat([t, t.new_full((width - t.shape[0], *t.shape[1:]), value)])


__all__ = ["ExpertParallelGeneration", "ExpertStats", "expert_modules"]
