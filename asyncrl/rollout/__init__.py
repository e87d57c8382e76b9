"""Rollout (generation) for RL post-training.

`RolloutEngine` and `score` load the engine's model code (transformers' caches and attention
registry) on first use: a module that needs only `asyncrl.rollout.params` does not pay for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncrl.rollout.params import SamplingParams

__all__ = ["RolloutEngine", "SamplingParams", "score"]


def __getattr__(name: str) -> Any:
    if name in ("RolloutEngine", "score"):
        return getattr(importlib.import_module("asyncrl.rollout.engine"), name)
    raise AttributeError(f"module 'asyncrl.rollout' has no attribute {name!r}")
