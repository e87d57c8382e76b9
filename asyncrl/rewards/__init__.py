"""Rule-based reward functions and loading of user reward functions."""

from asyncrl.rewards.rules import (
    RewardFn,
    RewardFnError,
    default_reward,
    exact_match,
    gsm8k,
    load_reward_fn,
    synthetic,
)

__all__ = [
    "RewardFn",
    "RewardFnError",
    "default_reward",
    "exact_match",
    "gsm8k",
    "load_reward_fn",
    "synthetic",
]
