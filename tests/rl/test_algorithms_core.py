"""Unit tests for asyncrl.algorithms.core against small hand-computed examples."""

import math

import pytest
import torch

from asyncrl.algorithms import core
from asyncrl.algorithms.controllers import (
    AdaptiveKLController,
    FixedKLController,
    LagrangeMultiplier,
)
from asyncrl.algorithms.core import (
    KL_KINDS,
    LOSS_AGG_MODES,
    agg_loss,
    apply_kl_penalty,
    compute_gae,
    entropy_from_logits,
    grpo_advantage,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reinforce_pp_advantage,
    remax_advantage,
    rloo_advantage,
    safe_rlhf_advantage,
    value_loss,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=0)


RAGGED = t([1, 1, 1], [1, 0, 0])


# ---- masked reductions ----------------------------------------------------------------------


def test_masked_reductions():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    close(masked_sum(x, mask), 6.0)
    close(masked_mean(x, mask), 2.0)
    close(masked_var(x, mask), 1.0)
    close(masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(masked_mean(t([1, 2, 3], [4, 5, 6]), RAGGED, dim=-1), [2.0, 4.0])
    # Empty mask: 0 rather than nan; masked-out inf/nan never leak.
    close(masked_mean(x, torch.zeros(4)), 0.0)
    close(masked_mean(torch.tensor([1.0, float("-inf"), float("nan")]), torch.tensor([1, 0, 0])), 1)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, torch.tensor([1, 0, 0, 0]))


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    close(masked_whiten(x, mask), [-1.0, 0.0, 1.0, 0.0])
    close(masked_whiten(x, mask, shift_mean=False), [1.0, 2.0, 3.0, 0.0])


# ---- GAE ------------------------------------------------------------------------------------


def test_gae_gamma1_lam1_is_return_minus_value():
    rewards, values, mask = t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted_by_hand():
    # deltas: d2 = 1 - .7 = .3; d1 = .9*.7 - .6 = .03; d0 = .9*.6 - .5 = .04; gamma*lam = .72
    rewards, values, mask = t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    close(adv, [[a0, a1, a2]])
    close(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7]])


def test_gae_ignores_rewards_and_values_after_early_end():
    rewards = t([0, 0, 1], [0, 1, 99])
    values = t([0.5, 0.6, 0.7], [0.5, 0.6, 42])
    mask = t([1, 1, 1], [1, 1, 0])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    b1 = 1 - 0.6
    b0 = 0.9 * 0.6 - 0.5 + 0.72 * b1
    close(adv[1], [b0, b1, 0.0])
    close(ret[1], [b0 + 0.5, b1 + 0.6, 0.0])
    # Even inf/nan garbage after the end does not leak back.
    rewards[1, 2], values[1, 2] = float("nan"), float("inf")
    adv2, ret2 = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    close(adv2, adv)
    close(ret2, ret)
    # Row 0 is unaffected by row 1's padding.
    close(adv[0], [0.04 + 0.72 * (0.03 + 0.72 * 0.3), 0.03 + 0.72 * 0.3, 0.3])


def test_gae_skips_masked_tokens_mid_response():
    # An observation token at t=1 is passed over: t=0 bootstraps from V(t=2).
    rewards, values, mask = t([0, 7, 1]), t([0.5, 9.0, 0.7]), t([1, 0, 1])
    adv, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.5, 0.0, 0.3]])


def test_gae_whitened_by_default():
    rewards = t([0, 0, 1], [0, 1, 99])
    values = t([0.5, 0.6, 0.7], [0.5, 0.6, 42])
    mask = t([1, 1, 1], [1, 1, 0])
    raw, ret_raw = compute_gae(rewards, values, mask, 0.9, 0.8, whiten=False)
    adv, ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    close(adv, masked_whiten(raw, mask))
    close(ret, ret_raw)
    close(masked_mean(adv, mask), 0.0)
    close(masked_var(adv, mask), 1.0, atol=1e-5)


# ---- outcome-reward advantages --------------------------------------------------------------


def test_grpo_two_groups_of_two():
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = t([1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1])
    adv, ret = grpo_advantage(scores, ["a", "a", "b", "b"], mask)
    # group a: mean .5, unbiased std sqrt(.5); group b: zero spread -> 0
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[z, z, z], [-z, -z, 0], [0, 0, 0], [0, 0, 0]])
    close(ret, adv)


def test_dr_grpo_is_mean_centred_only():
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    mask = torch.ones(4, 2)
    adv, _ = grpo_advantage(scores, torch.tensor([7, 7, 3, 3]), mask, norm_by_std=False)
    close(adv[:, 0], [0.5, -0.5, 1.0, -1.0])


def test_grpo_interleaved_groups_and_singletons():
    scores = torch.tensor([4.0, 1.0, 0.0, 5.0])
    mask = torch.ones(4, 1)
    adv, _ = grpo_advantage(scores, ["x", "solo", "x", "y"], mask, norm_by_std=False)
    close(adv[:, 0], [2.0, 0.0, -2.0, 0.0])
    adv, _ = grpo_advantage(scores, ["x", "solo", "x", "y"], mask)
    assert adv[1, 0] == 0 and adv[3, 0] == 0


def test_rloo_leave_one_out():
    scores = torch.tensor([1.0, 2.0, 6.0, 3.0])
    mask = t([1, 1], [1, 0], [1, 1], [1, 1])
    adv, ret = rloo_advantage(scores, torch.tensor([0, 0, 0, 1]), mask)
    # baselines: (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5; singleton -> 0
    close(adv, [[-3.0, -3.0], [-1.5, 0.0], [4.5, 4.5], [0.0, 0.0]])
    close(ret, adv)


def test_remax_outcome_and_token_level():
    mask = RAGGED
    adv, ret = remax_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), mask)
    close(ret, [[1, 1, 1], [0, 0, 0]])
    close(adv, [[0.5, 0.5, 0.5], [-0.5, 0, 0]])
    token_scores = t([0, 2, 1], [3, 9, 9])
    adv, ret = remax_advantage(token_scores, torch.tensor([1.0, 1.0]), mask)
    close(ret, [[3, 3, 1], [3, 0, 0]])
    close(adv, [[2, 2, 0], [2, 0, 0]])


def test_reinforce_pp_discounted_return_then_whitened():
    rewards = t([0, 0, 1], [0, 1, 5])
    mask = t([1, 1, 1], [1, 1, 0])
    adv, ret = reinforce_pp_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    close(adv, masked_whiten(ret, mask))
    close(masked_mean(adv, mask), 0.0)


# ---- KL -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_kinds_zero_at_equal_logprobs(kind):
    lp = torch.tensor([[-0.3, -2.0, -7.5]])
    close(kl_penalty(lp, lp.clone(), kind), [[0.0, 0.0, 0.0]])


def test_kl_kinds_by_hand():
    lp, ref = torch.tensor([0.0]), torch.tensor([-1.0])  # log(pi/pi_ref) = 1
    close(kl_penalty(lp, ref, "k1"), [1.0])
    close(kl_penalty(ref, lp, "abs"), [1.0])
    close(kl_penalty(lp, ref, "k2"), [0.5])
    close(kl_penalty(lp, ref, "low_var_kl"), [math.exp(-1.0) + 1.0 - 1.0])
    # k3 is clamped to [-10, 10].
    close(kl_penalty(torch.tensor([-20.0]), torch.tensor([0.0]), "k3"), [10.0])
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(lp, ref, "full")


def test_apply_kl_penalty():
    scores = t([0, 0, 1], [0, 2, 0])
    lp = torch.zeros(2, 3, dtype=torch.float64)
    ref = t([-1, -1, -1], [-2, -2, -2])
    rewards, mean_kl = apply_kl_penalty(scores, lp, ref, RAGGED, kl_coef=0.1, kind="k1")
    close(rewards, [[-0.1, -0.1, 0.9], [-0.2, 2.0, 0.0]])
    close(mean_kl, (1.0 + 2.0) / 2)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05

    ctl = AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=1000)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(current_kl=6.6, n_steps=1000)  # error 0.1, unclipped
    assert ctl.value == pytest.approx(0.1 * 1.01)
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(current_kl=torch.tensor(0.0), n_steps=1000)
    assert ctl.value == pytest.approx(0.1 * 0.98)


