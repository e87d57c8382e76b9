"""Pieces shared by the RL workers: process setup, model loading, response forward passes."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from asyncrl.algorithms.core import entropy_from_logits, logprobs_from_logits
from asyncrl.batch import Batch
from asyncrl.engine import OptimConfig, init_distributed

log = logging.getLogger(__name__)


def setup_process(cfg: dict[str, Any], rank: int) -> None:
    """torch threads per worker (cores are shared by the node's workers), distributed init, seeds."""
    threads = int(cfg.get("torch_threads", 0)) or max(1, (os.cpu_count() or 1) // max(
        1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(threads)
    init_distributed()
    seed = int(cfg.get("seed", 0)) + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def same_init_on_every_rank(cfg: dict[str, Any]) -> None:
    """Re-seed with the job seed (not seed + rank) before building freshly initialised heads, so
    every rank starts from the same weights."""
    torch.manual_seed(int(cfg.get("seed", 0)))


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory; build the tiny model with "
                                "`python -m asyncrl.models.tiny DIR` or set model.path to a local HF model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))


def optim_config(cfg: dict[str, Any]) -> OptimConfig:
    return OptimConfig(lr=float(cfg.get("lr", 1e-5)), weight_decay=float(cfg.get("weight_decay", 0.0)),
                       grad_clip=float(cfg.get("grad_clip", 1.0)),
                       warmup_steps=int(cfg.get("warmup_steps", 0)),
                       total_steps=int(cfg.get("total_steps", 0)),
                       betas=tuple(cfg.get("betas", (0.9, 0.999))))


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    size = max(1, int(size))
    return batch.split(size) if len(batch) else []


def mini_batches(batch: Batch, n: int, shuffle: bool, generator: torch.Generator | None) -> Iterator[Batch]:
    """`n` equal mini-batches of this rank's rows (shuffled rows when asked)."""
    rows = len(batch)
    order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
    for idx in torch.tensor_split(order, max(1, min(n, rows))):  # every row, sizes differ by <= 1
        if len(idx):
            yield batch.take(idx)


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


def mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average per-rank metric dicts (what a DP_PROTO call that returns metrics gives the driver)."""
    keys = {k for m in per_rank for k in m}
    return {k: float(np.mean([m[k] for m in per_rank if k in m])) for k in sorted(keys)}
