"""Rule-based reward functions and loading of user reward functions."""

from asyncrl.rewards.reasoning_gym import reasoning_gym_score
from asyncrl.rewards.rules import (
    REWARD_EXTRA,
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
    "REWARD_EXTRA",
    "RewardFn",
    "NonFiniteRewardError",
    "RewardFnError",
    "checked_score",
    "default_reward",
    "exact_match",
    "gsm8k",
    "load_reward_fn",
    "reasoning_gym_score",
    "synthetic",
]
