"""Apply a training layout's parallelism to a model, in torchtitan's order: tensor parallel over
the layout's tp dim (`apply_tp`), then FSDP2 over its dp dim (`apply_fsdp`).

    layout = ParallelLayout.from_config(cfg.parallel, world_size)
    engine = TrainEngine(parallelize(model, layout, mixed_precision_policy(device)), layout, optim=...)
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from asyncrl.engine.fsdp import EngineError, apply_fsdp
from asyncrl.engine.tp import apply_tp
from asyncrl.parallel import ParallelLayout


def parallelize(model: nn.Module, layout: ParallelLayout,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard `model` in place over `layout` (a collective over the layout's ranks): TP when
    layout.size("tp") > 1, then FSDP2 over the dp sub-mesh (always, even at dp=1)."""
    if layout.size("pp") > 1:
        raise EngineError(f"layout {layout.describe()}: pipeline parallelism is not implemented "
                          "for training; set parallel.pp=1 and split the model with parallel.tp "
                          "(and the ranks with parallel.dp) instead")
    if layout.size("tp") > 1:
        apply_tp(model, layout.submesh("tp"))
    return apply_fsdp(model, layout.submesh("dp"), mp_policy)


__all__ = ["parallelize"]
