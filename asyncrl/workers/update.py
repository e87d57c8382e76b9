"""The PPO update loop the actor and the critic share: epochs × mini-batches × micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from asyncrl.batch import Batch
from asyncrl.config import PPOUpdateConfig
from asyncrl.metrics import mean_metrics

# (model, micro-batch) -> (loss of that micro-batch as a mean over its rows, metrics)
MicroLoss = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict]]


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    return batch.split(size) if len(batch) else []  # size >= 1: the config checks it


def mini_batches(batch: Batch, n: int, shuffle: bool, generator: torch.Generator | None) -> Iterator[Batch]:
    """`n` mini-batches of this rank's rows covering every row (sizes differ by at most one)."""
    rows = len(batch)
    order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
    for idx in torch.tensor_split(order, max(1, min(n, rows))):
        if len(idx):
            yield batch.take(idx)


def ppo_update(engine, batch: Batch, cfg: PPOUpdateConfig, loss: MicroLoss,
               generator: torch.Generator) -> dict[str, float]:
    """`cfg.ppo_epochs` passes over `batch` in `cfg.ppo_mini_batches` optimizer steps each; each
    step accumulates gradients over micro-batches weighted by their share of the mini-batch.
    Returns the metrics averaged over the optimizer steps (`grad_norm`, `lr` included)."""
    history = []
    for _ in range(cfg.ppo_epochs):
        for mini in mini_batches(batch, cfg.ppo_mini_batches, cfg.shuffle, generator):
            rows = len(mini)

            def weighted(model: torch.nn.Module, mb: Batch, rows: int = rows) -> tuple[torch.Tensor, dict]:
                value, metrics = loss(model, mb)
                return value * (len(mb) / rows), metrics

            history.append(engine.train_step(micro_batches(mini, cfg.micro_batch_size), weighted))
    out = mean_metrics(history)
    out.pop("loss", None)
    return out
