"""What every rollout engine takes and returns, importable without one: the driver and the
roles load these, not the model code behind `asyncrl.rollout.engine` (transformers' caches and
attention registry, ~5 s of imports on a 2-core machine)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.data.dataset import positions_from_mask


class WeightLoadError(ValueError):
    """A tensor handed to `RolloutEngine.load_weights` does not fit the engine's model."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    n: int = 1  # samples per prompt, interleaved in the output (p0, p0, p1, p1 for n=2)
    greedy: bool = False  # temperature == 0 also means greedy
    seed: int | None = None  # used only when no generator is passed to `generate`
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to eos

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature that defines the reported log-probs (1 for greedy)."""
        return 1.0 if self.temperature == 0.0 else self.temperature


def last_positions(seq_len: int, k: int, device: torch.device | str) -> torch.Tensor:
    """The last `k` of `seq_len` positions as an index for a causal LM's `logits_to_keep`: the
    model then gathers those hidden states into a contiguous tensor. (An int makes it slice a
    strided view, and torch's linear on a strided [B, k, H] input with a weight that needs no
    gradient — a frozen or generation-only LM head — copies the weight once per row: rows ×
    vocab × hidden bytes, 272 MB a row for a 0.5B model's 151,936-token vocabulary.)"""
    return torch.arange(seq_len - k, seq_len, device=device)


def rollout_outputs(prompts: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor,
                    log_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The dict every rollout engine returns, from the B*n prompt rows, the full (prompt +
    response) attention mask, the right-padded responses and their log-probs."""
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": attention_mask[:, prompts.shape[1]:].clone(),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": positions_from_mask(attention_mask),
        "rollout_log_probs": log_probs,
    }
