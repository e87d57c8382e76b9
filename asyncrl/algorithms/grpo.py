"""Critic-free outcome-reward algorithms: GRPO (and Dr.GRPO), RLOO, REINFORCE++.

Each step: sample n responses per prompt, score them, (if off-policy) recompute the policy's
log-probs, (if KL is used) the reference's, estimate advantages where the data lives, update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.algorithms import advantage, core
from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.roles import Roles, balance_tokens, timings, union_all, uses_ref
from asyncrl.metrics import mean_metrics
from asyncrl.rewards.rules import REWARD_EXTRA
from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.group import DataFuture
from transport.checks import ConfigError

if TYPE_CHECKING:  # the config imports the algorithms
    from asyncrl.config import RLConfig

log = logging.getLogger(__name__)


def _rollout(roles: Roles, cfg: RLConfig, prompts: DistBatch) -> DataFuture:
    """The step's samples with their rewards (and log-probs): a future the next calls take as it is."""
    gen = roles.rollout.generate_sequences(prompts)  # a future: the calls below wait on it, not the driver
    reward = roles.reward.compute_reward(gen)
    old = roles.actor.compute_log_prob(gen) if cfg.actor.recompute_old_log_probs() else None
    ref = roles.actor.compute_ref_log_prob(gen) if uses_ref(cfg) else None
    return union_all(gen, reward, *[f for f in (old, ref) if f is not None])


async def _grouped_rollout(roles: Roles, cfg: RLConfig, prompts: DistBatch, refill: Callable[[int], DistBatch] | None
                           ) -> tuple[DistBatch | DataFuture, dict[str, float]]:
    """The step's samples; with algorithm.filter_groups.enable, DAPO's dynamic sampling."""
    if refill is None or not cfg.algorithm.filter_groups.enable:
        return _rollout(roles, cfg, prompts), {}
    batch, meta = await dynamic_sample(roles, cfg, prompts, refill)
    old = roles.actor.compute_log_prob(batch) if cfg.actor.recompute_old_log_probs() else None
    ref = roles.actor.compute_ref_log_prob(batch) if uses_ref(cfg) else None
    return union_all(batch, *[await f for f in (old, ref) if f is not None]), meta


async def dynamic_sample(roles: Roles, cfg: RLConfig, prompts: DistBatch,
                         refill: Callable[[int], DistBatch]) -> tuple[DistBatch, dict[str, float]]:
    """DAPO's dynamic sampling: generate and score, keep the prompt groups whose metric varies,
    and sample `refill(k)` (the k-th extra prompt batch) until len(prompts) groups are kept or
    algorithm.filter_groups.max_num_gen_batches batches were generated; then fill the step with
    flat groups (advantage 0), so every step trains on the same number of samples.

    Only the metric column and the group ids come to the driver; the rows stay where they were
    generated and the step's batch is a plan over them."""
    fg = cfg.algorithm.filter_groups
    want = len(prompts)
    column = "scores" if fg.metric == "score" else REWARD_EXTRA + fg.metric
    varied: list[tuple[DistBatch, list[int]]] = []
    flat: list[tuple[DistBatch, list[int]]] = []
    spent: dict[str, float] = {}
    batches = 0
    while True:
        gen = roles.rollout.generate_sequences(prompts if batches == 0 else refill(batches))
        batch = (await gen).union(await roles.reward.compute_reward(gen))
        batch = batch.unpad() if batch.pad_size else batch
        batches += 1
        for k, v in timings(batch).items():
            spent[k] = spent.get(k, 0.0) + v
        if column not in batch:
            keys = sorted(["score"] + [c.removeprefix(REWARD_EXTRA) for c in batch.columns if c.startswith(REWARD_EXTRA)])
            raise ConfigError(f"algorithm.filter_groups.metric={fg.metric!r}: the reward gives no such value; "
                              f"it gives {keys}")
        few = await batch.select(column, "uid", meta=False).fetch()
        good, bad = core.split_flat_groups(few["uid"], few[column])
        varied += [(batch, rows) for rows in good]
        flat += [(batch, rows) for rows in bad]
        if len(varied) >= want or (fg.max_num_gen_batches and batches >= fg.max_num_gen_batches):
            break
        if batches % 10 == 0:  # with no cap a reward that never varies would sample forever
            log.warning("dynamic sampling: %d generation batches so far, %d of %d prompt groups vary "
                        "(algorithm.filter_groups.max_num_gen_batches=%d)", batches, len(varied), want,
                        fg.max_num_gen_batches)
    chosen = (varied + flat)[:want]
    parts: list[tuple[DistBatch, list[int]]] = []
    for b, rows in chosen:  # one take() per generated batch keeps the plan short
        if parts and parts[-1][0] is b:
            parts[-1][1].extend(rows)
        else:
            parts.append((b, list(rows)))
    out = DistBatch.concat([b.take(rows) for b, rows in parts]).with_meta(**spent)
    seen = len(varied) + len(flat)
    return out, {"dynamic/gen_batches": float(batches), "dynamic/varied_group_ratio": len(varied) / max(1, seen),
                 "dynamic/flat_groups": float(max(0, want - len(varied)))}


async def grpo_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch,
                    refill: Callable[[int], DistBatch] | None = None) -> dict[str, float]:
    """GRPO: group-normalised outcome; Dr.GRPO (algorithm.estimator=drgrpo) centres without the std."""
    batch, dynamic = await _grouped_rollout(roles, cfg, prompts, refill)
    norm = cfg.algorithm.estimator == "grpo" and cfg.algorithm.norm_adv_by_std
    adv = roles.actor.apply(advantage.grpo, batch, norm_by_std=norm, kl_coef=ctl.kl_coef,
                            kl_penalty=cfg.algorithm.kl_penalty)
    batch, adv = await balance_tokens(roles, batch, adv)  # the update's ranks get near-equal tokens
    actor = await roles.actor.update_actor(batch)
    return {**timings(batch), **dynamic, **adv.meta, **mean_metrics(actor)}


async def rloo_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch,
                    refill: Callable[[int], DistBatch] | None = None) -> dict[str, float]:
    """RLOO: leave-one-out baseline over each prompt's n samples."""
    batch, dynamic = await _grouped_rollout(roles, cfg, prompts, refill)
    adv = roles.actor.apply(advantage.rloo, batch, kl_coef=ctl.kl_coef, kl_penalty=cfg.algorithm.kl_penalty)
    batch, adv = await balance_tokens(roles, batch, adv)  # the update's ranks get near-equal tokens
    actor = await roles.actor.update_actor(batch)
    return {**timings(batch), **dynamic, **adv.meta, **mean_metrics(actor)}


async def reinforce_pp_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    """REINFORCE++: KL-shaped token rewards, discounted returns, batch-whitened."""
    batch = _rollout(roles, cfg, prompts)
    adv = roles.actor.apply(advantage.reinforce_pp, batch, gamma=cfg.algorithm.gamma,
                            kl_coef=ctl.kl_coef, kl_penalty=cfg.algorithm.kl_penalty)
    batch, adv = await balance_tokens(roles, batch, adv)  # the update's ranks get near-equal tokens
    actor = await roles.actor.update_actor(batch)
    return {**timings(batch), **adv.meta, **mean_metrics(actor)}
