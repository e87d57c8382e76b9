"""GSPO, CISPO, Clip-Cov, KL-Cov and rollout correction against small hand-worked cases."""

import math

import pytest
import torch

from asyncrl import config as C
from asyncrl.algorithms import core
from transport.checks import ConfigError


def _grad(fn, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    theta = logp.clone().requires_grad_(True)
    loss = fn(theta)
    loss.backward()
    return loss.detach(), theta.grad


def test_gspo_clips_whole_sequences_by_their_length_normalised_ratio():
    # row 0: log-ratios 0.1, -0.1, 0.3 (mean 0.1, s = e^0.1 inside 1 +- 0.2); row 1: 0.3, 0.3 (s = e^0.3,
    # above 1.2 with A > 0: clipped, no gradient); row 1's third token is padding
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.1, 0.3], [0.3, 0.3, 9.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])

    def loss_of(theta):
        losses, m = core.gspo_token_losses(old, theta, adv, mask, clip_low=0.2, clip_high=0.2)
        loss_of.m = m
        return core.agg_loss(losses, mask, "seq-mean-token-mean")

    loss, grad = _grad(loss_of, logp)
    # seq-mean-token-mean: (-1 * e^0.1 + -2 * 1.2) / 2
    assert loss.item() == pytest.approx((-math.exp(0.1) - 2.4) / 2, abs=1e-6)
    # d/dlogp_t of -A s_i / 2 (batch of 2) with s_i = exp(mean log-ratio): -A s_i / (2 |y_i|)
    assert torch.allclose(grad[0], torch.full((3,), -math.exp(0.1) / 6), atol=1e-6)
    assert torch.all(grad[1] == 0)
    assert loss_of.m["clipfrac"].item() == pytest.approx(2 / 5)


def test_gspo_on_policy_is_the_sequence_mean_of_the_advantage():
    logp = torch.randn(4, 5)
    adv = torch.randn(4, 1).expand(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    losses, _ = core.gspo_token_losses(logp, logp, adv, mask)
    assert core.agg_loss(losses, mask, "seq-mean-token-mean").item() == pytest.approx(-adv[:, 0].mean().item(), abs=1e-6)


def test_cispo_clips_the_weight_not_the_update():
    # ratios 5, 0.5, 1: weights 4 (capped), 0.5 (no lower clip by default), 1; every token keeps a gradient
    old = torch.log(torch.tensor([[0.1, 0.4, 0.3]]))
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)

    def loss_of(theta):
        losses, m = core.cispo_token_losses(old, theta, adv, mask)
        loss_of.m = m
        return core.agg_loss(losses, mask, "token-mean")

    loss, grad = _grad(loss_of, logp)
    weights = torch.tensor([4.0, 0.5, 1.0])
    assert loss.item() == pytest.approx(float(-(weights * adv[0] * logp[0]).sum() / 3), abs=1e-6)
    assert torch.allclose(grad[0], -weights * adv[0] / 3, atol=1e-6)  # the weight is detached
    assert loss_of.m["clipfrac"].item() == pytest.approx(1 / 3)
    losses, m = core.cispo_token_losses(old, logp, adv, mask, weight_low=0.8, weight_high=4.0)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)


def _cov_example():
    """Four tokens on policy (ratio 1): advantages and log-probs whose covariance terms are
    (A - 0.5) * (logp - mean logp) = [2.25, 0.75, 0.25, -0.75] ... by construction below."""
    adv = torch.tensor([[2.0, 2.0, -1.0, -1.0]])
    logp = torch.tensor([[-0.5, -2.0, -3.5, -2.0]])  # mean -2: centred [1.5, 0, -1.5, 0]
    # A - mean(A) = [1.5, 1.5, -1.5, -1.5] -> cov = [2.25, 0, 2.25, 0]
    return adv, logp, torch.ones(1, 4)


