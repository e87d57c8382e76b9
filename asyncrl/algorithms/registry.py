"""`algorithm.name` -> its step and what it needs (see `asyncrl.config.ALGORITHMS`)."""

from __future__ import annotations

from asyncrl.algorithms.grpo import grpo_step, reinforce_pp_step, rloo_step
from asyncrl.algorithms.ppo import ppo_step, safe_rlhf_step
from asyncrl.algorithms.remax import remax_step
from asyncrl.algorithms.roles import Algorithm

ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(ppo_step, needs_critic=True),
    "grpo": Algorithm(grpo_step),
    "rloo": Algorithm(rloo_step),
    "reinforce_pp": Algorithm(reinforce_pp_step),
    "remax": Algorithm(remax_step),
    "safe_rlhf": Algorithm(safe_rlhf_step, needs_critic=True, needs_pretrain=True),
}
