"""The PPO update loop the actor and the critic share: epochs × mini-batches × micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from asyncrl.config import PPOUpdateConfig
from asyncrl.metrics import mean_metrics
from asyncrl.single_controller.batch import Batch

# (model, micro-batch) -> (loss of that micro-batch as a mean over its rows, metrics)
MicroLoss = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict]]


SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids")  # prompt + response wide


def micro_batches(batch: Batch, size: int, trim: bool = False) -> list[Batch]:
    """`batch` in micro-batches of `size` rows; `trim` drops each one's padding columns."""
    mbs = batch.split(size) if len(batch) else []  # size >= 1: the config checks it
    return [trim_padding(mb) for mb in mbs] if trim else mbs


def trim_padding(mb: Batch) -> Batch:
    """The micro-batch without columns that are padding in every row: prompt columns before its
    earliest prompt start and response columns after its longest response. Exact for losses
    over masked tokens (a causal model's earlier positions never see later columns); responses
    are right-padded to the generation budget, so long-tailed lengths waste most of a forward."""
    if "responses" not in mb or "response_mask" not in mb or "attention_mask" not in mb:
        return mb
    width = mb["responses"].shape[1]
    prompt = mb["attention_mask"].shape[1] - width
    keep = max(1, int(mb["response_mask"].sum(-1).max()))
    used = mb["attention_mask"][:, :prompt].any(0).nonzero()
    first = int(used[0]) if len(used) else 0
    if keep == width and first == 0:
        return mb
    tensors = {}
    for name, t in mb.tensors.items():
        if name in SEQUENCE_COLUMNS and t.dim() >= 2:
            t = t[:, first:prompt + keep]
        elif name != "prompts" and t.dim() >= 2 and t.shape[1] == width:
            t = t[:, :keep]
        tensors[name] = t
    return Batch._make(tensors, mb.non_tensors, mb.meta)


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

            # pipeline stages exchange activations of one shape: keep the padding there
            mbs = micro_batches(mini, cfg.micro_batch_size, trim=not getattr(engine, "pipelined", False))
            history.append(engine.train_step(mbs, weighted))
    out = mean_metrics(history)
    out.pop("loss", None)
    return out
