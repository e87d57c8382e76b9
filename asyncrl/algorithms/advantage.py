"""Advantage estimation as a task that runs on a worker where the batch lives.

`compute_advantage(batch, cfg)` is called through `group.apply(...)`: the rank pulls the few
columns it needs, and the advantages stay in that worker's store; the driver gets refs plus a
few scalar metrics in `meta`.
"""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms import core
from asyncrl.batch import Batch


def compute_advantage(batch: Batch, cfg: dict[str, Any], baseline: Batch | None = None) -> Batch:
    """Token advantages and returns for `cfg["estimator"]`; KL-in-reward when `kl_coef` > 0.

    Estimators: gae (needs values), grpo, drgrpo, rloo, remax (needs `baseline` scores),
    reinforce_pp, and safe_rlhf (reward advantages by GAE, cost advantages whitened, combined
    with the Lagrange multiplier `lagrange`).
    """
    est = cfg["estimator"]
    mask = batch["response_mask"].float()
    scores = batch["scores"].float()
    token_rewards = batch["token_level_scores"].float() if "token_level_scores" in batch else core.scores_to_tokens(scores, mask)
    meta: dict[str, float] = {}
    kl_coef = float(cfg.get("kl_coef", 0.0))
    # the policy's log-probs: recomputed by the trainer, or the rollout's own when on-policy
    if "ref_log_prob" in batch:
        policy_logp = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
    if kl_coef > 0 and "ref_log_prob" in batch:
        token_rewards, kl = core.apply_kl_penalty(token_rewards, policy_logp, batch["ref_log_prob"],
                                                  mask, kl_coef, cfg.get("kl_penalty", "kl"))
        meta["critic/kl"] = float(kl)
    elif "ref_log_prob" in batch:
        meta["critic/kl"] = float(core.masked_mean(
            core.kl_penalty(policy_logp, batch["ref_log_prob"], "kl"), mask))
    gamma, lam = float(cfg.get("gamma", 1.0)), float(cfg.get("lam", 1.0))
    if est in ("grpo", "drgrpo", "rloo") and "uid" not in batch:
        raise ValueError(f"{est} groups samples by prompt: the batch needs a 'uid' column (the "
                         "prompt loader adds one)")
    uid = batch["uid"] if "uid" in batch else []
    seq_rewards = core.masked_sum(token_rewards, mask, dim=-1)  # KL-shaped outcome per sequence
    if est in ("gae", "safe_rlhf"):
        adv, ret = core.compute_gae(token_rewards, batch["values"].float(), mask, gamma, lam)
    elif est in ("grpo", "drgrpo"):
        adv, ret = core.grpo_advantage(seq_rewards, uid, mask,
                                       norm_by_std=est == "grpo" and cfg.get("norm_adv_by_std", True))
    elif est == "rloo":
        adv, ret = core.rloo_advantage(seq_rewards, uid, mask)
    elif est == "remax":
        if baseline is None:
            raise ValueError("remax needs the greedy baseline's scores (baseline=...)")
        base = baseline["scores"].float().repeat_interleave(len(batch) // len(baseline))
        adv, ret = core.remax_advantage(seq_rewards, base, mask)
        meta["critic/baseline_score"] = float(baseline["scores"].float().mean())
    elif est == "reinforce_pp":
        adv, ret = core.reinforce_pp_advantage(token_rewards, mask, gamma)
    else:
        raise ValueError(f"unknown advantage estimator {est!r}; use gae, grpo, drgrpo, rloo, remax, "
                         "reinforce_pp or safe_rlhf")
    if est == "safe_rlhf":
        costs = batch["token_level_costs"].float()
        cost_adv, _ = core.reinforce_pp_advantage(costs, mask, gamma)
        adv = core.safe_rlhf_advantage(adv, cost_adv, float(cfg.get("lagrange", 0.0)))
        meta["critic/cost_mean"] = float(batch["costs"].float().mean())
    lengths = mask.sum(-1)
    meta.update({
        "critic/score_mean": float(scores.mean()), "critic/score_max": float(scores.max()),
        "critic/score_min": float(scores.min()),
        "critic/advantage_mean": float(core.masked_mean(adv, mask)),
        "critic/return_mean": float(core.masked_mean(ret, mask)),
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/tokens": float(lengths.sum()),
    })
    return Batch({"advantages": adv * mask, "returns": ret * mask, "token_level_rewards": token_rewards},
                 meta=meta)
