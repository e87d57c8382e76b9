"""Training backends: the model, its optimizer and checkpoints, sharded across ranks."""

from asyncrl.train.engine import TrainEngine
from asyncrl.train.fsdp import (
    EngineError,
    FSDPEngine,
    OptimConfig,
    apply_fsdp,
    compute_dtype,
    init_distributed,
    lr_multiplier,
    mixed_precision_policy,
    rng_state,
    set_rng_state,
)
from asyncrl.train.parallelize import parallelize
from asyncrl.train.pipeline import PipelineEngine, split_stages, untie_embeddings
from asyncrl.train.tp import apply_tp, check_tp

__all__ = [
    "EngineError",
    "OptimConfig",
    "PipelineEngine",
    "FSDPEngine",
    "TrainEngine",
    "apply_fsdp",
    "apply_tp",
    "check_tp",
    "init_distributed",
    "lr_multiplier",
    "compute_dtype",
    "mixed_precision_policy",
    "parallelize",
    "rng_state",
    "set_rng_state",
    "split_stages",
    "untie_embeddings",
]
