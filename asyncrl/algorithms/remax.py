"""ReMax: REINFORCE with the greedy response's reward as each prompt's baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.algorithms import advantage
from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.roles import Roles, balance_tokens, timings, union_all, uses_ref
from asyncrl.metrics import mean_metrics
from asyncrl.single_controller.distbatch import DistBatch

if TYPE_CHECKING:  # the config imports the algorithms
    from asyncrl.config import RLConfig


async def remax_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    gen = roles.rollout.generate_sequences(prompts)
    greedy = roles.rollout.generate_sequences(prompts.with_meta(greedy=True, n=1))
    reward = roles.reward.compute_reward(gen)
    baseline = roles.reward.compute_reward(greedy)
    old = roles.actor.compute_log_prob(gen) if cfg.actor.recompute_old_log_probs() else None
    ref = roles.actor.compute_ref_log_prob(gen) if uses_ref(cfg) else None
    batch = union_all(await gen, await reward, *[await f for f in (old, ref) if f is not None])
    adv = roles.actor.apply(advantage.remax, batch, baseline=await baseline, kl_coef=ctl.kl_coef,
                            kl_penalty=cfg.algorithm.kl_penalty)
    batch, adv = await balance_tokens(roles, batch, adv)  # the update's ranks get near-equal tokens
    actor = await roles.actor.update_actor(batch)
    return {**timings(batch), **adv.meta, **mean_metrics(actor)}
