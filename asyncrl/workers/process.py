"""Worker process setup shared by the RL workers: threads, the process group, seeds, model loading."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from asyncrl.config import RLConfig
from asyncrl.engine import init_distributed
from daemons.node import NODE_DEVICES_ENV


def setup_process(cfg: RLConfig, rank: int) -> None:
    """torch threads per worker (cores are shared by the node's devices: a pool of one worker
    beside another pool gets its device's share, not the node's), distributed init, seeds."""
    per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get(NODE_DEVICES_ENV, "1")))
    torch.set_num_threads(cfg.trainer.torch_threads or max(1, (os.cpu_count() or 1) // per_node))
    init_distributed()
    seed = cfg.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def same_init_on_every_rank(cfg: RLConfig) -> None:
    """Re-seed with the job seed (not seed + rank) before building freshly initialised heads, so
    every rank starts from the same weights."""
    torch.manual_seed(cfg.seed)


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory; build the tiny model with "
                                "`python -m asyncrl.models.tiny DIR` or set model.path to a local HF model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
