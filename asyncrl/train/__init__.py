"""Training backends: the model, its optimizer and checkpoints, sharded across ranks.

The names below load their module on first use, so that importing a light module of this
package (`asyncrl.train.optim`, the config's `OptimConfig`) does not import FSDP2, DTensor and
pipelining."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "TrainEngine": "engine",
    "OptimConfig": "optim",
    "lr_multiplier": "optim",
    **dict.fromkeys(["EngineError", "FSDPEngine", "apply_fsdp", "compute_dtype", "init_distributed",
                     "mixed_precision_policy", "rng_state", "set_rng_state"], "fsdp"),
    "parallelize": "parallelize",
    **dict.fromkeys(["PipelineEngine", "split_stages", "untie_embeddings"], "pipeline"),
    **dict.fromkeys(["apply_tp", "check_tp"], "tp"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncrl.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"asyncrl.train.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
