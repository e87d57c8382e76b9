"""Rewards: rule-based functions on decoded responses, and model-based reward/cost models.

Both put a sequence's score on its last response token (`token_level_scores`) and also return
the per-sequence `scores`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms.core import overlong_penalty, response_span, scores_to_tokens
from asyncrl.config import RLConfig, rl_config
from asyncrl.metrics import timed
from asyncrl.rewards import (
    REWARD_EXTRA,
    NonFiniteRewardError,
    RewardFn,
    checked_score,
    load_reward_fn,
)
from asyncrl.roles.forward import decode_responses, sequence_scores
from asyncrl.roles.process import check_node_paths, same_init_on_every_rank, setup_process
from asyncrl.roles.update import micro_batches
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
from asyncrl.single_controller.protocols import DP_PROTO, LOCAL_ROWS, ONE_TO_ALL
from asyncrl.single_controller.worker import Worker, register
from asyncrl.train.fsdp import compute_dtype
from asyncrl.train.packing import resolve_packing


class RuleRewardWorker(Worker):
    """Scores responses with a rule (`reward.fn`: dotted path, or the built-in dispatch by
    data_source: gsm8k, exact match, the synthetic tasks)."""

    def __init__(self, config: RLConfig | dict[str, Any]) -> None:
        super().__init__()
        self.register_mesh(ParallelLayout.from_config(ParallelConfig(), self.world_size))
        from transformers import AutoTokenizer

        self.cfg = cfg = rl_config(config)
        check_node_paths(cfg)
        self.fn = load_reward_fn(cfg.reward.fn)
        self.cost_fn = load_reward_fn(cfg.reward.cost_fn) if cfg.reward.cost_fn else None
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)

    @register(LOCAL_ROWS)  # each rank scores the rows its own store holds
    @timed("reward")
    def compute_reward(self, batch: Batch) -> Batch:
        if not len(batch):  # this rank holds none of the rows
            return Batch()
        texts = decode_responses(self.tokenizer, batch)
        mask = batch["response_mask"]
        scores, extras = self._score(self.fn, f"reward.fn={self.cfg.reward.fn}" if self.cfg.reward.fn else
                                     "the built-in reward (reward.fn=null: by data_source)", texts, batch,
                                     batched=self.cfg.reward.batched)
        if "env_reward" in batch:  # a multi-turn environment's reward, where it gave one, is the score
            env = batch["env_reward"].to(scores.device)
            scores = torch.where(torch.isfinite(env), env, scores)
        rc, lengths = self.cfg.reward, response_span(batch)
        if rc.overlong_buffer > 0:
            penalty = overlong_penalty(lengths, self.cfg.rollout.max_tokens, rc.overlong_buffer,
                                       rc.overlong_penalty_factor)
            scores = scores + penalty
            extras[REWARD_EXTRA + "overlong_penalty"] = penalty
        out = {"scores": scores, "token_level_scores": scores_to_tokens(scores, mask), **extras,
               # responses cut by the budget, not ended by the model (logged as response/clip_ratio)
               "response_clipped": (lengths >= self.cfg.rollout.max_tokens).float()}
        if self.cost_fn is not None:
            costs, _ = self._score(self.cost_fn, f"reward.cost_fn={self.cfg.reward.cost_fn}", texts, batch)
            out.update(costs=costs, token_level_costs=scores_to_tokens(costs, mask))
        return Batch(out)

    @staticmethod
    def _score(fn: RewardFn, name: str, texts: list[str], batch: Batch,
               batched: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One checked score per row, on the device of the batch (a Batch's tensors share one),
        and the numeric extras of functions that return a dict (`{"score": s, "acc": a, ...}`,
        verl's convention) as `REWARD_EXTRA + key` columns (NaN where a row lacks the key).
        `batched`: one call with lists of every field (`fn(data_sources, solution_strs,
        ground_truths, extra_infos)`) returning one value per row."""
        n = len(texts)
        column = {k: batch[k] if k in batch else [None] * n for k in ("data_source", "ground_truth", "extra_info",
                                                                       "raw_prompt")}
        returned = None
        if batched:
            returned = fn([s or "" for s in column["data_source"]], texts, list(column["ground_truth"]),
                          list(column["extra_info"]))
            if not isinstance(returned, (list, tuple)) or len(returned) != n:
                got = f"{len(returned)} values" if isinstance(returned, (list, tuple)) else type(returned).__name__
                raise NonFiniteRewardError(f"{name} (reward.batched=true) returned {got} for {n} responses; a batched "
                                           "reward returns one score (or dict) per response, in order")
        values, extras = [], {}
        for i, text in enumerate(texts):
            source, truth, extra = column["data_source"][i] or "", column["ground_truth"][i], column["extra_info"][i]
            row = {"row": i, "data_source": source, "ground_truth": truth, "prompt": column["raw_prompt"][i],
                   "response": text}
            if row["prompt"] is None:
                del row["prompt"]
            value = returned[i] if returned is not None else fn(source, text, truth, extra)
            if isinstance(value, dict):
                value = split_reward_dict(value, name, row, i, n, extras)
            values.append(checked_score(value, name, row))
        device = batch["response_mask"].device
        return (torch.tensor(values, dtype=torch.float32, device=device),
                {REWARD_EXTRA + k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in extras.items()})


