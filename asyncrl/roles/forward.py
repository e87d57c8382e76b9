"""Forward passes the RL workers share: response log-probs (and entropies), critic values, decoding."""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncrl.algorithms.core import entropy_from_logits, logprobs_from_logits
from asyncrl.single_controller.batch import Batch

log = logging.getLogger(__name__)


def response_forward(model: torch.nn.Module, mb: Batch, temperature: float = 1.0,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, R] of `responses` (and entropies) under one forward of `model`."""
    responses = mb["responses"]
    r = responses.shape[1]
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                position_ids=mb["position_ids"], use_cache=False)
    logits = out.logits[:, -r - 1:-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logprobs_from_logits(logits, responses)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def values_forward(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """Critic values [B, R] at the positions that predict each response token."""
    r = mb["responses"].shape[1]
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                position_ids=mb["position_ids"], use_cache=False)
    return out.logits[:, -r - 1:-1, 0].float()


def decode_responses(tokenizer: Any, batch: Batch) -> list[str]:
    mask = batch["response_mask"].bool()
    return [tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(batch["responses"], mask, strict=True)]
