"""The PPO update loop the actor and the critic share: epochs × mini-batches × micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from asyncrl.config import PPOUpdateConfig
from asyncrl.data.images import IMAGE_INPUTS, ROPE
from asyncrl.metrics import mean_metrics
from asyncrl.single_controller.balance import karmarkar_karp
from asyncrl.single_controller.batch import Batch
from asyncrl.train.packing import SEQUENCE_COLUMNS, is_packing
from asyncrl.train.ulysses import turn_loss
from transport import trace

# (model, micro-batch) -> (loss of that micro-batch as a mean over its rows, metrics)
MicroLoss = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict]]


def row_micro_batches(batch: Batch, max_rows: int, max_tokens: int = 0, packed: bool = False
                      ) -> tuple[list[Batch], Callable[[list[torch.Tensor]], torch.Tensor]]:
    """Micro-batches of `batch` for a forward-only pass with per-row outputs [rows_i, width_i],
    and how to join those outputs back into the batch's rows: by tokens when `max_tokens` > 0
    (`token_micro_batches`: outputs padded back and unpermuted), else `max_rows` rows in order."""
    if max_tokens and len(batch):
        mbs, order = token_micro_batches(batch, max_tokens, max_rows, packed, agree=agreed_count)
        width = batch["responses"].shape[1]
        return mbs, lambda parts: unpermute(parts, order, width)
    return micro_batches(batch, max_rows), torch.cat


def micro_batches(batch: Batch, size: int, trim: bool = False) -> list[Batch]:
    """`batch` in micro-batches of `size` rows; `trim` drops each one's padding columns."""
    mbs = batch.split(size) if len(batch) else []  # size >= 1: the config checks it
    return [trim_padding(mb) for mb in mbs] if trim else mbs


def token_micro_batches(batch: Batch, max_tokens: int, max_rows: int, packed: bool = False,
                        agree: Callable[[int], int] | None = None) -> tuple[list[Batch], torch.Tensor]:
    """`batch` in micro-batches of at most `max_tokens` tokens and `max_rows` rows each.

    Packed (`packed`: the model runs each micro-batch as one row without padding) a micro-batch's
    tokens are its rows' own, and the rows are split into the fewest micro-batches that fit,
    balanced by tokens (Karmarkar–Karp). Padded, a micro-batch costs rows x (the longest prompt
    + the longest response among them), the shape `trim_padding` leaves: rows sorted longest
    first and packed greedily, so rows of similar length share one. A row over the budget goes
    alone (the config refuses budgets below the longest row a run can make). `agree(count)`
    returns the count every rank of the group uses (data-parallel ranks must run the same
    number of forwards: each one gathers the sharded weights). Returns the trimmed micro-batches
    and the row order they hold (`batch.take(order)` concatenated)."""
    prompt_len, response_len = _row_lengths(batch)
    if packed:
        groups = _packed_groups((prompt_len + response_len).tolist(), max_tokens, max_rows)
    else:
        groups = _padded_groups(prompt_len.tolist(), response_len.tolist(), max_tokens, max_rows)
    if agree is not None:
        count = agree(len(groups))
        if count > len(groups):
            groups = (_packed_groups((prompt_len + response_len).tolist(), max_tokens, max_rows, count) if packed
                      else _split_to(groups, count))
    mbs = [trim_padding(batch.take(torch.tensor(g))) for g in groups]
    return mbs, torch.tensor([i for g in groups for i in g], dtype=torch.long)


def _packed_groups(lengths: list[int], max_tokens: int, max_rows: int, at_least: int = 1) -> list[list[int]]:
    """The fewest (>= `at_least`) token-balanced sets of rows within the budgets."""
    n = len(lengths)
    count = max(at_least, -(-sum(lengths) // max_tokens), -(-n // max_rows))
    while True:
        sets = [s for s in karmarkar_karp(lengths, min(count, n)) if s]
        fits = all(len(s) <= max_rows and (len(s) == 1 or sum(lengths[i] for i in s) <= max_tokens) for s in sets)
        if (fits and len(sets) >= min(at_least, n)) or count >= n:
            return sets
        count += 1


def _padded_groups(prompt_len: list[int], response_len: list[int], max_tokens: int, max_rows: int
                   ) -> list[list[int]]:
    """Rows longest first, greedily into micro-batches whose padded shape fits the budgets."""
    order = sorted(range(len(prompt_len)), key=lambda i: -(prompt_len[i] + response_len[i]))
    groups: list[list[int]] = []
    widest_prompt = widest_response = 0
    for i in order:
        p, r = prompt_len[i], response_len[i]
        if groups:
            wp, wr = max(widest_prompt, p), max(widest_response, r)
            if len(groups[-1]) < max_rows and (len(groups[-1]) + 1) * (wp + wr) <= max_tokens:
                groups[-1].append(i)
                widest_prompt, widest_response = wp, wr
                continue
        groups.append([i])
        widest_prompt, widest_response = p, r
    return groups


def _split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` split (the one with the most rows, in halves) until there are `count` of them."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        big = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[big]) < 2:
            raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, groups))} rows")
        g = groups.pop(big)
        groups[big:big] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


def agreed_count(count: int) -> int:
    """The largest `count` over the ranks of this process group (a collective; `count` alone
    outside a distributed run)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with trace.span("all_reduce micro-batch count", "collective"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


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
        elif name == ROPE:  # [rows, 3, sequence]
            t = t[:, :, first:prompt + keep]
        elif name != "prompts" and name not in IMAGE_INPUTS and t.dim() >= 2 and t.shape[1] == width:
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
                mbs, _ = token_micro_batches(mini, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size,
                                             packed=is_packing(engine.model), agree=agreed_count)
            else:  # pipeline stages exchange activations of one shape: keep the padding there
                mbs = micro_batches(mini, cfg.micro_batch_size, trim=not engine.pipelined)

            def weighted(model: torch.nn.Module, mb: Batch, mini: Batch = mini, by_tokens: bool = by_tokens
                         ) -> tuple[torch.Tensor, dict]:
                value, metrics = loss(model, mb)
                share = micro_weight(mb, mini, cfg.loss_agg_mode) if by_tokens else len(mb) / len(mini)
                return value * share, metrics

            history.append(engine.train_step(*turn_loss(engine.model, mbs, weighted)))
    out = mean_metrics(history)
    out.pop("loss", None)
    return out
