"""Advantage estimators as tasks that run on a worker where the batch lives.

A step calls one by name through `group.apply`, with keyword arguments:

    adv = await roles.actor.apply(advantage.gae, batch, gamma=1.0, lam=0.95, kl_coef=ctl.kl_coef)

The rank pulls the few columns it needs; the advantages stay in that worker's store and the
driver gets refs plus a few scalar metrics in `meta`. Each estimator first folds the KL penalty
into the token rewards when `kl_coef` > 0 (PPO-style KL in the reward).
"""

from __future__ import annotations

from torch import Tensor

from asyncrl.algorithms import core
from asyncrl.rewards.rules import REWARD_EXTRA
from asyncrl.single_controller.batch import Batch


def gae(batch: Batch, *, gamma: float, lam: float, kl_coef: float = 0.0, kl_penalty: str = "kl") -> Batch:
    """PPO: generalised advantage estimation over the critic's `values`."""
    rewards, mask, meta = _token_rewards(batch, kl_coef, kl_penalty)
    adv, ret = core.compute_gae(rewards, batch["values"].float(), mask, gamma, lam)
    return _result(batch, adv, ret, rewards, meta)


def grpo(batch: Batch, *, norm_by_std: bool = True, kl_coef: float = 0.0, kl_penalty: str = "kl") -> Batch:
    """GRPO: each sample's outcome against its prompt group's mean (and std; Dr.GRPO: mean only)."""
    rewards, mask, meta = _token_rewards(batch, kl_coef, kl_penalty)
    adv, ret = core.grpo_advantage(core.masked_sum(rewards, mask, dim=-1), _groups(batch, "grpo"), mask,
                                   norm_by_std=norm_by_std)
    return _result(batch, adv, ret, rewards, meta)


def rloo(batch: Batch, *, kl_coef: float = 0.0, kl_penalty: str = "kl") -> Batch:
    """RLOO: each sample's outcome against the mean of the other samples of its prompt."""
    rewards, mask, meta = _token_rewards(batch, kl_coef, kl_penalty)
    adv, ret = core.rloo_advantage(core.masked_sum(rewards, mask, dim=-1), _groups(batch, "rloo"), mask)
    return _result(batch, adv, ret, rewards, meta)


def remax(batch: Batch, baseline: Batch, *, kl_coef: float = 0.0, kl_penalty: str = "kl") -> Batch:
    """ReMax: the outcome against the reward of the prompt's greedy response (`baseline` rows)."""
    rewards, mask, meta = _token_rewards(batch, kl_coef, kl_penalty)
    base = baseline["scores"].float().repeat_interleave(len(batch) // len(baseline))
    # per-token return-to-go: with KL in the reward each token gets the rewards after it, not the
    # whole sequence's (without KL the score sits on the last token and every token gets it)
    adv, ret = core.remax_advantage(rewards, base, mask)
    meta["critic/baseline_score"] = float(baseline["scores"].float().mean())
    return _result(batch, adv, ret, rewards, meta)


def reinforce_pp(batch: Batch, *, gamma: float, kl_coef: float = 0.0, kl_penalty: str = "kl") -> Batch:
    """REINFORCE++: discounted returns of the KL-shaped token rewards, whitened over the batch."""
    rewards, mask, meta = _token_rewards(batch, kl_coef, kl_penalty)
    adv, ret = core.reinforce_pp_advantage(rewards, mask, gamma)
    return _result(batch, adv, ret, rewards, meta)


def safe_rlhf(batch: Batch, *, gamma: float, lam: float, lagrange: float, kl_coef: float = 0.0,
              kl_penalty: str = "kl") -> Batch:
    """Safe-RLHF: reward advantages by GAE, cost advantages whitened, combined by the multiplier."""
    rewards, mask, meta = _token_rewards(batch, kl_coef, kl_penalty)
    reward_adv, ret = core.compute_gae(rewards, batch["values"].float(), mask, gamma, lam)
    cost_adv, _ = core.reinforce_pp_advantage(batch["token_level_costs"].float(), mask, gamma)
    adv = core.safe_rlhf_advantage(reward_adv, cost_adv, lagrange)
    meta["critic/cost_mean"] = float(batch["costs"].float().mean())
    return _result(batch, adv, ret, rewards, meta)


def _token_rewards(batch: Batch, kl_coef: float, kl_penalty: str) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The token rewards (score on the last token, minus kl_coef·KL when > 0) and the KL metric."""
    mask = batch["response_mask"].float()
    rewards = (batch["token_level_scores"].float() if "token_level_scores" in batch
               else core.scores_to_tokens(batch["scores"].float(), mask))
    meta: dict[str, float] = {}
    if "ref_log_prob" in batch:
        # the policy's log-probs: recomputed when off-policy, else the rollout's own
        policy = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
        if kl_coef > 0:
            rewards, kl = core.apply_kl_penalty(rewards, policy, batch["ref_log_prob"], mask, kl_coef, kl_penalty)
        else:
            kl = core.masked_mean(core.kl_penalty(policy, batch["ref_log_prob"], "kl"), mask)
        meta["critic/kl"] = float(kl)
    return rewards, mask, meta


def _groups(batch: Batch, estimator: str) -> list:
    if "uid" not in batch:
        raise ValueError(f"{estimator} groups samples by prompt: the batch needs a 'uid' column (the "
                         "prompt loader adds one)")
    return batch["uid"]


def _result(batch: Batch, adv: Tensor, ret: Tensor, rewards: Tensor, meta: dict[str, float]) -> Batch:
    mask = batch["response_mask"].float()
    scores, lengths = batch["scores"].float(), mask.sum(-1)
    meta.update({
        "critic/score_mean": float(scores.mean()), "critic/score_max": float(scores.max()),
        "critic/score_min": float(scores.min()),
        "critic/advantage_mean": float(core.masked_mean(adv, mask)),
        "critic/return_mean": float(core.masked_mean(ret, mask)),
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/tokens": float(lengths.sum()),
    })
    if "response_clipped" in batch:
        meta["response/clip_ratio"] = float(batch["response_clipped"].float().mean())
    for key in ("num_turns", "tool_calls", "tool_errors", "env_errors", "env_s",  # multi-turn trajectories
                "api_calls", "api_splits", "api_dropped_tokens", "api_truncated_tokens"):  # API-driven agents
        if key in batch:
            meta[f"agent/{key}_mean"] = float(batch[key].float().mean())
    for key in batch.keys():  # a dict-returning reward's extra numbers
        if key.startswith(REWARD_EXTRA):
            values = batch[key].float()
            seen = values[~values.isnan()]
            if len(seen):
                meta[f"reward/{key.removeprefix(REWARD_EXTRA)}"] = float(seen.mean())
    return Batch({"advantages": adv * mask, "returns": ret * mask, "token_level_rewards": rewards}, meta=meta)