def split_reward_dict(value: dict, name: str, row: dict, i: int, n: int, extras: dict[str, list[float]]) -> Any:
    """A dict-returning reward's "score", its numeric other entries recorded in `extras` (row i
    of n); text and other non-numeric entries are not logged."""
    if "score" not in value:
        raise NonFiniteRewardError(f"{name} returned a dict without a 'score' entry (keys {sorted(value)}) for row "
                                   f"{row['row']}; return a number, or a dict with 'score' and extra metrics such "
                                   "as {'score': 1.0, 'acc': True}")
    for key, extra in value.items():
        if key != "score" and isinstance(extra, (bool, int, float)) and re.fullmatch(r"\w+", str(key)):
            extras.setdefault(key, [math.nan] * n)[i] = float(extra)
    return value["score"]


class RewardModelWorker(Worker):
    """A sequence-classification model scoring (prompt, response) at the last real token.

    `output` names the columns it writes: "scores" for a reward model, "costs" for a
    Safe-RLHF cost model (`cost_model.path`; the actor's model with a fresh head when unset).
    """

    def __init__(self, config: RLConfig | dict[str, Any], output: str = "scores", path: str | None = None) -> None:
        super().__init__()
        self.register_mesh(ParallelLayout.from_config(ParallelConfig(), self.world_size))
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg = rl_config(config)
        setup_process(cfg, self.rank)
        path = path or cfg.model.path
        self.output = output
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        same_init_on_every_rank(cfg)  # a fresh head must score the same on every rank
        # forward only: stored and run in the compute dtype (bf16 on a GPU by default)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=compute_dtype(self.device, cfg.model.dtype))
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()  # pulled batches arrive on self.device (Worker._run)
        resolve_packing(self.model, None, "reward.")  # rows packed where the model can (exact)
        self.name = f"the {'reward' if output == 'scores' else 'cost'} model {path}"

    @register(DP_PROTO)
    @timed("reward_model")
    def compute_reward(self, batch: Batch) -> Batch:
        outs = []
        with torch.no_grad():
            for mb in micro_batches(batch, self.cfg.cost_model.micro_batch_size):
                logits = sequence_scores(self.model, mb)
                outs.append(logits[:, 0].float())
        scores = torch.cat(outs)
        bad = (~torch.isfinite(scores)).nonzero()
        if len(bad):
            i = int(bad[0])
            checked_score(float(scores[i]), self.name, {"row": i, "response": decode_responses(
                self.tokenizer, batch.slice(i, i + 1))[0]})
        token_col = "token_level_scores" if self.output == "scores" else "token_level_costs"
        return Batch({self.output: scores, token_col: scores_to_tokens(scores, batch["response_mask"])})

    @register(ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        return str(Path(path))  # frozen: nothing to save

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        return {}
