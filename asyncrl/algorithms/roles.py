"""What an algorithm step works with: the worker groups of the run (`Roles`) and helpers over
the batches they return."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.single_controller.balance import balanced_shards, imbalance
from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.group import union_all  # noqa: F401 - the steps' join, re-exported
from asyncrl.single_controller.parallel import TRAIN

if TYPE_CHECKING:  # the config imports the algorithms
    from asyncrl.config import RLConfig

ROW_TOKENS = "row_tokens"  # each generated row's prompt + response tokens (generate_sequences)


@dataclass
class Roles:
    """The worker groups a step calls. `critic` and `cost` exist only for the algorithms that use them."""

    actor: Any  # ActorRolloutRefWorker group: compute_(ref_)log_prob, update_actor, apply
    rollout: Any  # generate_sequences: the actor group itself, or generation launched ahead (asyncrl.rollout.ahead)
    reward: Any  # compute_reward
    critic: Any | None = None  # compute_values, update_critic
    cost: Any | None = None  # a cost model's compute_reward (Safe-RLHF with cost_model.enable)
    teacher: Any | None = None  # on-policy distillation's compute_teacher_log_prob (teacher.path)


def uses_ref(cfg: RLConfig) -> bool:
    """Whether a step needs the reference policy's log-probs (KL in the loss or in the reward)."""
    algo = cfg.algorithm
    return cfg.actor.use_kl_loss or (algo.use_kl_in_reward and algo.kl_ctrl.kl_coef > 0)


def timings(batch: DistBatch) -> dict[str, float]:
    """The per-phase worker timings (`timing/*_s`) the producing calls left in the batch's meta,
    and the step's `perf/` numbers (`balance_tokens`)."""
    return {k: float(v) for k, v in batch.meta.items() if k.startswith(("timing/", "perf/"))}


async def balance_tokens(roles: Roles, batch: DistBatch | Awaitable[DistBatch],
                         adv: Awaitable[DistBatch]) -> tuple[DistBatch, DistBatch]:
    """`batch` (or its future) joined with `adv` (the advantages being computed) and its rows reordered so the
    actor's data-parallel ranks get near-equal tokens for the update (a few rows swapped
    between ranks, `balanced_shards`: the advantages are computed by then, so a prompt's
    samples need not stay together); and `adv`. Only the rows' token counts come to the
    driver, fetched while the advantages are computed. The meta carries
    `perf/dp_token_imbalance` (the largest rank's tokens over the mean) and
    `perf/dp_token_imbalance_unbalanced` (the arrival order's)."""
    batch = batch if isinstance(batch, DistBatch) else await batch  # its error is the step's (adv's follows from it)
    fetch = asyncio.ensure_future(_row_tokens(batch))
    try:
        adv = await adv
    except BaseException:
        fetch.cancel()
        raise
    joined, tokens = batch.union(adv), await fetch
    if tokens is None:
        return joined, adv
    shards = roles.actor.layouts[TRAIN].data_shards(("dp",)) if TRAIN in roles.actor.layouts else 1
    before = imbalance(_shard_loads(tokens, shards))
    if shards == 1 or len(tokens) % shards:  # the dispatch pads such a batch: left as it is
        return joined.with_meta(**{"perf/dp_token_imbalance": before, "perf/dp_token_imbalance_unbalanced": before}), adv
    order = balanced_shards(tokens, shards)
    after = imbalance(_shard_loads([tokens[i] for i in order], shards))
    meta = {"perf/dp_token_imbalance": after, "perf/dp_token_imbalance_unbalanced": before}
    return joined.take(order).with_meta(**meta), adv  # rows that stay keep their blocks


async def _row_tokens(batch: DistBatch) -> list[int] | None:
    """Each row's prompt + response tokens (None where the batch does not say)."""
    if ROW_TOKENS not in batch.columns or len(batch) == 0:
        return None
    return (await batch.select(ROW_TOKENS, meta=False).fetch())[ROW_TOKENS].tolist()


def _shard_loads(tokens: list[int], shards: int) -> list[float]:
    """The tokens each of `shards` consecutive equal chunks holds (as the dispatch splits)."""
    size = -(-len(tokens) // shards)
    return [float(sum(tokens[i:i + size])) for i in range(0, len(tokens), size)] or [0.0]

