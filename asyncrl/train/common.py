"""What the training modules share below the engines: the engine error, the model's
blocks, which pipeline stage holds what, and how a step's metrics are reduced."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded one: a DTensor's `full_tensor()` (a collective over
    its mesh: every rank calls it in step), any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a possibly sharded tensor: a DTensor's local shard, any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class EngineError(RuntimeError):
    """The training engine was used in a way it does not support; the message says how to fix it."""


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: `model.model.layers` for HF llama/qwen (a ModuleDict in a
    pipeline stage), else the largest ModuleList by parameter count."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def stage_layers(n_layers: int, pp_rank: int, pp_size: int) -> range:
    """The decoder layers of stage `pp_rank`: contiguous, sizes differing by at most one (the
    later stages get the extra layers, the first holds the embedding and the last the head)."""
    return range(n_layers * pp_rank // pp_size, n_layers * (pp_rank + 1) // pp_size)


def owner_stage(name: str, n_layers: int, pp_size: int) -> int:
    """The stage that holds parameter `name` of the full model (see `split_stages`)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer = int(parts[2])
        return next(s for s in range(pp_size) if layer in stage_layers(n_layers, s, pp_size))
    if parts[:2] == ["model", "embed_tokens"]:
        return 0
    return pp_size - 1  # the final norm and the LM head


def reduce_step_metrics(loss_sum: torch.Tensor, per_micro: dict[str, list[torch.Tensor]],
                        group: dist.ProcessGroup | None) -> dict[str, float]:
    """A step's logged numbers over its micro-batches and the dp ranks of `group`: the summed
    loss and each metric's mean averaged over ranks, except that a name ending in `_max` takes the
    largest value (two collectives at most)."""
    return start_step_metrics(loss_sum, per_micro, group)()


def start_step_metrics(loss_sum: torch.Tensor, per_micro: dict[str, list[torch.Tensor]],
                       group: dist.ProcessGroup | None) -> Callable[[], dict[str, float]]:
    """`reduce_step_metrics` with its collectives started now, in the background; the returned
    function waits for them and gives the numbers (the optimizer step can run in between)."""
    names = sorted(per_micro)
    means = [k for k in names if not k.endswith("_max")]
    maxes = [k for k in names if k.endswith("_max")]
    size = dist.get_world_size(group)
    packed = torch.stack([loss_sum.float()] + [torch.stack(per_micro[k]).mean() for k in means])
    works = [dist.all_reduce(packed, group=group, async_op=True)]
    top = torch.stack([torch.stack(per_micro[k]).max() for k in maxes]) if maxes else None
    if top is not None:
        works.append(dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group, async_op=True))

    def finish() -> dict[str, float]:
        for work in works:
            work.wait()
        out = dict(zip(["loss", *means], (packed / size).tolist(), strict=True))
        if top is not None:
            out.update(zip(maxes, top.tolist(), strict=True))
        return out
    return finish
