"""Rewards: rule-based functions on decoded responses, and model-based reward/cost models.

Both put a sequence's score on its last response token (`token_level_scores`) and also return
the per-sequence `scores`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms.core import scores_to_tokens
from asyncrl.batch import Batch
from asyncrl.parallel import ParallelConfig, ParallelLayout
from asyncrl.protocols import DP_PROTO, ONE_TO_ALL
from asyncrl.rewards import load_reward_fn
from asyncrl.worker import Worker, register
from asyncrl.workers.common import (
    decode_responses,
    micro_batches,
    same_init_on_every_rank,
    setup_process,
)


class RuleRewardWorker(Worker):
    """Scores responses with a rule (`reward.fn`: dotted path, or the built-in dispatch by
    data_source: gsm8k, exact match, the synthetic tasks)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.register_mesh(ParallelLayout.from_config(ParallelConfig(), self.world_size))
        from transformers import AutoTokenizer

        self.cfg = config
        rc = config.get("reward", {})
        self.fn = load_reward_fn(rc.get("fn"))
        self.cost_fn = load_reward_fn(rc["cost_fn"]) if rc.get("cost_fn") else None
        self.tokenizer = AutoTokenizer.from_pretrained(config["model"]["path"])

    @register(DP_PROTO)
    def compute_reward(self, batch: Batch) -> Batch:
        texts = decode_responses(self.tokenizer, batch)
        n = len(texts)
        sources = batch["data_source"] if "data_source" in batch else [""] * n
        truths = batch["ground_truth"] if "ground_truth" in batch else [None] * n
        extras = batch["extra_info"] if "extra_info" in batch else [None] * n
        scores = torch.tensor([float(self.fn(s, t, g, e)) for s, t, g, e in zip(sources, texts, truths, extras, strict=True)])
        out = {"scores": scores, "token_level_scores": scores_to_tokens(scores, batch["response_mask"])}
        if self.cost_fn is not None:
            costs = torch.tensor([float(self.cost_fn(s, t, g, e)) for s, t, g, e in zip(sources, texts, truths, extras, strict=True)])
            out.update(costs=costs, token_level_costs=scores_to_tokens(costs, batch["response_mask"]))
        return Batch(out)


class RewardModelWorker(Worker):
    """A sequence-classification model scoring (prompt, response) at the last real token.

    `output` names the columns it writes: "scores" for a reward model, "costs" for a
    Safe-RLHF cost model.
    """

    def __init__(self, config: dict[str, Any], output: str = "scores") -> None:
        super().__init__()
        self.register_mesh(ParallelLayout.from_config(ParallelConfig(), self.world_size))
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = config
        setup_process(config, self.rank)
        rc = config.get("reward_model" if output == "scores" else "cost_model", {})
        path = rc.get("path") or config["model"]["path"]
        self.output = output
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        same_init_on_every_rank(config)  # a fresh head must score the same on every rank
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()

    @register(DP_PROTO)
    def compute_reward(self, batch: Batch) -> Batch:
        outs = []
        with torch.no_grad():
            for mb in micro_batches(batch, 16):
                logits = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                    position_ids=mb["position_ids"]).logits
                outs.append(logits[:, 0].float())
        scores = torch.cat(outs)
        token_col = "token_level_scores" if self.output == "scores" else "token_level_costs"
        return Batch({self.output: scores, token_col: scores_to_tokens(scores, batch["response_mask"])})

    @register(ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        return str(Path(path))  # frozen: nothing to save

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        return {}
