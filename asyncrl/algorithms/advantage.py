"""Advantage estimators as tasks that run on the workers where the rows live.

A step calls one through `group.apply`, with keyword arguments:

    adv = await roles.actor.apply(advantage.gae, batch, gamma=1.0, lam=0.95, kl_coef=ctl.kl_coef)

Every rank estimates the rows its own store holds (`LOCAL_ROWS`); what needs more than its rows
— a batch's whitening moments, a prompt group that reaches onto another rank, the metrics — is
summed over the ranks as scalars (`peers`). The advantages stay in the workers' stores and the
driver gets refs plus a few scalar metrics in `meta`. Each estimator first folds the KL penalty
into the token rewards when `kl_coef` > 0 (PPO-style KL in the reward).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from asyncrl.agents.rollout import AGENT_INFO, API_METRICS, TRAJECTORY_METRICS
from asyncrl.algorithms import core
from asyncrl.rewards.rules import REWARD_EXTRA
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.peers import Peers

BUILT_IN_AGENT = (*(m for m in TRAJECTORY_METRICS if m != "env_reward"), *API_METRICS)
ONE = Peers([0], 0, 1)  # a call on one rank: nothing to sum with


def gae(batch: Batch, *, gamma: float, lam: float, kl_coef: float = 0.0, kl_penalty: str = "kl",
        peers: Peers = ONE) -> Batch:
    """PPO: generalised advantage estimation over the critic's `values`, whitened over the batch."""
    rewards, mask, stats = _token_rewards(batch, kl_coef, kl_penalty)
    adv, ret = core.compute_gae(rewards, batch["values"].float(), mask, gamma, lam, whiten=False)
    return _result(batch, _whiten(adv, mask, peers), ret, rewards, stats, peers)


def grpo(batch: Batch, *, norm_by_std: bool = True, kl_coef: float = 0.0, kl_penalty: str = "kl",
         peers: Peers = ONE) -> Batch:
    """GRPO: each sample's outcome against its prompt group's mean (and std; Dr.GRPO: mean only)."""
    rewards, mask, stats = _token_rewards(batch, kl_coef, kl_penalty)
    scores, uids = core.masked_sum(rewards, mask, dim=-1), _groups(batch, "grpo")
    adv, ret = core.grpo_advantage(scores, uids, mask, norm_by_std=norm_by_std, stats=_group_stats(scores, uids, peers))
    return _result(batch, adv, ret, rewards, stats, peers)


def rloo(batch: Batch, *, kl_coef: float = 0.0, kl_penalty: str = "kl", peers: Peers = ONE) -> Batch:
    """RLOO: each sample's outcome against the mean of the other samples of its prompt."""
    rewards, mask, stats = _token_rewards(batch, kl_coef, kl_penalty)
    scores, uids = core.masked_sum(rewards, mask, dim=-1), _groups(batch, "rloo")
    adv, ret = core.rloo_advantage(scores, uids, mask, stats=_group_stats(scores, uids, peers))
    return _result(batch, adv, ret, rewards, stats, peers)


