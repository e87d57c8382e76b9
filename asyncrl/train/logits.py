"""Log-probs and entropies from logits in fp32 chunks, and whether a model computes logits at
chosen positions only (`logits_to_keep`): what the RL passes and Ulysses' turns share."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LOGIT_CHUNK_TOKENS = 1024  # positions whose fp32 logits exist at once (x vocab x 4 bytes; asyncrl.plan.memory counts them)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy over the last dim: logsumexp(z) - sum(softmax(z) * z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_rows: int = 1024) -> Tensor:
    """log softmax(logits)[labels] without materialising a full [..., vocab] log-softmax at once.

    Works in chunks of `chunk_rows` positions so peak extra memory is chunk_rows * vocab; fp16 and
    bf16 logits are upcast per chunk because logsumexp in low precision loses too much.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1)
    out = []
    for chunk, chunk_labels in zip(
        flat_logits.split(chunk_rows), flat_labels.split(chunk_rows), strict=True
    ):
        if chunk.dtype not in (torch.float32, torch.float64):
            chunk = chunk.float()
        picked = chunk.gather(-1, chunk_labels).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if not out:
        return flat_logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat(out).reshape(labels.shape)


def response_logprobs(logits: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0,
                      with_entropy: bool = False, chunk_tokens: int = LOGIT_CHUNK_TOKENS
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `responses` [B, R] (and entropies) from logits [B, R, V] at temperature,
    in fp32, `chunk_tokens` positions at a time."""
    rows, width, vocab = logits.shape
    flat, labels = logits.reshape(-1, vocab), responses.reshape(-1)
    logps, ents = [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        chunk, chunk_labels = flat[start:start + chunk_tokens], labels[start:start + chunk_tokens]
        if torch.is_grad_enabled() and chunk.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, chunk, chunk_labels, temperature, with_entropy,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(chunk, chunk_labels, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = logits.new_zeros((rows, width), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logp = torch.cat(logps).reshape(rows, width)
    return logp, (torch.cat(ents).reshape(rows, width) if with_entropy else None)


def _chunk_logprobs(chunk: torch.Tensor, labels: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    z = chunk.float()
    if temperature != 1.0:
        z = z / temperature
    logp = logprobs_from_logits(z, labels)
    return logp, (entropy_from_logits(z) if with_entropy else None)


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (Hugging Face causal LMs since 4.50)."""
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:  # once per class, not per micro-batch
    forward = getattr(cls, "forward", None)
    try:
        return forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


__all__ = ["keeps_logits", "response_logprobs"]