def test_kl_loss():
    lp = torch.zeros(2, 3)
    ref = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, 9.0, 9.0]])
    close(kl_loss(lp, ref, RAGGED, kind="k1"), (3 * 1.0 + 2.0) / 4)
    close(kl_loss(lp, ref, RAGGED, kind="k1", loss_agg_mode="seq-mean-token-mean"), 1.5)


# ---- losses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),
    ],
)
def test_agg_loss_modes_on_ragged_mask(mode, expected):
    assert mode in LOSS_AGG_MODES
    close(agg_loss(t([1, 2, 3], [4, 5, 6]), RAGGED, mode), expected)


def test_agg_loss_norm_len_and_bad_mode():
    close(agg_loss(t([1, 2, 3], [4, 5, 6]), RAGGED, "seq-mean-token-sum-norm", norm_len=10), 0.5)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(t([1.0]), t([1.0]), "sum")


def test_ppo_policy_loss_clip_and_dual_clip():
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(5.0), math.log(5.0), math.log(1.1)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, m = ppo_policy_loss(old, new, adv, torch.ones(1, 3))
    # A>0, r=5: max(-5, -1.2) = -1.2 (clipped); A<0, r=5: min(max(5, 1.2), 3) = 3 (dual clip);
    # r=1.1 inside the trust region: -2.2.
    close(loss, (-1.2 + 3.0 - 2.2) / 3)
    close(m["clipfrac"], 1 / 3)
    close(m["clipfrac_lower"], 1 / 3)
    close(m["approx_kl"], -(2 * math.log(5.0) + math.log(1.1)) / 3)
    loss.backward()
    # Clipped tokens carry no gradient; the unclipped one gets -A * r / 3.
    close(new.grad, [[0.0, 0.0, -2.0 * 1.1 / 3]])


def test_ppo_policy_loss_asymmetric_clip_and_mask():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.25, 9.0]]))
    adv = torch.tensor([[1.0, 1.0]])
    loss, m = ppo_policy_loss(old, new, adv, torch.tensor([[1, 0]]), clip_ratio_high=0.28)
    close(loss, -1.25)  # 1.25 < 1.28: not clipped; the masked token is ignored
    close(m["clipfrac"], 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(old, new, adv, torch.ones(1, 2), clip_ratio_c=1.0)


def test_value_loss_clipped():
    values = torch.tensor([[1.0, 0.1]])
    old_values = torch.zeros(1, 2)
    returns = torch.tensor([[2.0, 0.0]])
    loss, clipfrac = value_loss(values, old_values, returns, torch.ones(1, 2), clip_range=0.2)
    # token 0: max((1-2)^2, (0.2-2)^2) = 3.24; token 1: inside range, 0.01
    close(loss, 0.5 * (3.24 + 0.01) / 2)
    close(clipfrac, 0.5)


# ---- logits ---------------------------------------------------------------------------------


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    ent = entropy_from_logits(logits)
    close(ent[0], math.log(4))
    close(ent[1], 0.0)
    close(ent[2], torch.distributions.Categorical(logits=logits[2]).entropy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 11) * 3).to(dtype)
    labels = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    got = logprobs_from_logits(logits, labels, chunk_rows=3)
    assert got.shape == (2, 5)
    close(got, expected, atol=1e-5)


# ---- Safe-RLHF ------------------------------------------------------------------------------


def test_lagrange_multiplier_rises_when_cost_exceeds_limit():
    lm = LagrangeMultiplier(init_value=1.0, lr=0.1, cost_limit=1.0)
    assert lm.update(2.0) == pytest.approx(math.exp(0.1 * 1.0 * 1.0))
    assert lm.value > 1.0