def remax(batch: Batch, baseline: Batch, *, kl_coef: float = 0.0, kl_penalty: str = "kl",
          peers: Peers = ONE) -> Batch:
    """ReMax: the outcome against the reward of the prompt's greedy response (`baseline` rows)."""
    rewards, mask, stats = _token_rewards(batch, kl_coef, kl_penalty)
    base = baseline["scores"].float().repeat_interleave(len(batch) // max(1, len(baseline)))
    # per-token return-to-go: with KL in the reward each token gets the rewards after it, not the
    # whole sequence's (without KL the score sits on the last token and every token gets it)
    adv, ret = core.remax_advantage(rewards, base, mask)
    stats.mean("critic/baseline_score", baseline["scores"].float().sum(), len(baseline))
    return _result(batch, adv, ret, rewards, stats, peers)


def reinforce_pp(batch: Batch, *, gamma: float, kl_coef: float = 0.0, kl_penalty: str = "kl",
                 peers: Peers = ONE) -> Batch:
    """REINFORCE++: discounted returns of the KL-shaped token rewards, whitened over the batch."""
    rewards, mask, stats = _token_rewards(batch, kl_coef, kl_penalty)
    _, ret = core.reinforce_pp_advantage(rewards, mask, gamma, whiten=False)
    return _result(batch, _whiten(ret, mask, peers), ret, rewards, stats, peers)


def safe_rlhf(batch: Batch, *, gamma: float, lam: float, lagrange: float, kl_coef: float = 0.0,
              kl_penalty: str = "kl", peers: Peers = ONE) -> Batch:
    """Safe-RLHF: reward advantages by GAE, cost advantages whitened, combined by the multiplier."""
    rewards, mask, stats = _token_rewards(batch, kl_coef, kl_penalty)
    reward_adv, ret = core.compute_gae(rewards, batch["values"].float(), mask, gamma, lam, whiten=False)
    _, cost_ret = core.reinforce_pp_advantage(batch["token_level_costs"].float(), mask, gamma, whiten=False)
    adv = core.safe_rlhf_advantage(_whiten(reward_adv, mask, peers), _whiten(cost_ret, mask, peers), lagrange)
    stats.mean("critic/cost_mean", batch["costs"].float().sum(), len(batch))
    return _result(batch, adv, ret, rewards, stats, peers)


def distill(batch: Batch, *, kl_coef: float, task_coef: float = 0.0, norm_by_std: bool = True,
            peers: Peers = ONE) -> Batch:
    """On-policy distillation: the teacher's log-probs of the student's tokens against the
    student's own (per-token reverse KL as the reward); plus task_coef times GRPO's advantage of
    the task reward when > 0. The task reward is scored and logged either way."""
    rewards, mask, stats = _token_rewards(batch, 0.0, "kl")
    student = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
    teacher = batch["teacher_log_probs"].float()
    adv = core.distillation_advantage(student.float(), teacher, mask, kl_coef)
    if task_coef > 0:
        scores, uids = core.masked_sum(rewards, mask, dim=-1), _groups(batch, "opd")
        task, _ = core.grpo_advantage(scores, uids, mask, norm_by_std=norm_by_std,
                                      stats=_group_stats(scores, uids, peers))
        adv = adv + task_coef * task
    stats.mean("distill/reverse_kl", core.masked_sum(student.float() - teacher, mask), mask.sum())
    return _result(batch, adv, adv, rewards, stats, peers)


# batch-wide numbers from every rank's rows ------------------------------------------------------------
class Metrics:
    """Means, maxima and minima over the batch, from each rank's sums (one collective each)."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[Tensor | float, Tensor | float]] = {}  # (total, count; 0: a sum)
        self.highs: dict[str, Tensor | float] = {}

    def mean(self, name: str, total: Tensor | float, count: Tensor | float) -> None:
        self.sums[name] = (total, count)

    def total(self, name: str, value: Tensor | float) -> None:
        self.sums[name] = (value, -1.0)

    def max(self, name: str, values: Tensor) -> None:
        self.highs[name] = values.max() if values.numel() else float("-inf")

    def min(self, name: str, values: Tensor) -> None:
        self.highs[name] = -values.min() if values.numel() else float("-inf")

    def reduce(self, peers: Peers, mins: Sequence[str] = ()) -> dict[str, float]:
        """The batch's values (a mean over no rows is left out)."""
        sums = torch.tensor([[float(t), float(c)] for t, c in self.sums.values()], dtype=torch.float64)
        highs = torch.tensor([float(v) for v in self.highs.values()], dtype=torch.float64)
        if peers.size > 1:  # one collective for both: every rank's numbers, reduced here
            ranks = peers.all_gather(torch.cat([sums.flatten(), highs]))
            sums = torch.stack([r[:sums.numel()] for r in ranks]).sum(0).reshape(sums.shape)
            highs = torch.stack([r[sums.numel():] for r in ranks]).amax(0)
        out = {k: t / c if c > 0 else t for k, (t, c) in zip(self.sums, sums.tolist(), strict=True) if c}
        for k, v in zip(self.highs, highs.tolist(), strict=True):
            if v != float("-inf"):
                out[k] = -v if k in mins else v
        return out


def _whiten(x: Tensor, mask: Tensor, peers: Peers) -> Tensor:
    """`x` whitened over the mask of the whole batch (these rows alone on one rank, exactly as
    `core.masked_whiten`)."""
    if peers.size == 1:
        return core.masked_whiten(x, mask)
    m = mask.to(x.dtype)
    total, count = peers.sum(torch.stack([core.masked_sum(x, mask), m.sum()])).unbind()
    if count.item() < 2:
        raise ValueError(f"whitening needs at least 2 response tokens in the batch, got {count.item():g}")
    mean = total / count
    var = peers.sum(core.masked_sum((x - mean) ** 2, mask)) / count * count / (count - 1)
    return core.masked_whiten(x, mask, moments=(mean, var))


def _group_stats(scores: Tensor, uids: Sequence[Hashable], peers: Peers) -> tuple[Tensor, Tensor, Tensor] | None:
    """Each sample's (group size, group sum, group std) over every rank's samples of its group
    (None on one rank: the estimator takes them from these rows), from one gather of each
    rank's (size, sum, squared deviations) per group, combined in rank order (Chan et al.'s
    pairwise update). A group held by one rank keeps the numbers of these rows alone."""
    if peers.size == 1:
        return None
    index, groups = core.group_index(uids, len(scores), scores.device)
    keys = list(dict.fromkeys(uids))
    zeros = scores.new_zeros(groups)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    total = zeros.index_add(0, index, scores)
    dev = scores - (total / count)[index]
    squares = zeros.index_add(0, index, dev * dev)
    own = torch.stack([count, total, squares], dim=1).to(torch.float64).cpu().tolist()  # plain floats pickle fast
    merged: dict[Hashable, tuple[float, float, float]] = {}
    for theirs, rows in peers.gather((keys, own)):
        for key, (n, t, m2) in zip(theirs, rows, strict=True):
            if key in merged:
                n0, t0, m0 = merged[key]
                delta = t / n - t0 / n0
                merged[key] = (n0 + n, t0 + t, m0 + m2 + delta * delta * n0 * n / (n0 + n))
            else:
                merged[key] = (n, t, m2)
    both = torch.tensor([merged[k] for k in keys], dtype=scores.dtype, device=scores.device).reshape(-1, 3)
    shared = both[:, 0] != count  # a group other ranks hold rows of too
    count = torch.where(shared, both[:, 0], count)[index]
    total = torch.where(shared, both[:, 1], total)[index]
    squares = torch.where(shared, both[:, 2], squares)[index]
    return count, total, torch.sqrt(squares / (count - 1).clamp_min(1))


def _token_rewards(batch: Batch, kl_coef: float, kl_penalty: str) -> tuple[Tensor, Tensor, Metrics]:
    """The token rewards (score on the last token, minus kl_coef·KL when > 0) and the KL metric."""
    mask = batch["response_mask"].float()
    rewards = (batch["token_level_scores"].float() if "token_level_scores" in batch
               else core.scores_to_tokens(batch["scores"].float(), mask))
    stats = Metrics()
    if "ref_log_prob" in batch:
        # the policy's log-probs: recomputed when off-policy, else the rollout's own
        policy = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
        if kl_coef > 0:
            rewards, _ = core.apply_kl_penalty(rewards, policy, batch["ref_log_prob"], mask, kl_coef, kl_penalty)
            per_row = core.masked_mean(core.kl_penalty(policy, batch["ref_log_prob"], kl_penalty) * mask, mask, dim=-1)
            stats.mean("critic/kl", per_row.sum(), len(batch))  # the mean over rows of each row's mean KL
        else:
            kl = core.kl_penalty(policy, batch["ref_log_prob"], "kl")
            stats.mean("critic/kl", core.masked_sum(kl, mask), mask.sum())
    return rewards, mask, stats


def _groups(batch: Batch, estimator: str) -> list:
    if "uid" not in batch:
        raise ValueError(f"{estimator} groups samples by prompt: the batch needs a 'uid' column (the "
                         "prompt loader adds one)")
    return batch["uid"]


def _result(batch: Batch, adv: Tensor, ret: Tensor, rewards: Tensor, stats: Metrics, peers: Peers) -> Batch:
    mask = batch["response_mask"].float()
    scores, lengths = batch["scores"].float(), mask.sum(-1)
    rows, tokens = len(batch), mask.sum()
    stats.mean("critic/score_mean", scores.sum(), rows)
    stats.max("critic/score_max", scores)
    stats.min("critic/score_min", scores)
    stats.mean("critic/advantage_mean", core.masked_sum(adv, mask), tokens)
    stats.mean("critic/return_mean", core.masked_sum(ret, mask), tokens)
    stats.mean("response/length_mean", lengths.sum(), rows)
    stats.max("response/length_max", lengths)
    stats.total("response/tokens", lengths.sum())
    if "response_clipped" in batch:
        stats.mean("response/clip_ratio", batch["response_clipped"].float().sum(), rows)
    for key in sorted(batch.keys()):  # every rank in the same order
        if key in BUILT_IN_AGENT or key.startswith(AGENT_INFO):
            stats.mean(f"agent/{key.removeprefix(AGENT_INFO)}_mean", batch[key].float().sum(), rows)
        elif key.startswith(REWARD_EXTRA):  # a dict-returning reward's extra numbers (NaN: a row without)
            values = batch[key].float()
            seen = values[~values.isnan()]
            stats.mean(f"reward/{key.removeprefix(REWARD_EXTRA)}", seen.sum(), len(seen))
    meta = stats.reduce(peers, mins=("critic/score_min",))
    return Batch({"advantages": adv * mask, "returns": ret * mask, "token_level_rewards": rewards}, meta=meta)
