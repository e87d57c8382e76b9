"""The PPO update loop the actor and the critic share: epochs × mini-batches × micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from asyncrl.config import PPOUpdateConfig
from asyncrl.metrics import mean_metrics
from asyncrl.single_controller.batch import Batch

# (model, micro-batch) -> (loss of that micro-batch as a mean over its rows, metrics)
MicroLoss = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict]]


SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids",  # prompt + response wide
                    "routed_experts", "old_routed_experts")


def row_micro_batches(batch: Batch, max_rows: int, max_tokens: int = 0
                      ) -> tuple[list[Batch], Callable[[list[torch.Tensor]], torch.Tensor]]:
    """Micro-batches of `batch` for a forward-only pass with per-row outputs [rows_i, width_i],
    and how to join those outputs back into the batch's rows: by tokens when `max_tokens` > 0
    (`token_micro_batches`: sorted, trimmed; outputs padded back and unpermuted), else `max_rows`
    rows in order."""
    if max_tokens and len(batch):
        mbs, order = token_micro_batches(batch, max_tokens, max_rows)
        width = batch["responses"].shape[1]
        return mbs, lambda parts: unpermute(parts, order, width)
    return micro_batches(batch, max_rows), torch.cat


def micro_batches(batch: Batch, size: int, trim: bool = False) -> list[Batch]:
    """`batch` in micro-batches of `size` rows; `trim` drops each one's padding columns."""
    mbs = batch.split(size) if len(batch) else []  # size >= 1: the config checks it
    return [trim_padding(mb) for mb in mbs] if trim else mbs


def token_micro_batches(batch: Batch, max_tokens: int, max_rows: int) -> tuple[list[Batch], torch.Tensor]:
    """`batch` in micro-batches of at most `max_tokens` tokens each, padding counted (rows x the
    longest prompt + the longest response among them, the shape `trim_padding` leaves) and at most
    `max_rows` rows: rows sorted longest first and packed greedily, so rows of similar length
    share a micro-batch; a row longer than `max_tokens` goes alone. Returns the trimmed
    micro-batches and the row order they hold (`batch.take(order)` concatenated)."""
    prompt_len, response_len = _row_lengths(batch)
    order = torch.argsort(prompt_len + response_len, descending=True, stable=True)
    groups: list[list[int]] = []
    widest_prompt = widest_response = 0
    for i in order.tolist():
        p, r = int(prompt_len[i]), int(response_len[i])
        if groups:
            wp, wr = max(widest_prompt, p), max(widest_response, r)
            if len(groups[-1]) < max_rows and (len(groups[-1]) + 1) * (wp + wr) <= max_tokens:
                groups[-1].append(i)
                widest_prompt, widest_response = wp, wr
                continue
        groups.append([i])
        widest_prompt, widest_response = p, r
    mbs = [trim_padding(batch.take(torch.tensor(g))) for g in groups]
    return mbs, torch.tensor([i for g in groups for i in g], dtype=torch.long)


def _row_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt tokens and response tokens."""
    width = batch["responses"].shape[1]
    prompt = batch["attention_mask"][:, :batch["attention_mask"].shape[1] - width].sum(-1)
    return prompt, batch["response_mask"].sum(-1)


def unpermute(parts: list[torch.Tensor], order: torch.Tensor, width: int) -> torch.Tensor:
    """Per-row outputs [rows_i, width_i] of `token_micro_batches`' micro-batches back in the
    batch's row order, right-padded with zeros to `width` columns."""
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts]
    out = torch.cat(padded)
    return out[torch.argsort(order)]


def micro_weight(mb: Batch, mini: Batch, loss_agg_mode: str) -> float:
    """The share of `mini`'s loss that micro-batch `mb` carries when its loss is a mean over its
    own tokens (token-mean: its share of the response tokens) or rows (the seq-mean modes)."""
    if loss_agg_mode == "token-mean":
        return float(mb["response_mask"].sum()) / max(1.0, float(mini["response_mask"].sum()))
    return len(mb) / len(mini)


def trim_padding(mb: Batch) -> Batch:
    """The micro-batch without columns that are padding in every row: prompt columns before its
    earliest prompt start and response columns after its longest response. Exact for losses
    over masked tokens (a causal model's earlier positions never see later columns); responses
    are right-padded to the generation budget, so long-tailed lengths waste most of a forward."""
    if "responses" not in mb or "response_mask" not in mb or "attention_mask" not in mb:
        return mb
    width = mb["responses"].shape[1]
    prompt = mb["attention_mask"].shape[1] - width
    trained = mb["response_mask"].any(0).nonzero()  # the last column any row trains on (masks may have holes)
    keep = int(trained[-1]) + 1 if len(trained) else 1
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
            by_tokens = cfg.max_tokens_per_micro_batch > 0  # then the loss is that of one pass over `mini`
            if by_tokens:
                mbs, _ = token_micro_batches(mini, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size)
            else:  # pipeline stages exchange activations of one shape: keep the padding there
                mbs = micro_batches(mini, cfg.micro_batch_size, trim=not getattr(engine, "pipelined", False))

            def weighted(model: torch.nn.Module, mb: Batch, mini: Batch = mini, by_tokens: bool = by_tokens
                         ) -> tuple[torch.Tensor, dict]:
                value, metrics = loss(model, mb)
                share = micro_weight(mb, mini, cfg.loss_agg_mode) if by_tokens else len(mb) / len(mini)
                return value * share, metrics

            history.append(engine.train_step(mbs, weighted))
    out = mean_metrics(history)
    out.pop("loss", None)
    return out
