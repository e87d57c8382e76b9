"""On-policy distillation: the student samples, a teacher scores each sampled token, and the
per-token reverse KL is the reward (`--config-name opd`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.algorithms import advantage
from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.roles import Roles, balance_tokens, timings, union_all
from asyncrl.metrics import mean_metrics
from asyncrl.single_controller.distbatch import DistBatch

if TYPE_CHECKING:  # the config imports the algorithms
    from asyncrl.config import RLConfig


async def opd_step(roles: Roles, cfg: RLConfig, ctl: Controllers, prompts: DistBatch) -> dict[str, float]:
    """Sample, score the task (logged; mixed in with teacher.task_reward_coef), the teacher's
    log-probs beside the student's, token advantages, update."""
    gen = roles.rollout.generate_sequences(prompts)
    reward = roles.reward.compute_reward(gen)
    teacher = roles.teacher.compute_teacher_log_prob(gen)
    old = roles.actor.compute_log_prob(gen) if cfg.actor.recompute_old_log_probs() else None
    batch = union_all(await gen, await reward, await teacher, *([await old] if old is not None else []))
    adv = roles.actor.apply(advantage.distill, batch, kl_coef=cfg.teacher.kl_coef,
                            task_coef=cfg.teacher.task_reward_coef, norm_by_std=cfg.algorithm.norm_adv_by_std)
    batch, adv = await balance_tokens(roles, batch, adv)
    actor = await roles.actor.update_actor(batch)
    return {**timings(batch), **adv.meta, **mean_metrics(actor)}
