"""Critic-free outcome-reward algorithms: GRPO (and Dr.GRPO), RLOO, REINFORCE++.

Each step: sample n responses per prompt, score them, (if off-policy) recompute the policy's
log-probs, (if KL is used) the reference's, estimate advantages where the data lives, update.
"""

from __future__ import annotations

from asyncrl.algorithms import advantage
from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.roles import Roles, timings, union_all, uses_ref
from asyncrl.config import RLConfig
from asyncrl.distbatch import DistBatch
from asyncrl.metrics import mean_metrics


async def _rollout(roles: Roles, cfg: RLConfig, prompts: DistBatch) -> DistBatch:
    gen = roles.actor.generate_sequences(prompts)  # a future: the calls below wait on it, not the driver
    reward = roles.reward.compute_reward(gen)
    old = roles.actor.compute_log_prob(gen) if cfg.actor.recompute_old_log_probs() else None
    ref = roles.actor.compute_ref_log_prob(gen) if uses_ref(cfg) else None
    return union_all(await gen, await reward, *[await f for f in (old, ref) if f is not None])


async def grpo_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    """GRPO: group-normalised outcome; Dr.GRPO (algorithm.estimator=drgrpo) centres without the std."""
    batch = await _rollout(roles, cfg, prompts)
    norm = cfg.algorithm.estimator == "grpo" and cfg.algorithm.norm_adv_by_std
    adv = await roles.actor.apply(advantage.grpo, batch, norm_by_std=norm, kl_coef=ctl.kl_coef,
                                  kl_penalty=cfg.algorithm.kl_penalty)
    actor = await roles.actor.update_actor(batch.union(adv))
    return {**timings(batch), **adv.meta, **mean_metrics(actor)}


async def rloo_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    """RLOO: leave-one-out baseline over each prompt's n samples."""
    batch = await _rollout(roles, cfg, prompts)
    adv = await roles.actor.apply(advantage.rloo, batch, kl_coef=ctl.kl_coef, kl_penalty=cfg.algorithm.kl_penalty)
    actor = await roles.actor.update_actor(batch.union(adv))
    return {**timings(batch), **adv.meta, **mean_metrics(actor)}


async def reinforce_pp_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    """REINFORCE++: KL-shaped token rewards, discounted returns, batch-whitened."""
    batch = await _rollout(roles, cfg, prompts)
    adv = await roles.actor.apply(advantage.reinforce_pp, batch, gamma=cfg.algorithm.gamma,
                                  kl_coef=ctl.kl_coef, kl_penalty=cfg.algorithm.kl_penalty)
    actor = await roles.actor.update_actor(batch.union(adv))
    return {**timings(batch), **adv.meta, **mean_metrics(actor)}
