"""Actor-critic algorithms: PPO (GAE over a learned critic) and Safe-RLHF (PPO with a cost
signal whose advantages are folded in by a Lagrange multiplier, plus an SFT term).

The step is the whole algorithm: generate, score, value, log-probs, advantages where the data
lives, then the critic and actor updates — issued together, awaited at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.algorithms import advantage
from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.roles import Roles, balance_tokens, timings, union_all, uses_ref
from asyncrl.metrics import mean_metrics
from asyncrl.single_controller.distbatch import DistBatch

if TYPE_CHECKING:  # the config imports the algorithms
    from asyncrl.config import RLConfig


async def ppo_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    """PPO with GAE (critic), KL penalty in the reward, clipped policy and value losses."""
    gen = roles.rollout.generate_sequences(prompts)
    values = roles.critic.compute_values(gen)
    reward = roles.reward.compute_reward(gen)
    old = roles.actor.compute_log_prob(gen)
    ref = roles.actor.compute_ref_log_prob(gen) if uses_ref(cfg) else None
    batch = union_all(await gen, await values, await reward, await old, *([await ref] if ref else []))
    algo = cfg.algorithm
    adv = roles.actor.apply(advantage.gae, batch, gamma=algo.gamma, lam=algo.lam, kl_coef=ctl.kl_coef,
                            kl_penalty=algo.kl_penalty)
    batch, adv = await balance_tokens(roles, batch, adv)  # the updates' ranks get near-equal tokens
    critic = roles.critic.update_critic(batch)
    actor = roles.actor.update_actor(batch)
    return {**timings(batch), **adv.meta, **mean_metrics(await critic), **mean_metrics(await actor)}


async def safe_rlhf_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch,
                         pretrain: DistBatch | None = None) -> dict[str, float]:
    """Safe-RLHF: reward (GAE critic) and cost advantages combined by the Lagrange multiplier
    (which the trainer moves after the step while the mean cost exceeds its limit)."""
    gen = roles.rollout.generate_sequences(prompts)
    values = roles.critic.compute_values(gen)
    reward = roles.reward.compute_reward(gen)
    cost = roles.cost.compute_reward(gen) if roles.cost is not None else None
    old = roles.actor.compute_log_prob(gen)
    ref = roles.actor.compute_ref_log_prob(gen) if uses_ref(cfg) else None
    batch = union_all(await gen, await values, await reward, await old,
                      *[await f for f in (cost, ref) if f is not None])
    algo = cfg.algorithm
    adv = roles.actor.apply(advantage.safe_rlhf, batch, gamma=algo.gamma, lam=algo.lam,
                            lagrange=ctl.lagrange.value, kl_coef=ctl.kl_coef, kl_penalty=algo.kl_penalty)
    batch, adv = await balance_tokens(roles, batch, adv)  # the updates' ranks get near-equal tokens
    critic = roles.critic.update_critic(batch)
    actor = roles.actor.update_actor(batch)
    sft = roles.actor.update_pretrain(pretrain) if pretrain is not None else None
    metrics = {**timings(batch), **adv.meta, **mean_metrics(await critic), **mean_metrics(await actor)}
    if sft is not None:
        metrics.update(mean_metrics(await sft))
    return metrics