def test_lagrange_multiplier_never_negative_and_capped():
    lm = LagrangeMultiplier(init_value=1.0, lr=1.0, cost_limit=10.0)
    values = [lm.update(0.0) for _ in range(50)]
    assert all(v >= 0.0 for v in values)
    assert values == sorted(values, reverse=True)
    capped = LagrangeMultiplier(init_value=1.0, lr=1.0, cost_limit=0.0, max_value=2.0)
    for _ in range(5):
        capped.update(5.0)
    assert capped.value == pytest.approx(2.0)
    with pytest.raises(ValueError):
        LagrangeMultiplier(init_value=0.0, lr=0.1, cost_limit=0.0)


def test_safe_rlhf_advantage():
    reward_adv, cost_adv = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    close(safe_rlhf_advantage(reward_adv, cost_adv, 0.5), [(1 - 1.5) / 1.5, 2.5 / 1.5])
    close(safe_rlhf_advantage(reward_adv, cost_adv, torch.tensor(0.0)), [1.0, 2.0])


# ---- objectives for stale samples (rollout.max_staleness > 0) ---------------------------------
def _stale_example():
    """One row, three tokens, the last masked: pi_prox, pi_behav, pi_theta and A by hand."""
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
    behav = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))  # w = pi_prox / pi_behav = [2.0, 0.5, 1.0]
    logp = torch.log(torch.tensor([[0.6, 0.2, 0.3]]))  # r = pi_theta / pi_prox = [1.2, 1.0, 1.0]
    adv = torch.tensor([[1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    return prox, behav, logp, adv, mask


def test_decoupled_ppo_by_hand():
    prox, behav, logp, adv, mask = _stale_example()
    clip = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1}
    # token 0: r = 1.2 clipped to 1.1, loss -1.1, times w = 2 -> -2.2; token 1: r = 1, loss 1.0,
    # times w = 0.5 -> 0.5; token-mean over the 2 real tokens: -0.85
    loss, m = core.decoupled_ppo_loss(prox, logp, behav, adv, mask, imp_weight_cap=5.0, **clip)
    assert loss.item() == pytest.approx(-0.85, abs=1e-5)
    assert m["behav_imp_weight"].item() == pytest.approx(1.25, abs=1e-5)
    assert m["behav_capped_frac"].item() == 0.0 and m["clipfrac"].item() == pytest.approx(0.5)
    # cap 1.5: token 0 (w = 2) leaves the loss, which is token 1's alone
    loss, m = core.decoupled_ppo_loss(prox, logp, behav, adv, mask, imp_weight_cap=1.5, **clip)
    assert loss.item() == pytest.approx(0.5, abs=1e-5) and m["behav_capped_frac"].item() == pytest.approx(0.5)


def test_tis_ppo_by_hand():
    prox, behav, logp, adv, mask = _stale_example()
    clip = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1}
    # weights min(w, 1.5) = [1.5, 0.5]: (-1.1 * 1.5 + 1.0 * 0.5) / 2 = -0.575
    loss, m = core.tis_ppo_loss(prox, logp, behav, adv, mask, imp_weight_cap=1.5, **clip)
    assert loss.item() == pytest.approx(-0.575, abs=1e-5)
    # under the cap it is PPO weighted by the ratio: (-1.1 * 2 + 1.0 * 0.5) / 2
    loss, _ = core.tis_ppo_loss(prox, logp, behav, adv, mask, imp_weight_cap=5.0, **clip)
    assert loss.item() == pytest.approx(-0.85, abs=1e-5)


def test_stale_objectives_are_ppo_on_policy_and_weights_carry_no_gradient():
    prox, _, logp, adv, mask = _stale_example()
    ppo, _ = core.ppo_policy_loss(prox, logp, adv, mask)
    for fn in (core.decoupled_ppo_loss, core.tis_ppo_loss):
        same, m = fn(prox, logp, prox.clone(), adv, mask)
        assert same.item() == pytest.approx(ppo.item(), abs=1e-6) and m["behav_imp_weight"].item() == pytest.approx(1.0)
        theta = logp.clone().requires_grad_(True)
        behav = (prox - 0.3).requires_grad_(True)
        fn(prox, theta, behav, adv, mask)[0].backward()
        assert behav.grad is None and theta.grad is not None and theta.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="cap must be > 1"):
        core.decoupled_ppo_loss(prox, logp, prox, adv, mask, imp_weight_cap=1.0)


