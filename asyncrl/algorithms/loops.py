"""One training step per algorithm, as `async def`s on the programming model.

Each step gets the trainer `t` (its worker groups: `t.actor`, `t.reward`, optionally `t.critic`
and `t.cost`; its config; its KL / Lagrange controllers) and a prompt batch of refs, and returns
metrics. Calls return futures at once: independent ones (reward, log-probs, values) are issued
together and run in call order on the colocated workers, or concurrently on separate pools.
Only refs and scalar metrics reach the driver.
"""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms.advantage import compute_advantage
from asyncrl.distbatch import DistBatch
from asyncrl.workers.common import mean_metrics


def union_all(first: DistBatch, *rest: DistBatch) -> DistBatch:
    for other in rest:
        first = first.union(other)
    return first


async def ppo_step(t: Any, prompts: DistBatch) -> dict[str, float]:
    """PPO with GAE (critic), KL penalty in the reward, clipped policy and value losses."""
    gen = t.actor.generate_sequences(prompts)
    values = t.critic.compute_values(gen)
    reward = t.reward.compute_reward(gen)
    old = t.actor.compute_log_prob(gen)
    ref = t.actor.compute_ref_log_prob(gen) if t.use_ref else None
    parts = [await gen, await values, await reward, await old] + ([await ref] if ref else [])
    batch = union_all(*parts)
    adv = await t.actor.apply(compute_advantage, batch, t.adv_cfg("gae"))
    batch = batch.union(adv)
    critic = t.critic.update_critic(batch)
    actor = t.actor.update_actor(batch)
    return {**adv.meta, **mean_metrics(await critic), **mean_metrics(await actor)}


async def _outcome_step(t: Any, prompts: DistBatch, estimator: str) -> dict[str, float]:
    """Critic-free outcome-reward step shared by GRPO, Dr.GRPO, RLOO and REINFORCE++."""
    gen = t.actor.generate_sequences(prompts)
    reward = t.reward.compute_reward(gen)
    old = t.actor.compute_log_prob(gen) if t.recompute_old else None  # skipped when on-policy
    ref = t.actor.compute_ref_log_prob(gen) if t.use_ref else None
    batch = union_all(await gen, await reward, *[await f for f in (old, ref) if f is not None])
    adv = await t.actor.apply(compute_advantage, batch, t.adv_cfg(estimator))
    actor = await t.actor.update_actor(batch.union(adv))
    return {**adv.meta, **mean_metrics(actor)}


async def grpo_step(t: Any, prompts: DistBatch) -> dict[str, float]:
    """GRPO: n samples per prompt, group-normalised scores; Dr.GRPO with algorithm.estimator=drgrpo."""
    return await _outcome_step(t, prompts, t.cfg["algorithm"].get("estimator", "grpo"))


async def rloo_step(t: Any, prompts: DistBatch) -> dict[str, float]:
    """RLOO: leave-one-out baseline over each prompt's n samples."""
    return await _outcome_step(t, prompts, "rloo")


async def reinforce_pp_step(t: Any, prompts: DistBatch) -> dict[str, float]:
    """REINFORCE++: KL-shaped token rewards, discounted returns, batch-whitened."""
    return await _outcome_step(t, prompts, "reinforce_pp")


async def remax_step(t: Any, prompts: DistBatch) -> dict[str, float]:
    """ReMax: the greedy response's reward is each prompt's baseline."""
    greedy_prompts = prompts.with_meta(greedy=True, n=1)
    gen = t.actor.generate_sequences(prompts)
    greedy = t.actor.generate_sequences(greedy_prompts)
    reward = t.reward.compute_reward(gen)
    baseline = t.reward.compute_reward(greedy)
    old = t.actor.compute_log_prob(gen) if t.recompute_old else None
    ref = t.actor.compute_ref_log_prob(gen) if t.use_ref else None
    batch = union_all(await gen, await reward, *[await f for f in (old, ref) if f is not None])
    adv = await t.actor.apply(compute_advantage, batch, t.adv_cfg("remax"), baseline=await baseline)
    actor = await t.actor.update_actor(batch.union(adv))
    return {**adv.meta, **mean_metrics(actor)}


async def safe_rlhf_step(t: Any, prompts: DistBatch) -> dict[str, float]:
    """Safe-RLHF: reward (GAE critic) and cost advantages combined by a Lagrange multiplier that
    rises while the mean cost exceeds its limit; plus a pretrain (SFT) loss step."""
    gen = t.actor.generate_sequences(prompts)
    values = t.critic.compute_values(gen)
    reward = t.reward.compute_reward(gen)
    cost = t.cost.compute_reward(gen) if t.cost is not None else None
    old = t.actor.compute_log_prob(gen)
    ref = t.actor.compute_ref_log_prob(gen) if t.use_ref else None
    batch = union_all(await gen, await values, await reward, await old,
                      *[await f for f in (cost, ref) if f is not None])
    adv = await t.actor.apply(compute_advantage, batch, t.adv_cfg("safe_rlhf"))
    batch = batch.union(adv)
    critic = t.critic.update_critic(batch)
    actor = t.actor.update_actor(batch)
    pretrain = t.actor.update_pretrain(t.pretrain_batch()) if t.pretrain_coef > 0 else None
    metrics = {**adv.meta, **mean_metrics(await critic), **mean_metrics(await actor)}
    if pretrain is not None:
        metrics.update(mean_metrics(await pretrain))
    metrics["safe/lagrange"] = t.lagrange.update(metrics["critic/cost_mean"])
    return metrics


STEPS = {"ppo": ppo_step, "grpo": grpo_step, "rloo": rloo_step, "reinforce_pp": reinforce_pp_step,
         "remax": remax_step, "safe_rlhf": safe_rlhf_step}
NEEDS_CRITIC = {"ppo", "safe_rlhf"}
