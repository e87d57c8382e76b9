"""The rollout engine's model: a Hugging Face causal LM whose weights are bound, as plain tensors,
from generation shards (`asyncrl.train.reshard.Resharder.reshard`), tensor parallel over a
generation TP group of `tg` ranks, or a mixture's experts split over an expert group
(`asyncrl.rollout.experts`).

The split is the training plan's (`asyncrl.train.tp`): q/k/v/gate/up hold a slice of the
heads / intermediate rows and need nothing; o/down hold a slice of their input columns, so their
partial outputs are all-reduced; the embedding and LM head, when split over the vocabulary,
look up only their own rows (all-reduced) and gather full-vocabulary logits. Plain tensors and
one collective per split layer keep the decode loop free of DTensor dispatch.

Between generations the model holds no weights (`unbind`): its parameters are meta tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.rollout.experts import ExpertParallelGeneration
from asyncrl.train.fsdp import find_blocks
from asyncrl.train.load import lm_class
from asyncrl.train.tp import COLWISE, ROWWISE, check_tp, shards_vocab


class GenerationModel:
    """A weightless copy of `config`'s architecture, tensor parallel over `group` (None: tg=1)."""

    def __init__(self, config, buffers_from: nn.Module | torch.device, group: dist.ProcessGroup | None = None, *,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        with torch.device("meta"):
            self.model = lm_class(config).from_config(config)
        self.model.requires_grad_(False)
        self.model.eval()
        self.group = group
        self.tp = dist.get_world_size(group) if group is not None else 1
        self.tp_rank = dist.get_rank(group) if group is not None else 0
        if isinstance(buffers_from, nn.Module):
            for name, buf in buffers_from.named_buffers():  # rotary tables etc.: not sharded, shared read-only
                owner, leaf = _owner(self.model, name)
                owner._buffers[leaf] = buf
        else:  # a training model of another layout (Megatron): the rotary tables made anew on that device
            _fresh_rotary(self.model, config, buffers_from)
        # names that alias one parameter (tied embeddings) bind to one tensor
        self._aliases: dict[str, list[str]] = {}
        first_of: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(first_of.setdefault(id(p), name), []).append(name)
        self._meta = {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}
        if self.tp > 1:
            check_tp(self.model, self.tp)
            self._split_layers()
        # a mixture's experts split over `expert_group` (rollout.parallel.ep), each rank binding its block
        self.experts = ExpertParallelGeneration(self.model, expert_group) if expert_group is not None else None
        self.bound = False

    # weights ----------------------------------------------------------------------------------
    def bind(self, shards: dict[str, Tensor]) -> None:
        """Use `shards` (name -> this rank's generation shard) as the model's weights, without a copy."""
        missing = sorted(set(self._aliases) - set(shards))
        if missing:
            raise KeyError(f"generation shards lack {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for name, names in self._aliases.items():
            param = nn.Parameter(shards[name], requires_grad=False)
            for alias in names:
                owner, leaf = _owner(self.model, alias)
                owner._parameters[leaf] = param
        self.bound = True

    def unbind(self) -> None:
        """Drop the weights (the model keeps meta placeholders)."""
        for name, names in self._aliases.items():
            shape, dtype = self._meta[name]
            param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
            for alias in names:
                owner, leaf = _owner(self.model, alias)
                owner._parameters[leaf] = param
        self.bound = False

    # tensor parallelism ---------------------------------------------------------------------------
    def _split_layers(self) -> None:
        for block in find_blocks(self.model):
            for name in ROWWISE:
                block.get_submodule(name).register_forward_hook(self._reduce_rowwise)
            for name in COLWISE:
                block.get_submodule(name)  # present (check_tp); a column slice needs no collective
        if shards_vocab(self.model, self.tp):
            embed = self.model.get_input_embeddings()
            embed.forward = self._vocab_parallel_embedding(embed)
            head = self.model.get_output_embeddings()
            if head is not None:
                head.register_forward_hook(self._gather_vocab)

    def _reduce_rowwise(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        dist.all_reduce(out, group=self.group)
        if getattr(module, "bias", None) is not None:  # every rank added the full bias
            out -= (self.tp - 1) * module.bias
        return out

    def _vocab_parallel_embedding(self, embed: nn.Module):
        def forward(ids: Tensor) -> Tensor:
            rows = embed.weight.shape[0]
            local = ids - self.tp_rank * rows
            outside = (local < 0) | (local >= rows)
            out = F.embedding(local.masked_fill(outside, 0), embed.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
            dist.all_reduce(out, group=self.group)
            return out
        return forward

    def _gather_vocab(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        parts = [torch.empty_like(out) for _ in range(self.tp)]
        dist.all_gather(parts, out.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _fresh_rotary(model: nn.Module, config, device: torch.device) -> None:
    """Each rotary embedding of `model` (built on meta) rebuilt on `device` with its tables."""
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            owner, leaf = _owner(model, name)
            with torch.device(device):
                setattr(owner, leaf, type(module)(config=config))


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


__all__ = ["GenerationModel"]
