"""Pure numerics of PPO-family algorithms: advantages, KL terms, losses, log-prob helpers.

Conventions: token-level tensors are [batch, response_len] with a float or bool `response_mask`
(1 for real response tokens, 0 for padding/observation tokens); sequence-level scores are
[batch]. Every function here is pure (no globals, no in-place changes to its inputs), so it can be
unit-tested against hand-computed values and called from any worker.

Conventions to know when comparing runs with other frameworks:
- `loss_agg_mode="seq-mean-token-sum-norm"` (Dr.GRPO) averages the per-sequence token sums
  (divided by the constant length normaliser) over the batch; implementations that *sum* them
  over the batch give a loss (and gradient) B times larger.
- A group of one sample (a prompt with rollout.n = 1, or the only survivor of a filter) gets
  advantage 0 under GRPO and RLOO: with no other sample there is no baseline to compare with.
- Scores sit on the last response token whose mask is 1 (`scores_to_tokens`), so masks with
  holes (tool output, multi-turn observations) keep them.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

import torch

from asyncrl.train.logits import entropy_from_logits as entropy_from_logits
from asyncrl.train.logits import logprobs_from_logits as logprobs_from_logits

Tensor = torch.Tensor

KLKind = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
KL_KINDS: tuple[str, ...] = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")

LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

GroupIds = Tensor | Sequence[Hashable]

# Guards for empty masks: a 0/1 mask sums to 0 or >= 1, so clamping at this is exact otherwise.
_TINY = 1e-8
_WHITEN_EPS = 1e-8


# --------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `x` where `mask` is set (masked entries may be inf/nan and are still ignored)."""
    m = mask.to(x.dtype)
    kept = torch.where(mask.bool(), x * m, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `x` over `mask`; an all-zero mask gives 0 rather than nan."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(_TINY)


def max_abs_diff(a: Tensor, b: Tensor, mask: Tensor) -> float:
    """The largest |a - b| over masked-in entries (0 for an empty mask): e.g. the trainer's and the
    rollout engine's log-probs of the same tokens."""
    diff = (a.float() - b.float()).abs()[mask.bool()]
    return float(diff.max()) if diff.numel() else 0.0


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over all masked-in entries (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        if count.item() < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 masked-in elements, got "
                f"{count.item():g}; check response_mask or pass unbiased=False"
            )
        var = var * count / (count - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True,
                  moments: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Normalise `x` to unit variance over `mask` (and zero mean if `shift_mean`); 0 off-mask.
    `moments`: the (mean, variance) to use instead of `x`'s own (e.g. a whole batch's)."""
    mean, var = moments if moments is not None else (masked_mean(x, mask), masked_var(x, mask))
    whitened = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------


def scores_to_tokens(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Sequence scores [B] placed on each response's last real token -> [B, T] (0 elsewhere): the
    last position whose mask is 1, so masks with holes (multi-turn, tool output) keep the score."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=-1).values.clamp(min=0)
    out[torch.arange(len(scores), device=last.device), last] = scores.float().to(out.device)
    return out * response_mask.float()


def response_span(batch: Mapping[str, Tensor]) -> Tensor:
    """Attended response columns per row [B]: the model's tokens and, in a multi-turn trajectory,
    the observations between its turns (what the length budget counts)."""
    width = batch["responses"].shape[1]
    if "attention_mask" in batch:
        return batch["attention_mask"][:, -width:].sum(-1) if width else batch["responses"].new_zeros(len(batch))
    return batch["response_mask"].sum(-1)


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment per response: 0 up to `max_tokens - buffer` tokens, then
    falling linearly to `-factor` at `max_tokens` (and below it for longer)."""
    excess = lengths.float() - (max_tokens - buffer)
    return (-excess / buffer * factor).clamp(max=0.0)


def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lam) advantages (whitened over the mask if `whiten`) and returns = raw adv + V."""
    mask = response_mask.to(values.dtype)
    keep = response_mask.bool()
    batch, length = values.shape
    next_value = values.new_zeros(batch)
    last_gae = values.new_zeros(batch)
    advantages_reversed = []
    for t in reversed(range(length)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # Masked-out tokens (padding after the end, or tool/observation tokens mid-response) are
        # skipped: the bootstrap value and running GAE pass through them unchanged, and
        # torch.where keeps even inf/nan garbage there from leaking into earlier tokens.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        last_gae = torch.where(keep[:, t], gae, last_gae)
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def group_index(group_ids: GroupIds, batch: int, device: torch.device) -> tuple[Tensor, int]:
    """Map group ids (LongTensor or hashables such as uid strings) to dense indices 0..G-1."""
    if isinstance(group_ids, Tensor):
        _, inverse = torch.unique(group_ids, return_inverse=True)
        index = inverse.to(device)
    else:
        dense: dict[Hashable, int] = {}
        index = torch.tensor(
            [dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long, device=device
        )
    if index.numel() != batch:
        raise ValueError(f"got {index.numel()} group ids for a batch of {batch} scores")
    return index, int(index.max().item()) + 1 if batch else 0


def _group_stats(scores: Tensor, group_ids: GroupIds) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample (group index, group size, group sum, unbiased group std), each [batch]."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be sequence-level [batch], got shape {tuple(scores.shape)}")
    index, num_groups = group_index(group_ids, scores.shape[0], scores.device)
    zeros = scores.new_zeros(num_groups)
    count = zeros.index_add(0, index, torch.ones_like(scores))[index]
    total = zeros.index_add(0, index, scores)[index]
    dev = scores - total / count
    sq = zeros.index_add(0, index, dev * dev)[index]
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return index, count, total, std


def _as_float(scores: Tensor) -> Tensor:
    return scores if scores.is_floating_point() else scores.float()


def grpo_advantage(
    scores: Tensor,
    group_ids: GroupIds,
    response_mask: Tensor,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    stats: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (score - group mean) / (group std + eps) on every response token.

    `norm_by_std=False` is Dr.GRPO (mean-centred only). Groups of size 1 get advantage 0: with
    no siblings there is no relative signal. `stats`: each sample's (group size, group sum,
    group std) when groups reach beyond these rows. Returns (advantages, returns), which are equal.
    """
    scores = _as_float(scores)
    count, total, std = stats if stats is not None else _group_stats(scores, group_ids)[1:]
    adv = scores - total / count
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


