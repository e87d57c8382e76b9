"""What an algorithm step works with: the worker groups of the run (`Roles`) and helpers over
the batches they return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.config import RLConfig
from asyncrl.single_controller.distbatch import DistBatch


@dataclass
class Roles:
    """The worker groups a step calls. `critic` and `cost` exist only for the algorithms that use them."""

    actor: Any  # ActorRolloutRefWorker group: compute_(ref_)log_prob, update_actor, apply
    rollout: Any  # generate_sequences: the actor group itself, or generation launched ahead (asyncrl.rollout.ahead)
    reward: Any  # compute_reward
    critic: Any | None = None  # compute_values, update_critic
    cost: Any | None = None  # a cost model's compute_reward (Safe-RLHF with cost_model.enable)


def uses_ref(cfg: RLConfig) -> bool:
    """Whether a step needs the reference policy's log-probs (KL in the loss or in the reward)."""
    algo = cfg.algorithm
    return cfg.actor.use_kl_loss or (algo.use_kl_in_reward and algo.kl_ctrl.kl_coef > 0)


def union_all(first: DistBatch, *rest: DistBatch) -> DistBatch:
    for other in rest:
        first = first.union(other)
    return first


def timings(batch: DistBatch) -> dict[str, float]:
    """The per-phase worker timings (`timing/*_s`) the producing calls left in the batch's meta."""
    return {k: float(v) for k, v in batch.meta.items() if k.startswith("timing/")}

