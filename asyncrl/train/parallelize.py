"""Apply a training layout's parallelism to a model, in torchtitan's order: the pipeline split
over the layout's pp dim (`split_stages`), tensor parallel over its tp dim (`apply_tp`), then
FSDP2 over its dp dim (`apply_fsdp`).

    layout = ParallelLayout.from_config(cfg.parallel, world_size)
    engine = FSDPEngine(parallelize(model, layout, mixed_precision_policy(device)), layout, optim=...)
    # pp > 1: PipelineEngine(parallelize(model, layout), layout, optim=...)
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from asyncrl.single_controller.parallel import ParallelLayout
from asyncrl.train.fsdp import apply_fsdp
from asyncrl.train.pipeline import split_stages
from asyncrl.train.tp import apply_tp


def parallelize(model: nn.Module, layout: ParallelLayout,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard `model` in place over `layout` (a collective over the layout's ranks): this rank's
    pipeline stage when layout.size("pp") > 1 (the returned module is then a `DecoderStage`),
    TP when layout.size("tp") > 1, then FSDP2 over the dp sub-mesh (always, even at dp=1)."""
    if layout.size("pp") > 1:
        model = split_stages(model, layout.coord(dist.get_rank(), "pp"), layout.size("pp"))
    if layout.size("tp") > 1:
        apply_tp(model, layout.submesh("tp"))
    return apply_fsdp(model, layout.submesh("dp"), mp_policy)


__all__ = ["parallelize"]