def rloo_advantage(
    scores: Tensor, group_ids: GroupIds, response_mask: Tensor, stats: tuple[Tensor, Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """RLOO advantage: score minus the mean of the other scores in its group (size-1 groups: 0);
    `stats` as for `grpo_advantage`."""
    scores = _as_float(scores)
    count, total, _ = stats if stats is not None else _group_stats(scores, group_ids)[1:]
    baseline = (total - scores) / (count - 1).clamp_min(1)
    adv = torch.where(count > 1, scores - baseline, torch.zeros_like(scores))
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


def split_flat_groups(group_ids: Sequence[Hashable], values: Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """DAPO's dynamic-sampling filter: the row indices of each group (groups in order of first
    appearance), split into groups whose values differ and flat groups whose values are all equal.

    A flat group's GRPO/RLOO advantages are all 0, so it adds no gradient. Non-finite values (a
    reward key a row lacks) are ignored; a group with fewer than two finite values is flat."""
    if len(group_ids) != len(values):
        raise ValueError(f"{len(group_ids)} group ids for {len(values)} values")
    rows: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(g, []).append(i)
    values = _as_float(values)
    varied, flat = [], []
    for idx in rows.values():
        v = values[idx]
        v = v[torch.isfinite(v)]
        (varied if len(v) > 1 and bool(v.max() > v.min()) else flat).append(idx)
    return varied, flat


def _reverse_cumsum(x: Tensor) -> Tensor:
    return x.flip(-1).cumsum(-1).flip(-1)


def remax_advantage(
    scores: Tensor, baseline_scores: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax: return-to-go minus the greedy rollout's score, per token; returns (adv, returns).

    `scores` is either sequence-level [batch] (the same return on every token) or token-level
    [batch, len] (undiscounted return-to-go); `baseline_scores` is [batch].
    """
    mask = response_mask.to(_as_float(baseline_scores).dtype)
    if scores.dim() == 1:
        returns = _as_float(scores).unsqueeze(-1) * mask
    else:
        returns = _reverse_cumsum(_as_float(scores) * mask)
    advantages = returns - _as_float(baseline_scores).unsqueeze(-1) * mask
    return advantages, returns


def reinforce_pp_advantage(
    token_rewards: Tensor, response_mask: Tensor, gamma: float, whiten: bool = True
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over these rows (`whiten=False`: the
    caller whitens over a larger batch); returns (adv, G)."""
    mask = response_mask.to(token_rewards.dtype)
    rewards = token_rewards * mask
    running = rewards.new_zeros(rewards.shape[0])
    returns_reversed = []
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns_reversed.append(running)
    returns = torch.stack(returns_reversed[::-1], dim=1)
    return (masked_whiten(returns, mask) if whiten else returns), returns


def distillation_advantage(student_logprob: Tensor, teacher_logprob: Tensor, response_mask: Tensor,
                           kl_coef: float = 1.0) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024; Qwen3; Thinking Machines 2025): each sampled
    token's advantage is kl_coef * (log pi_teacher - log pi_student), minus the per-token estimate
    of the reverse KL(student || teacher); undiscounted, not passed back to earlier tokens."""
    return kl_coef * (teacher_logprob - student_logprob).detach() * response_mask.to(student_logprob.dtype)


# --------------------------------------------------------------------------------------------
# KL penalty and controllers
# --------------------------------------------------------------------------------------------


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3)."""
    log_ratio = logprob - ref_logprob
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # k3 = r - log r - 1 with r = pi_ref / pi; clamps keep exp() and the estimate bounded.
        neg_log_ratio = (-log_ratio).clamp(-20.0, 20.0)
        kl = torch.exp(neg_log_ratio) - neg_log_ratio - 1
        return kl.clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")


def apply_kl_penalty(
    token_level_scores: Tensor,
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: KLKind = "kl",
) -> tuple[Tensor, Tensor]:
    """Rewards = scores - kl_coef * KL per token; also the batch mean of per-sequence mean KL."""
    kld = kl_penalty(logprob, ref_logprob, kind) * response_mask.to(logprob.dtype)
    token_rewards = token_level_scores - kl_coef * kld
    mean_kl = masked_mean(kld, response_mask, dim=-1).mean()
    return token_rewards, mean_kl


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: Tensor, mask: Tensor, mode: LossAggMode, norm_len: int | None = None
) -> Tensor:
    """Reduce a [batch, len] loss matrix to a scalar over `mask`.

    "token-mean": mean over all tokens; "seq-mean-token-sum": mean of per-sequence sums;
    "seq-mean-token-mean": mean of per-sequence means; "seq-mean-token-sum-norm" (Dr.GRPO):
    mean of per-sequence sums divided by `norm_len` (default mask.shape[-1]; keep it constant,
    e.g. the max response length, to match the paper).
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).mean()
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum-norm":
        length = mask.shape[-1] if norm_len is None else norm_len
        return (masked_sum(loss_mat, mask, dim=-1) / length).mean()
    raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def ppo_token_losses(
    old_logprob: Tensor, logprob: Tensor, advantages: Tensor, response_mask: Tensor,
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token dual-clip PPO losses [B, T] of ratio = exp(logprob - old_logprob), and the
    clip statistics over `response_mask`."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    approx_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).to(logprob.dtype), response_mask)

    # For A < 0 a huge ratio makes -A*ratio unbounded; the dual clip caps it at -A*c.
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    clipfrac_lower = masked_mean(
        ((clip_loss > dual_bound) & negative).to(logprob.dtype), response_mask
    )
    return losses, {"clipfrac": clipfrac.detach(), "approx_kl": approx_kl.detach(),
                    "clipfrac_lower": clipfrac_lower.detach()}


def ppo_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with dual-clip (Ye et al. 2020) bounding the loss at -A*c for A<0.

    Metrics: clipfrac (share of tokens where the ratio clip was active), approx_kl (mean of
    old - new log-prob, the k1 estimate), clipfrac_lower (share hitting the dual clip).
    """
    losses, metrics = ppo_token_losses(old_logprob, logprob, advantages, response_mask,
                                            clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return agg_loss(losses, response_mask, loss_agg_mode, norm_len), metrics


def behaviour_importance_weights(prox_logprob: Tensor, behav_logprob: Tensor, response_mask: Tensor,
                                 cap: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """w = pi_prox / pi_behav per token (detached), the tokens with w <= cap (a mask), and the
    mean weight and share of capped tokens over `response_mask`."""
    if cap <= 1.0:
        raise ValueError(f"the behaviour importance-weight cap must be > 1, got {cap}")
    log_w = (prox_logprob - behav_logprob).detach().clamp(-20.0, 20.0)
    w = torch.exp(log_w)
    capped = (w > cap) & response_mask.bool()
    return w, capped, {"behav_imp_weight": masked_mean(w, response_mask).detach(),
                       "behav_capped_frac": masked_mean(capped.to(w.dtype), response_mask).detach()}


def decoupled_ppo_loss(
    prox_logprob: Tensor,
    logprob: Tensor,
    behav_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    norm_len: int | None = None,
    imp_weight_cap: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, for samples from an older behaviour policy): the clip is taken
    around the proximal policy (the current one before this update) and the importance weight
    pi_prox / pi_behav (detached) corrects for the behaviour policy that sampled the tokens:

        loss_t = w_t * dualclip(pi_theta / pi_prox, A_t),   w_t = pi_prox / pi_behav

    Tokens whose weight exceeds `imp_weight_cap` are left out of the loss (masked, as AReaL
    does), so a few far-off-policy tokens cannot dominate. With pi_behav == pi_prox it is PPO.
    """
    w, capped, wm = behaviour_importance_weights(prox_logprob, behav_logprob, response_mask, imp_weight_cap)
    losses, metrics = ppo_token_losses(prox_logprob, logprob, advantages, response_mask,
                                            clip_ratio_low, clip_ratio_high, clip_ratio_c)
    keep = response_mask * (~capped).to(response_mask.dtype)
    return agg_loss(losses * w, keep, loss_agg_mode, norm_len), {**metrics, **wm}


def tis_ppo_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    behav_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    norm_len: int | None = None,
    imp_weight_cap: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO against the recomputed old policy with truncated importance sampling for the
    behaviour policy (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): each token's loss times min(pi_old / pi_behav, cap), detached."""
    w, _, wm = behaviour_importance_weights(old_logprob, behav_logprob, response_mask, imp_weight_cap)
    losses, metrics = ppo_token_losses(old_logprob, logprob, advantages, response_mask,
                                            clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return agg_loss(losses * w.clamp(max=imp_weight_cap), response_mask, loss_agg_mode, norm_len), {**metrics, **wm}


# Losses of 2025: GSPO, CISPO, Clip-Cov, KL-Cov ---------------------------------------------------
# Each returns per-token losses [B, T] and its metrics; the caller aggregates (`agg_loss`) over the
# response mask times any rollout-correction keep mask, and multiplies by correction weights first.


def gspo_token_losses(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, response_mask: Tensor,
                      clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one clipped ratio per sequence, the length-normalised
    s_i = exp(mean_t log(pi / pi_old)); each token carries s_i's value and 1/|y_i| of its gradient,
    so aggregate with "seq-mean-token-mean" to get the sequence-level objective."""
    mask = response_mask.to(logprob.dtype)
    log_ratio = logprob - old_logprob
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    log_s = (logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    return losses, {"clipfrac": masked_mean((clipped > unclipped).to(mask.dtype), mask).detach(),
                    "approx_kl": masked_mean(-log_ratio, mask).detach()}


def cispo_token_losses(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, response_mask: Tensor,
                       weight_low: float = 0.0, weight_high: float = 4.0) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(pi / pi_old, low, high)) * A * log pi, every token's
    gradient kept (the weight is clipped, not the update); bounds as absolute weights."""
    log_ratio = (logprob - old_logprob).detach().clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(weight_low, weight_high)
    clipped = (ratio < weight_low) | (ratio > weight_high)
    return -weight * advantages * logprob, {
        "clipfrac": masked_mean(clipped.to(logprob.dtype), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask)}


def token_covariance(advantages: Tensor, logprob: Tensor, response_mask: Tensor) -> Tensor:
    """(A - mean A) * (log pi - mean log pi) per token, centred over the masked tokens: the
    covariance terms that drive entropy change (Cui et al. 2025); -inf where masked out."""
    lp = logprob.detach()
    cov = (advantages - masked_mean(advantages, response_mask)) * (lp - masked_mean(lp, response_mask))
    return cov.masked_fill(~response_mask.bool(), float("-inf"))


def clip_cov_token_losses(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, response_mask: Tensor,
                          clip_low: float = 0.2, clip_high: float = 0.2, ratio: float = 2e-4,
                          cov_low: float = 1.0, cov_high: float = 5.0,
                          generator: torch.Generator | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO's clipped losses, and of the tokens PPO did not clip whose covariance lies in
    (cov_low, cov_high), a random `ratio` share (at least one) loses its gradient."""
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    r = torch.exp(log_ratio)
    unclipped = -advantages * r
    clipped = -advantages * r.clamp(1.0 - clip_low, 1.0 + clip_high)
    cov = token_covariance(advantages, logprob, response_mask)
    band = (cov > cov_low) & (cov < cov_high) & ~(clipped > unclipped)
    candidates = band.flatten().nonzero().squeeze(-1)
    n = max(int(ratio * float(response_mask.sum())), 1)
    pick = torch.randperm(candidates.numel(), generator=generator)[:n].to(candidates.device)
    detached = torch.zeros(band.numel(), dtype=torch.bool, device=band.device)
    detached[candidates[pick]] = True
    detached = detached.view_as(band)
    losses = torch.maximum(unclipped, clipped).masked_fill(detached, 0.0)
    return losses, {"clipfrac": masked_mean((clipped > unclipped).to(r.dtype), response_mask).detach(),
                    "cov_detached_frac": masked_mean(detached.to(r.dtype), response_mask),
                    "approx_kl": masked_mean(-log_ratio, response_mask).detach()}


def kl_cov_token_losses(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, response_mask: Tensor,
                        ratio: float = 2e-3, kl_coef: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped surrogate -A * pi / pi_old, plus kl_coef * |log(pi / pi_old)| on the
    `ratio` share (at least one) of tokens with the largest covariance."""
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    losses = -advantages * torch.exp(log_ratio)
    cov = token_covariance(advantages, logprob, response_mask).flatten()
    n = min(max(int(ratio * float(response_mask.sum())), 1), int(response_mask.sum()))
    top = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    top[cov.topk(n).indices] = True
    top = top.view_as(losses)
    losses = losses + kl_coef * log_ratio.abs() * top.to(losses.dtype)
    return losses, {"cov_penalised_frac": masked_mean(top.to(losses.dtype), response_mask),
                    "approx_kl": masked_mean(log_ratio.abs(), response_mask).detach()}


# Rollout correction: the engine that sampled is not the trainer ----------------------------------
# r = pi_trainer / pi_rollout per token (old log-probs against the engine's rollout log-probs).

def rollout_correction(old_logprob: Tensor, rollout_logprob: Tensor, response_mask: Tensor, mode: str,
                       level: str, low: float, high: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token weights (detached) and keep mask [B, T] correcting for the rollout engine's policy.

    tis: weight min(r, high) (truncated IS; Yao et al. 2025), kept all. mis: weight r where
    low <= r <= high, the rest masked out (masked IS). icepop: mis at token level (Ling team
    2025). geo_mask: no weight, sequences whose geometric-mean ratio exp(mean log r) leaves
    [low, high] masked out. At sequence level r is the product over the sequence's tokens.
    """
    mask = response_mask.bool()
    log_r = ((old_logprob - rollout_logprob).detach() * mask).clamp(-20.0, 20.0)
    if mode == "geo_mask" or level == "sequence":
        seq = masked_sum(log_r, mask, dim=-1)
        if mode == "geo_mask":
            seq = seq / mask.sum(-1).clamp(min=1)
        log_r = seq.clamp(-20.0, 20.0).unsqueeze(-1).expand_as(log_r)
    r = torch.exp(log_r)
    if mode == "tis":
        weight, keep = r.clamp(max=high), mask
    elif mode in ("mis", "icepop", "geo_mask"):
        inside = (r >= low) & (r <= high)
        weight, keep = (torch.ones_like(r) if mode == "geo_mask" else r), mask & inside
    else:
        raise ValueError(f"unknown rollout correction {mode!r}; expected tis, mis, icepop or geo_mask")
    weight = weight * keep
    rows = mask.any(-1)
    dropped = mask & ~keep
    return weight, keep, {
        "capped_frac": masked_mean((r > high).to(r.dtype), mask),
        "masked_token_frac": masked_mean(dropped.to(r.dtype), mask),
        "masked_seq_frac": (dropped.any(-1) & rows).float().sum() / rows.float().sum().clamp(min=1),
        "weight_mean": masked_mean(weight, mask)}


def mismatch_metrics(old_logprob: Tensor, rollout_logprob: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """How far the trainer's log-probs are from the rollout engine's on the sampled tokens:
    mean and max |delta|, k3 KL(rollout || trainer), and the perplexity ratio trainer / rollout."""
    mask = response_mask.bool()
    delta = (old_logprob - rollout_logprob).detach().clamp(-20.0, 20.0)
    absdiff = delta.abs().masked_fill(~mask, 0.0)
    return {"logprob_diff_mean": masked_mean(absdiff, mask),
            "logprob_diff_max": absdiff.max() if absdiff.numel() else absdiff.new_zeros(()),
            "k3_kl": masked_mean(torch.exp(delta) - 1.0 - delta, mask),
            "ppl_ratio": torch.exp(masked_mean(-delta, mask))}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float = 0.2,
    loss_agg_mode: LossAggMode = "token-mean",
) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2); and its clipfrac."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    losses_unclipped = (values - returns).square()
    losses_clipped = (clipped_values - returns).square()
    losses = torch.maximum(losses_unclipped, losses_clipped)
    loss = 0.5 * agg_loss(losses, response_mask, loss_agg_mode)
    clipfrac = masked_mean((losses_clipped > losses_unclipped).to(values.dtype), response_mask)
    return loss, clipfrac.detach()


def kl_loss(
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    kind: KLKind = "low_var_kl",
    loss_agg_mode: LossAggMode = "token-mean",
) -> Tensor:
    """GRPO-style KL(pi || pi_ref) term added to the policy loss (not folded into rewards)."""
    return agg_loss(kl_penalty(logprob, ref_logprob, kind), response_mask, loss_agg_mode)


# --------------------------------------------------------------------------------------------
# Logit helpers
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Safe-RLHF (Dai et al. 2023)
# --------------------------------------------------------------------------------------------


def safe_rlhf_advantage(reward_adv: Tensor, cost_adv: Tensor, lam: float | Tensor) -> Tensor:
    """Safe-RLHF combined advantage (A_r - lambda * A_c) / (1 + lambda)."""
    return (reward_adv - lam * cost_adv) / (1 + lam)


# mixture-of-experts routers -------------------------------------------------------------------
def load_balancing_loss(logits: Tensor, chosen: Tensor, mask: Tensor) -> Tensor:
    """Switch-Transformer load-balancing loss of one router over its masked-in tokens, 1.0 when
    balanced (Megatron's normalisation; Hugging Face's is k times it): E / (N k) Σ_e n_e · P̄_e,
    with n_e the tokens sent to expert e and P̄_e its mean routing probability.
    logits [N, E], chosen [N, k] expert indices, mask [N]."""
    n_experts, k = logits.shape[-1], chosen.shape[-1]
    keep = mask.bool()
    probs = torch.softmax(logits[keep].float(), dim=-1)
    counts = torch.zeros(n_experts, device=logits.device).index_add_(
        0, chosen[keep].reshape(-1).long(), torch.ones(chosen[keep].numel(), device=logits.device))
    tokens = max(int(keep.sum()), 1)
    return n_experts / (tokens * k) * (counts * probs.mean(0)).sum() if keep.any() else logits.new_zeros(())


def router_z_loss(logits: Tensor, mask: Tensor) -> Tensor:
    """ST-MoE's router z-loss: the mean squared log-partition of the router logits [N, E] over
    masked-in tokens (keeps the logits small, so the softmax stays stable in low precision)."""
    return masked_mean(torch.logsumexp(logits.float(), dim=-1) ** 2, mask)


def expert_load(chosen: Tensor, mask: Tensor, n_experts: int) -> Tensor:
    """Tokens routed to each expert, per layer: chosen [N, layers, k] → [layers, E]."""
    keep = chosen[mask.bool()].long()  # [n, layers, k]
    load = torch.zeros(chosen.shape[1], n_experts, device=chosen.device)
    return load.scatter_add_(1, keep.transpose(0, 1).reshape(chosen.shape[1], -1),
                             torch.ones(chosen.shape[1], keep.shape[0] * keep.shape[2], device=chosen.device))


def routing_agreement(a: Tensor, b: Tensor, mask: Tensor) -> float:
    """The share of top-k selections two routings [N, layers, k] have in common (as sets per token
    and layer) over masked-in tokens: 1.0 when they route alike."""
    keep = mask.bool()
    a, b = a[keep].long(), b[keep].long()
    if not a.numel():
        return 1.0
    shared = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum()
    return float(shared) / a.numel()
