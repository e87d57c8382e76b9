"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl runs it) over packed micro-batches.

`sp` neighbouring data-parallel ranks form a group. Each rank keeps its own rows (the dispatch,
FSDP and the losses are unchanged); the group takes turns: at each step one member (the owner)
shares its packed micro-batch's token ids, and every member runs the model over 1/sp of its
tokens (dealt round-robin, so each gets its share of the responses and of their logits). Around attention, an all-to-all turns [tokens/sp, heads] into [tokens, heads/sp] (each
rank attends whole rows for its share of the heads) and back; the log-probs (or values) each
rank computes for its slice are gathered back to the owner, whose loss is the only non-zero one.
So a micro-batch of T tokens costs T/sp activations per rank, the gradient is the sum of every
rank's share (FSDP's average over ranks is then the data-parallel one), and a row too long for
one rank's memory trains across sp of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl.single_controller.batch import Batch
from asyncrl.train.logits import LOGIT_CHUNK_TOKENS, keeps_logits, response_logprobs
from asyncrl.train.packing import pack, predicting_slots

LOGPROBS, VALUES = 0, 1  # what a step computes at its positions


class SequenceParallelError(ValueError):
    """A sequence-parallel size the model or layout cannot take."""


def check_sp(config: Any, sp: int, tp: int = 1) -> None:
    """Raise SequenceParallelError unless `sp` divides the attention heads each TP rank holds."""
    heads = config.num_attention_heads // tp
    if heads % sp:
        raise SequenceParallelError(
            f"sequence parallel size {sp} must divide the attention heads each rank holds "
            f"({config.num_attention_heads} heads / tp={tp} = {heads}); choose parallel.sp among "
            f"{[k for k in range(1, heads + 1) if heads % k == 0]}")


class _AllToAll(torch.autograd.Function):
    """Split `x` along `scatter` into `group`-size chunks, send chunk j to rank j, concatenate
    what arrives (in rank order) along `gather`; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad.contiguous(), ctx.group, ctx.gather, ctx.scatter), None, None, None


def _exchange(x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), gather)


class _GatherOwned(torch.autograd.Function):
    """Every rank's [channels, width] contribution, concatenated along the width on every rank;
    the backward sums the ranks' gradients and returns each rank its own columns."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None


@dataclass
class _Plan:
    """The owner's packed micro-batch as every member needs it (identical on every rank)."""

    ids: Tensor  # [T] token ids, padded to a multiple of sp
    positions: Tensor  # [T]
    cu: Tensor  # [segments + 1]
    max_len: int
    targets: Tensor  # [K] packed positions the owner wants outputs at (ascending)
    labels: Tensor  # [K] the tokens they predict (log-probs)
    keep: Tensor | None  # the owner's [B, R] response columns the targets fill (None on the others)
    kind: int
    temperature: float
    with_entropy: bool


