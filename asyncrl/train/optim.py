"""The optimizer's settings and its learning-rate schedule, shared by every training backend."""

from __future__ import annotations

import math
from dataclasses import dataclass

from transport.checks import check as _check
from transport.checks import check_positive as _positive


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then constant lr (total_steps=0) or cosine decay to min_lr."""

    lr: float = 1e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decays
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    eps: float = 1e-8  # AdamW's denominator epsilon
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping (the norm is still reported)
    warmup_steps: int = 0  # optimizer steps of linear warmup from 0 to lr
    total_steps: int = 0  # 0 = constant lr after warmup
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr

    def check(self, at: str) -> None:
        _positive(at + "lr", self.lr)
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), at + "betas", list(self.betas),
               "must be two numbers in [0, 1)")
        _positive(at + "eps", self.eps)
        _positive(at + "total_steps", self.total_steps, allow_zero=True)
        _positive(at + "weight_decay", self.weight_decay, allow_zero=True)
        _positive(at + "warmup_steps", self.warmup_steps, allow_zero=True)
        _check(not self.total_steps or self.warmup_steps <= self.total_steps, at + "warmup_steps", self.warmup_steps,
               f"must be <= {at}total_steps={self.total_steps} (the schedule decays after warmup; "
               "total_steps=0 keeps the lr constant)")
        _check(0 <= self.min_lr_ratio <= 1, at + "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


def lr_multiplier(step: int, cfg: OptimConfig) -> float:
    """Factor on cfg.lr for the optimizer step that follows `step` completed steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.total_steps <= 0:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine
