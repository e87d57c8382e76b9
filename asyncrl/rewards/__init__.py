"""Rule-based reward functions and loading of user reward functions."""

from asyncrl.rewards.rules import (
    NonFiniteRewardError,
    RewardFn,
    RewardFnError,
    checked_score,
    default_reward,
    exact_match,
    gsm8k,
    load_reward_fn,
    synthetic,
)

__all__ = [
    "RewardFn",
    "NonFiniteRewardError",
    "RewardFnError",
    "checked_score",
    "default_reward",
    "exact_match",
    "gsm8k",
    "load_reward_fn",
    "synthetic",
]
