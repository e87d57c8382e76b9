"""Training backends: the model, its optimizer and checkpoints, sharded across ranks."""

from asyncrl.engine.fsdp import (
    EngineError,
    OptimConfig,
    TrainEngine,
    apply_fsdp,
    init_distributed,
    lr_multiplier,
    mixed_precision_policy,
    rng_state,
    set_rng_state,
)

__all__ = [
    "EngineError",
    "OptimConfig",
    "TrainEngine",
    "apply_fsdp",
    "init_distributed",
    "lr_multiplier",
    "mixed_precision_policy",
    "rng_state",
    "set_rng_state",
]
