"""Worker process setup shared by the RL workers: threads, the process group, seeds, model loading."""

from __future__ import annotations

import os
import random
import socket

import numpy as np
import torch

from asyncrl.algorithms.registry import needs_critic
from asyncrl.config import ConfigError, RLConfig
from asyncrl.single_controller.memory import workers_on_node
from asyncrl.train import init_distributed


def check_node_paths(cfg: RLConfig) -> None:
    """The files a worker opens, on the node it runs on: the model directories (`model.path`
    as the driver resolved it, and the critic's, cost model's and reward model's) and a reward
    file. A multi-node job needs them at the same path on every node; a missing one is a
    ConfigError naming this node (not a minute of Hugging Face Hub retries)."""
    dirs = {"model.path": cfg.model.path, "reward.model_path": cfg.reward.model_path}
    if needs_critic(cfg.algorithm.name):
        dirs["critic.model_path"] = cfg.critic.model_path
    if cfg.cost_model.enable:
        dirs["cost_model.path"] = cfg.cost_model.path
    missing = [f"{key}={path}" for key, path in dirs.items() if path and not os.path.isdir(os.path.expanduser(path))]
    for key in ("fn", "cost_fn"):
        spec = getattr(cfg.reward, key)
        file = spec.rpartition(":")[0] if spec and ":" in spec else ""
        if file.endswith(".py") and not os.path.isfile(os.path.expanduser(file)):
            missing.append(f"reward.{key}={spec}")
    if missing:
        raise ConfigError(f"on node {socket.gethostname()}: {', '.join(missing)} not found here; every node of a "
                          "multi-node job needs the model, reward and data files at the same path (a shared "
                          "filesystem, or a copy on each node)")


def setup_process(cfg: RLConfig, rank: int) -> None:
    """torch threads per worker (cores are shared by the node's devices: a pool of one worker
    beside another pool gets its device's share, not the node's), distributed init, seeds."""
    check_node_paths(cfg)
    torch.set_num_threads(cfg.trainer.torch_threads or max(1, (os.cpu_count() or 1) // workers_on_node()))
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
    from transformers import AutoConfig

    from asyncrl.train.load import lm_class

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory; build the tiny model with "
                                "`python -m asyncrl.models.tiny DIR` or set model.path to a local HF model")
    return lm_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=getattr(torch, dtype))
