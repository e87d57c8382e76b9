"""The controllers an RL run adapts between steps — the KL coefficient and the Safe-RLHF
Lagrange multiplier — and `Controllers`, the one place the trainer updates, saves and restores
them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:  # the config imports the algorithms
    from asyncrl.config import AlgorithmConfig


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019): steer the observed KL to `target_kl`."""

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Scale the coefficient by 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class LagrangeMultiplier:
    """Lagrange multiplier lambda >= 0 for a cost constraint, kept as log(lambda) as Safe-RLHF does.

    `update` takes one gradient-ascent step on lambda * (mean_episode_cost - cost_limit) w.r.t.
    log(lambda), so lambda grows while the constraint is violated and decays (never below 0)
    otherwise.
    """

    def __init__(
        self, init_value: float, lr: float, cost_limit: float, max_value: float | None = None
    ) -> None:
        if init_value <= 0:
            raise ValueError(
                f"init_value must be > 0 (lambda is stored as a log), got {init_value}"
            )
        if max_value is not None and max_value < init_value:
            raise ValueError(f"max_value {max_value} is below init_value {init_value}")
        self.lr = float(lr)
        self.cost_limit = float(cost_limit)
        self.max_value = max_value
        self._log_value = math.log(init_value)

    @property
    def value(self) -> float:
        return math.exp(self._log_value)

    def state_dict(self) -> dict[str, float]:
        return {"log_value": self._log_value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._log_value = float(state["log_value"])

    def update(self, mean_episode_cost: float | Tensor) -> float:
        """Step log(lambda) by lr * lambda * (cost - limit); returns the new lambda."""
        violation = float(mean_episode_cost) - self.cost_limit
        self._log_value += self.lr * violation * self.value
        if self.max_value is not None:
            self._log_value = min(self._log_value, math.log(self.max_value))
        return self.value


@dataclass
class Controllers:
    """The run's adaptive coefficients; steps read them, the trainer updates them once per step."""

    kl: FixedKLController | AdaptiveKLController
    lagrange: LagrangeMultiplier

    @classmethod
    def from_config(cls, algo: AlgorithmConfig) -> Controllers:
        kc = algo.kl_ctrl
        coef = kc.kl_coef if algo.use_kl_in_reward else 0.0
        kl = (AdaptiveKLController(coef, kc.target_kl, kc.horizon) if kc.type == "adaptive"
              else FixedKLController(coef))
        s = algo.safe
        return cls(kl, LagrangeMultiplier(s.lagrange_init, s.lagrange_lr, s.cost_limit, s.lagrange_max))

    @property
    def kl_coef(self) -> float:
        return float(self.kl.value)

    def update(self, metrics: dict[str, float], n_samples: int) -> dict[str, float]:
        """Adapt to this step's metrics; `n_samples`: the responses whose KL was measured (the
        adaptive controller's horizon counts samples, as in Ziegler et al.). Returns the new
        values as metrics."""
        self.kl.update(metrics.get("critic/kl", 0.0), n_samples)
        out = {"actor/kl_coef": self.kl_coef}
        if "critic/cost_mean" in metrics:  # only algorithms with a cost signal move lambda
            out["safe/lagrange"] = self.lagrange.update(metrics["critic/cost_mean"])
        return out

    def state_dict(self) -> dict:
        return {"kl_coef": self.kl_coef, "lagrange": self.lagrange.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl.value = float(state["kl_coef"])
        self.lagrange.load_state_dict(state["lagrange"])