def test_overlong_penalty_matches_dapo_by_hand():
    lengths = torch.tensor([5, 6, 7, 8, 10])
    # max 10 tokens, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at the cap
    assert core.overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert core.overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


# issue 17: divergences from the reference behaviour ---------------------------------------------
def test_adaptive_kl_horizon_counts_responses_not_prompts():
    from types import SimpleNamespace

    from asyncrl.algorithms.controllers import Controllers
    from asyncrl.trainer import Trainer

    cfg = SimpleNamespace(data=SimpleNamespace(batch_size=32), rollout=SimpleNamespace(n=8))
    n = Trainer.samples_per_step.fget(SimpleNamespace(cfg=cfg))
    assert n == 256
    ctl = Controllers(AdaptiveKLController(1.0, target_kl=0.1, horizon=10000), None)
    for _ in range(100):  # KL held at twice the target: the error clips to +0.2
        ctl.update({"critic/kl": 0.2}, n)
    assert ctl.kl_coef == pytest.approx((1 + 0.2 * 256 / 10000) ** 100)  # 1.666, not 1.066
    assert ctl.kl_coef == pytest.approx(1.6664, abs=1e-3)


def test_remax_with_kl_in_the_reward_uses_return_to_go():
    from asyncrl.algorithms import advantage
    from asyncrl.single_controller.batch import Batch

    mask = torch.ones(1, 3)
    adv, ret = core.remax_advantage(torch.tensor([[-0.1, -0.1, 0.9]]), torch.tensor([0.5]), mask)
    assert adv[0].tolist() == pytest.approx([0.2, 0.3, 0.4])
    batch = Batch({"response_mask": mask, "scores": torch.tensor([0.7]),
                   "token_level_scores": torch.tensor([[-0.1, -0.1, 0.9]])})
    out = advantage.remax(batch, Batch({"scores": torch.tensor([0.5])}))
    assert out["advantages"][0].tolist() == pytest.approx([0.2, 0.3, 0.4])
    # without KL shaping (score on the last token only) every token gets the same advantage
    plain = Batch({"response_mask": mask, "scores": torch.tensor([0.9])})
    assert advantage.remax(plain, Batch({"scores": torch.tensor([0.5])}))["advantages"][0].tolist() == \
        pytest.approx([0.4, 0.4, 0.4])


def test_scores_land_on_the_last_real_token_of_a_mask_with_holes():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    out = core.scores_to_tokens(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert out[0].tolist() == [0, 0, 0, 0, 0, 1.0] and out[1].tolist() == [0, 0, 2.0, 0, 0, 0]
    assert out[2].sum() == 0  # an empty response holds no score


def test_duplicate_prompts_in_a_batch_are_separate_groups():
    from asyncrl.algorithms import advantage
    from asyncrl.data.dataset import PromptDataset
    from asyncrl.data.synthetic import make_rows
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.single_controller.batch import Batch

    ds = PromptDataset(make_rows("sort", 1, 0) * 2, build_tokenizer(), 64)  # the same prompt twice
    uids = ds.collate(ds.items)["uid"]
    assert uids[0] != uids[1]
    rows = [u for u in uids for _ in range(2)]  # n = 2 samples each
    batch = Batch({"response_mask": torch.ones(4, 1), "scores": torch.tensor([1.0, 0.0, 1.0, 1.0])}, {"uid": rows})
    adv = advantage.grpo(batch, norm_by_std=False)["advantages"][:, 0].tolist()
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0])  # merged, the second pair would get +0.25 each