class Ulysses:
    """This rank's sequence-parallel group and the turn it is at (`owner`)."""

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group, self.ranks = group, ranks
        self.size, self.rank = len(ranks), ranks.index(dist.get_rank())
        self.owner = self.rank

    # attention ------------------------------------------------------------------------------
    def scatter_heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[1, heads, tokens/sp, dim] -> [1, heads/sp, tokens, dim]; kv heads that do not divide
        by sp are repeated up to the query heads first (grouped-query attention)."""
        if k.shape[1] % self.size:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return tuple(self._natural(_AllToAll.apply(t, self.group, 1, 2)) for t in (q, k, v))

    def gather_heads(self, out: Tensor) -> Tensor:
        """[1, heads/sp, tokens, dim] -> [1, heads, tokens/sp, dim]."""
        return _AllToAll.apply(self._by_rank(out), self.group, 2, 1)

    # rank r holds tokens r, r + sp, r + 2 sp, ... (so that every rank gets its share of a row's
    # response, which sits at the row's end); the exchange delivers them rank after rank
    def _natural(self, x: Tensor) -> Tensor:
        """[1, h, tokens, d] rank after rank -> the tokens' own order."""
        h, t, d = x.shape[1:]
        return x.reshape(1, h, self.size, t // self.size, d).transpose(2, 3).reshape(1, h, t, d)

    def _by_rank(self, x: Tensor) -> Tensor:
        h, t, d = x.shape[1:]
        return x.reshape(1, h, t // self.size, self.size, d).transpose(2, 3).reshape(1, h, t, d)

    def attach(self, model: nn.Module) -> None:
        """Run `model`'s attention layers under this group (they read `sequence_parallel`)."""
        for module in model.modules():
            if hasattr(module, "num_key_value_groups"):
                module.sequence_parallel = self
        model.ulysses = self

    # one turn ---------------------------------------------------------------------------------
    def steps(self, micro_batches: list[Batch]) -> list[tuple[int, Batch | None]]:
        """The group's turns over every member's micro-batches (each member passes the same
        count): (owner, this rank's micro-batch when it owns the turn, else None)."""
        return [(o, mb if o == self.rank else None) for mb in micro_batches for o in range(self.size)]

    def forward(self, model: nn.Module, mb: Batch | None, kind: int = LOGPROBS, temperature: float = 1.0,
                with_entropy: bool = False) -> tuple[Tensor, Tensor | None] | Tensor:
        """Run the turn of `self.owner` (whose micro-batch is `mb`, None on the other members).
        The owner gets its [B, R] log-probs (and entropies) or values; the others a zero-valued
        scalar wired to their share of the graph (their loss for this turn)."""
        mine = self.owner == self.rank
        plan = self._share(mb if mine else None, kind, temperature, with_entropy)
        out = self._run(model, plan)  # [channels, K] on every rank
        if not mine:
            return out.sum() * 0.0
        grid = [out.new_zeros(plan.keep.shape).masked_scatter(plan.keep, row) for row in out]
        if kind == VALUES:
            return grid[0]
        return grid[0], (grid[1] if with_entropy else None)

    def _share(self, mb: Batch | None, kind: int, temperature: float, with_entropy: bool) -> _Plan:
        """The owner's plan, broadcast to the group (sizes first, then the tensors)."""
        src, dev = self.ranks[self.owner], self._device()
        if mb is not None:
            pk = pack(mb)
            slots = predicting_slots(pk, mb["responses"].shape[1])
            keep = slots >= 0
            pad = -pk.tokens % self.size  # the padding tokens are a row of their own
            ids = torch.nn.functional.pad(pk.pack(mb["input_ids"])[0], (0, pad))
            positions = torch.nn.functional.pad(pk.pack(mb["position_ids"])[0], (0, pad))
            cu = torch.cat([pk.cu, pk.cu[-1:] + pad]) if pad else pk.cu
            targets, labels = slots[keep], mb["responses"][keep]
            header = torch.tensor([len(ids), len(cu), len(targets), max(pk.max_len, pad), kind, with_entropy,
                                   temperature], dtype=torch.float64, device=dev)
        else:
            header = torch.zeros(7, dtype=torch.float64, device=dev)
        dist.broadcast(header, src, group=self.group)
        n_ids, n_cu, n_targets, max_len, kind, ent = (int(x) for x in header[:6].tolist())
        if mb is None:
            ids, positions = (torch.empty(n_ids, dtype=torch.long, device=dev) for _ in range(2))
            targets, labels = (torch.empty(n_targets, dtype=torch.long, device=dev) for _ in range(2))
            cu = torch.empty(n_cu, dtype=torch.int32, device=dev)
            keep = None
        for t in (ids, positions, cu, targets, labels):
            dist.broadcast(t, src, group=self.group)
        return _Plan(ids, positions, cu, max_len, targets, labels, keep, kind, float(header[6]), bool(ent))

    def _run(self, model: nn.Module, plan: _Plan) -> Tensor:
        """This rank's slice of the plan through `model`; the outputs at every target, gathered
        ([channels, K], in the owner's order)."""
        width, sp, me = len(plan.ids) // self.size, self.size, self.rank
        holder = plan.targets % sp  # the rank holding each target (tokens are dealt round-robin)
        counts = [int((holder == r).sum()) for r in range(sp)]
        mine = holder == me
        local = torch.cat([plan.targets[mine] // sp, plan.targets.new_tensor([width - 1])])  # + an anchor
        out = model(input_ids=plan.ids[me::sp][None], position_ids=plan.positions[me::sp][None], attention_mask=None,
                    cu_seq_lens_q=plan.cu, cu_seq_lens_k=plan.cu, max_length_q=plan.max_len,
                    max_length_k=plan.max_len, use_cache=False, **_keep(model, local))
        logits = out.logits if keeps_logits(model) else out.logits[:, local]
        anchor = logits[0, -1].float().sum() * 0.0  # ties every rank's whole slice to the gathered outputs
        logits = logits[:, :-1]
        if plan.kind == VALUES:
            rows = [logits[0, :, 0].float()]
        else:
            lp, ent = response_logprobs(logits, plan.labels[mine][None], plan.temperature, plan.with_entropy,
                                        chunk_tokens=max(1, LOGIT_CHUNK_TOKENS // sp))  # fp32 chunks shrink too
            rows = [lp[0]] + ([ent[0]] if plan.with_entropy else [])
        widest = max(1, *counts)
        mine_out = torch.stack([torch.nn.functional.pad(r, (0, widest - len(r))) for r in rows]) + anchor
        gathered = _GatherOwned.apply(mine_out, self.group)
        by_rank = torch.cat([gathered[:, r * widest:r * widest + counts[r]] for r in range(sp)], 1)
        order = torch.cat([(holder == r).nonzero()[:, 0] for r in range(sp)])  # by_rank's targets
        return by_rank[:, torch.argsort(order)]

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")


def _keep(model: nn.Module, local: Tensor) -> dict:
    return {"logits_to_keep": local} if keeps_logits(model) else {}


def ulysses_of(model: nn.Module) -> Ulysses | None:
    return getattr(model, "ulysses", None)


def run_turns(model: nn.Module, micro_batches: list[Batch], fn) -> list:
    """`fn(mb)` for each of this rank's micro-batches; under sequence parallelism in the
    group's turns (the other members' turns run their share of the owner's forward)."""
    sp = ulysses_of(model)
    if sp is None:
        return [fn(mb) for mb in micro_batches]
    outs = []
    for owner, mb in sp.steps(micro_batches):
        sp.owner = owner
        if mb is not None:
            outs.append(fn(mb))
        else:
            sp.forward(model, None)
    return outs


def turn_loss(model: nn.Module, micro_batches: list[Batch], loss_fn) -> tuple[list, Any]:
    """Micro-batches and a loss for `TrainEngine.train_step` that run the group's turns under
    sequence parallelism (a turn this rank does not own has a zero loss and no metrics)."""
    sp = ulysses_of(model)
    if sp is None:
        return micro_batches, loss_fn

    def turn(m: nn.Module, step: tuple[int, Batch | None]):
        sp.owner, mb = step
        if mb is None:
            return sp.forward(m, None), {}
        return loss_fn(m, mb)
    return sp.steps(micro_batches), turn


def sequence_parallel(layout: Any, sp: int, models: list[nn.Module], at: str) -> Ulysses:
    """Make this rank's sequence-parallel group over `layout`'s data-parallel ranks (a collective)
    and run `models` (set up for packing) under it."""
    from asyncrl.train.packing import is_packing

    for model in models:
        check_sp(model.config, sp, layout.size("tp"))
        if not is_packing(model):
            raise SequenceParallelError(f"{at}parallel.sp={sp} runs on packed rows, and this model is not set up "
                                        f"for packing; set {at}pack_sequences to null or true, or sp=1")
    group, ranks = sp_groups(layout.groups(("dp",)), sp)
    sp_group = Ulysses(group, ranks)
    for model in models:
        sp_group.attach(model)
    return sp_group


def sp_groups(dp_groups: list[list[int]], sp: int) -> tuple[Any, list[int]]:
    """Create every sequence-parallel group (a collective: `sp` consecutive ranks of each data
    parallel group) and return this rank's (group, ranks)."""
    me, mine = dist.get_rank(), None
    for ranks in dp_groups:
        if len(ranks) % sp:
            raise SequenceParallelError(f"parallel.sp={sp} must divide the data-parallel size {len(ranks)}")
        for i in range(0, len(ranks), sp):
            chunk = ranks[i:i + sp]
            group = dist.new_group(chunk)
            if me in chunk:
                mine = (group, chunk)
    return mine


__all__ = ["LOGPROBS", "VALUES", "SequenceParallelError", "Ulysses", "check_sp", "run_turns", "sequence_parallel", "sp_groups", "turn_loss",
           "ulysses_of"]