def test_clip_cov_detaches_a_share_of_the_tokens_in_the_covariance_band():
    adv, logp, mask = _cov_example()
    cov = core.token_covariance(adv, logp, mask)
    assert torch.allclose(cov, torch.tensor([[2.25, 0.0, 2.25, 0.0]]))
    # ratio 1: every token in the band (1, 5) -- tokens 0 and 2 -- loses its gradient
    _, grad = _grad(lambda t: core.agg_loss(core.clip_cov_token_losses(logp, t, adv, mask, ratio=1.0)[0],
                                            mask, "token-mean"), logp)
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[0, 1] == -0.5 and grad[0, 3] == 0.25
    # the default share of 4 tokens is one: exactly one of the two band tokens, drawn at random
    gen = torch.Generator().manual_seed(0)
    picked = set()
    for _ in range(20):
        _, m = core.clip_cov_token_losses(logp, logp, adv, mask, generator=gen)
        assert m["cov_detached_frac"].item() == pytest.approx(0.25)
        _, grad = _grad(lambda t: core.agg_loss(core.clip_cov_token_losses(logp, t, adv, mask, generator=gen)[0],
                                                mask, "token-mean"), logp)
        zero = (grad[0] == 0).nonzero().flatten().tolist()
        assert len(zero) == 1 and zero[0] in (0, 2)
        picked.add(zero[0])
    assert picked == {0, 2}


def test_kl_cov_penalises_the_largest_covariance_tokens():
    adv, logp, mask = _cov_example()
    old = logp - torch.tensor([[0.0, 0.1, -0.2, 0.3]])  # log-ratios 0, 0.1, -0.2, 0.3
    base, _ = core.kl_cov_token_losses(old, logp, adv, mask, ratio=1e-9, kl_coef=0.0)
    losses, m = core.kl_cov_token_losses(old, logp, adv, mask, ratio=0.5, kl_coef=2.0)
    # two tokens (half of four) with the largest covariance, 0 and 2, get 2 * |log-ratio|
    assert torch.allclose(losses - base, torch.tensor([[0.0, 0.0, 0.4, 0.0]]), atol=1e-6)
    assert m["cov_penalised_frac"].item() == pytest.approx(0.5)
    assert torch.allclose(base, -adv * torch.exp(logp - old))  # no clip: the unclipped surrogate


def _perturbed():
    """Two rows of four tokens on which the trainer and the engine agree, except row 0's token 1
    (r = pi_trainer / pi_rollout = 3) and row 1's token 2 (r = 0.3); row 1's last token is padding."""
    old = torch.log(torch.full((2, 4), 0.5))
    rollout = old.clone()
    rollout[0, 1] = math.log(0.5 / 3)
    rollout[1, 2] = math.log(0.5 / 0.3)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    return old, rollout, mask


def test_each_rollout_correction_caps_or_masks_exactly_the_tokens_it_should():
    old, rollout, mask = _perturbed()
    w, keep, m = core.rollout_correction(old, rollout, mask, "tis", "token", 0.0, 2.0)
    expect = mask.clone()
    expect[0, 1], expect[1, 2] = 2.0, 0.3
    assert torch.allclose(w, expect, atol=1e-6) and torch.equal(keep, mask.bool())
    assert m["capped_frac"].item() == pytest.approx(1 / 7) and m["masked_token_frac"].item() == 0

    w, keep, m = core.rollout_correction(old, rollout, mask, "mis", "token", 0.0, 2.0)  # r = 3 leaves
    dropped = mask.bool() & ~keep
    assert dropped.nonzero().tolist() == [[0, 1]] and w[0, 1] == 0 and w[1, 2] == pytest.approx(0.3)
    assert m["masked_token_frac"].item() == pytest.approx(1 / 7) and m["masked_seq_frac"].item() == 0.5

    w, keep, m = core.rollout_correction(old, rollout, mask, "icepop", "token", 0.5, 5.0)  # r = 0.3 leaves
    assert (mask.bool() & ~keep).nonzero().tolist() == [[1, 2]] and w[0, 1] == pytest.approx(3.0)

    # sequence level: row 0's ratio is 3 (masked whole), row 1's 0.3 (kept by mis, upper bound only)
    w, keep, m = core.rollout_correction(old, rollout, mask, "mis", "sequence", 0.0, 2.0)
    assert not keep[0].any() and torch.equal(keep[1], mask[1].bool()) and m["masked_seq_frac"].item() == 0.5
    assert torch.allclose(w[1], 0.3 * mask[1], atol=1e-6)
    w, _, _ = core.rollout_correction(old, rollout, mask, "tis", "sequence", 0.0, 2.0)
    assert torch.allclose(w, torch.stack([2.0 * mask[0], 0.3 * mask[1]]), atol=1e-6)

    # geometric mean: row 0's exp(log 3 / 4) = 1.32, row 1's exp(log 0.3 / 3) = 0.67; a band of
    # [0.6, 1.2] masks row 0 only, and the kept tokens carry weight 1
    w, keep, m = core.rollout_correction(old, rollout, mask, "geo_mask", "sequence", 0.6, 1.2)
    assert not keep[0].any() and torch.equal(keep[1], mask[1].bool()) and torch.equal(w, keep.float())


