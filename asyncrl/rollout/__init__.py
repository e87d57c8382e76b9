"""Rollout (generation) for RL post-training."""

from asyncrl.rollout.engine import RolloutEngine, SamplingParams, score

__all__ = ["RolloutEngine", "SamplingParams", "score"]
