"""The policy losses by name (`actor.policy_loss`): each turns a micro-batch's log-probs and
advantages into its loss (numerics in `core.py`). A new one is a function and one entry: here, or
from a package of yours through the `asyncrl.policy_losses` entry-point group (`name =
"your_pkg.module:LOSS"`, a `PolicyLoss`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from asyncrl.algorithms import core
from asyncrl.engines import with_entry_points


@dataclass(frozen=True)
class PolicyLoss:
    """Per-token losses and metrics: (actor config, old log-probs, log-probs, advantages, mask,
    generator) -> (losses [rows, T], metrics); a behaviour loss also takes the rollout engine's
    log-probs and returns the aggregated loss itself."""

    fn: Callable[..., tuple[Tensor, dict[str, Any]]]
    behaviour: bool = False  # weighs by pi_old / pi_rollout itself (asynchronous runs): needs both log-probs


def _clip(ac: Any) -> dict[str, float]:
    return {"clip_ratio_low": ac.clip_low, "clip_ratio_high": ac.clip_high, "clip_ratio_c": ac.clip_ratio_c}


def _ppo(ac: Any, old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, gen: Any) -> tuple[Tensor, dict]:
    return core.ppo_token_losses(old, logp, adv, mask, **_clip(ac))


def _gspo(ac: Any, old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, gen: Any) -> tuple[Tensor, dict]:
    return core.gspo_token_losses(old, logp, adv, mask, ac.gspo.clip_low, ac.gspo.clip_high)


def _cispo(ac: Any, old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, gen: Any) -> tuple[Tensor, dict]:
    return core.cispo_token_losses(old, logp, adv, mask, ac.cispo.weight_low, ac.cispo.weight_high)


def _clip_cov(ac: Any, old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, gen: Any) -> tuple[Tensor, dict]:
    return core.clip_cov_token_losses(old, logp, adv, mask, ac.clip_low, ac.clip_high, ac.cov.clip_ratio,
                                      ac.cov.clip_low, ac.cov.clip_high, generator=gen)


def _kl_cov(ac: Any, old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, gen: Any) -> tuple[Tensor, dict]:
    return core.kl_cov_token_losses(old, logp, adv, mask, ac.cov.kl_ratio, ac.cov.kl_coef)


def _behaviour(loss: Callable[..., tuple[Tensor, dict]]) -> Callable[..., tuple[Tensor, dict]]:
    def run(ac: Any, old: Tensor, logp: Tensor, rollout: Tensor, adv: Tensor, mask: Tensor, norm_len: int
            ) -> tuple[Tensor, dict]:
        return loss(old, logp, rollout, adv, mask, imp_weight_cap=ac.behav_imp_weight_cap,
                    loss_agg_mode=ac.loss_agg_mode, norm_len=norm_len, **_clip(ac))
    return run


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(_ppo), "gspo": PolicyLoss(_gspo), "cispo": PolicyLoss(_cispo),
    "clip_cov": PolicyLoss(_clip_cov), "kl_cov": PolicyLoss(_kl_cov),
    "decoupled": PolicyLoss(_behaviour(core.decoupled_ppo_loss), behaviour=True),
    "tis": PolicyLoss(_behaviour(core.tis_ppo_loss), behaviour=True),
}

ENTRY_POINT_GROUP = "asyncrl.policy_losses"


def policy_losses() -> dict[str, PolicyLoss]:
    """The table, with the installed packages' entry points added (once)."""
    return with_entry_points(POLICY_LOSSES, ENTRY_POINT_GROUP, PolicyLoss)


def is_behaviour_loss(name: str) -> bool:
    """Whether `actor.policy_loss=name` weighs by the behaviour policy itself (needs both log-probs)."""
    table = policy_losses()
    return name in table and table[name].behaviour