def test_correction_of_an_agreeing_engine_changes_nothing():
    old = torch.randn(3, 6)
    mask = torch.ones(3, 6)
    for mode, level, low, high in [("tis", "token", 0.0, 2.0), ("mis", "sequence", 0.0, 2.0),
                                   ("icepop", "token", 0.5, 5.0), ("geo_mask", "sequence", 0.999, 1.001)]:
        w, keep, m = core.rollout_correction(old, old.clone(), mask, mode, level, low, high)
        assert torch.allclose(w, mask) and keep.all() and m["masked_token_frac"] == 0, mode


def test_mismatch_metrics_by_hand():
    old, rollout, mask = _perturbed()
    m = core.mismatch_metrics(old, rollout, mask)
    d = torch.tensor([math.log(3), math.log(0.3)])  # the two tokens that differ; five agree
    assert m["logprob_diff_mean"].item() == pytest.approx(float(d.abs().sum() / 7), abs=1e-6)
    assert m["logprob_diff_max"].item() == pytest.approx(math.log(3) if math.log(3) > -math.log(0.3)
                                                        else -math.log(0.3), abs=1e-6)
    assert m["k3_kl"].item() == pytest.approx(float((d.exp() - 1 - d).sum() / 7), abs=1e-6)
    assert m["ppl_ratio"].item() == pytest.approx(math.exp(float(-d.sum() / 7)), abs=1e-6)


def test_correction_settings_that_cannot_work_are_refused():
    actor = lambda **kw: C.rl_config({"actor": kw})  # noqa: E731
    with pytest.raises(ConfigError, match="policy_loss=decoupled already weighs tokens"):
        actor(policy_loss="decoupled", rollout_correction={"mode": "tis"})
    with pytest.raises(ConfigError, match="icepop is defined at token level"):
        actor(rollout_correction={"mode": "icepop", "level": "sequence"})
    with pytest.raises(ConfigError, match="must contain 1"):
        actor(rollout_correction={"mode": "mis", "low": 1.5, "high": 3.0})
    assert actor(rollout_correction={"mode": "geo_mask"}).actor.rollout_correction.resolved() == ("sequence", 0.999, 1.001)
    assert actor(rollout_correction={"mode": "mis", "level": "sequence"}).actor.rollout_correction.resolved() == (
        "sequence", 0.0, 2.0)
    # the losses that need no behaviour policy ask for no extra log-prob pass on policy
    assert not actor(policy_loss="cispo").actor.recompute_old_log_probs()
    assert actor(policy_loss="tis").actor.recompute_old_log_probs()


def test_distillation_advantage_is_the_per_token_reverse_kl_signal():
    from asyncrl.algorithms import advantage
    from asyncrl.single_controller.batch import Batch

    student = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.1, 0.2, 0.5]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.4, 0.2, 0.9]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = core.distillation_advantage(student, teacher, mask, kl_coef=2.0)
    # 2 * log(teacher / student) per token: [-2 ln 2, 2 ln 2, 0], [2 ln 4, 0, masked]
    assert torch.allclose(adv, torch.tensor([[-2 * math.log(2), 2 * math.log(2), 0.0], [2 * math.log(4), 0.0, 0.0]]),
                          atol=1e-6)
    batch = Batch({"rollout_log_probs": student, "teacher_log_probs": teacher, "response_mask": mask,
                   "scores": torch.tensor([1.0, 0.0])}, {"uid": ["a", "a"]})
    out = advantage.distill(batch, kl_coef=2.0)
    assert torch.allclose(out["advantages"], adv, atol=1e-6)
    # reverse KL estimate, mean over the 5 real tokens: (ln 2 - ln 2 + 0 - ln 4 + 0) / 5
    assert out.meta["distill/reverse_kl"] == pytest.approx(-math.log(4) / 5, abs=1e-6)
    # plus the task: GRPO's advantages of scores 1 and 0 in one group, (+-1/std) on every token
    mixed = advantage.distill(batch, kl_coef=2.0, task_coef=0.5)["advantages"]
    task = (mixed - adv) / 0.5
    assert task[0, 0] > 0 and task[1, 0] < 0 and torch.allclose(task[0], task[0, 0].expand(3))
