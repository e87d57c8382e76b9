"""A run's prompts as the trainer uses them: the tokenizer, the training prompts and their
loader, the held-out prompts (one batch, reused), and the batches each step puts in the
driver's store (`next_prompts`, Safe-RLHF's `pretrain_batch`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from asyncrl.config import RLConfig
from asyncrl.data.config import DataConfig
from asyncrl.data.dataset import positions_from_mask
from asyncrl.preflight import check_round_trip
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.distbatch import DistBatch
from transport.checks import ConfigError


class RunData:
    """The prompts of one run; `ctx` is the job's context (its store holds the batches)."""

    def __init__(self, ctx: Any, cfg: RLConfig) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.tokenizer: Any = None
        self.train_set: Any = None
        self.loader: Any = None  # None when only evaluating a val file
        self.val_prompts: dict[str, Any] | None = None

    def load(self) -> None:
        """Read the tokenizer and the data files (blocking: run it in a thread)."""
        from transformers import AutoTokenizer

        from asyncrl.data.dataset import (
            EXPECTED_COLUMNS,
            DatasetError,
            PromptDataset,
            PromptLoader,
            load_rows,
        )
        from asyncrl.data.images import ImageReader

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        dc = self.cfg.data
        tools = environment_tools(self.cfg.rollout.multi_turn)
        images = ImageReader.of_model(self.cfg.model.path, dc.min_pixels, dc.max_pixels)  # settings: asyncrl.preflight

        def tokenised(where: str, load: Callable[[], list[dict]]) -> PromptDataset | None:
            """The prompts of `load()`'s rows (None for no rows); a bad file or row is a ConfigError."""
            try:
                rows = load()
                return (PromptDataset(rows, self.tokenizer, dc.max_prompt_len, dc.apply_chat_template,
                                      prompt_key=dc.prompt_key, answer_key=dc.answer_key,
                                      require_answer=not self.cfg.reward.model_path, tools=tools, images=images)
                        if rows else None)
            except DatasetError as e:
                raise ConfigError(f"{where}: {e}") from None

        if self.cfg.trainer.mode == "eval" and dc.val_files:  # evaluation: the held-out file only
            self.train_set = None
            val_set = tokenised(f"data.val_files={dc.val_files}", lambda: load_rows(dc.val_files))
            self.val_prompts = val_set.collate(val_set.items) if val_set else None
            return
        if dc.train_files:
            self.train_set = tokenised(f"data.train_files={dc.train_files}", lambda: load_rows(dc.train_files))
            val_set = (tokenised(f"data.val_files={dc.val_files}", lambda: load_rows(dc.val_files))
                       if dc.val_files else None)
        else:
            where, (train, val) = generated_rows(dc)
            self.train_set, val_set = tokenised(where, lambda: train), tokenised(where, lambda: val)
        if self.train_set is None:
            raise ConfigError(f"data.train_files={dc.train_files} holds no rows; a prompt dataset needs "
                              f"rows with {EXPECTED_COLUMNS}")
        check_round_trip(self.tokenizer, self.train_set.items[:8], images.image_token_id if images else None)
        self.val_prompts = val_set.collate(val_set.items) if val_set else None  # one batch, reused
        try:
            self.loader = PromptLoader(self.train_set, dc.batch_size, shuffle=dc.shuffle, seed=self.cfg.seed)
        except DatasetError as e:
            raise ConfigError(f"data.batch_size={dc.batch_size}: {e}") from None

    def put(self, d: dict[str, Any], meta: dict[str, Any]) -> DistBatch:
        """A dict of columns into the driver's store, as a DistBatch."""
        tensors = {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)}
        return self.ctx.put(Batch(tensors, rest, meta))

    def next_prompts(self, step: int, refill: int = 0) -> DistBatch:
        """The step's prompts; `refill` k > 0 is dynamic sampling's k-th extra batch of the step
        (its own seed and group ids). With dynamic sampling every batch is padded to
        data.max_prompt_len, so batches of one step concatenate."""
        seed = self.cfg.seed * 100003 + step
        from asyncrl.data.dataset import pad_prompts

        d = self.loader.next_batch()
        if self.cfg.algorithm.filter_groups.enable:
            d = pad_prompts(d, self.cfg.data.max_prompt_len, self.tokenizer.pad_token_id)
        if refill:  # a seed of its own, apart from every step's first batch
            digest = hashlib.blake2b(f"{self.cfg.seed}:{step}:{refill}".encode(), digest_size=4).digest()
            seed = int.from_bytes(digest, "little") >> 1
            d["uid"] = [f"{u}@{refill}" for u in d["uid"]]  # the same prompt again is another group
        return self.put(d, {"seed": seed, "step": step + 1})  # the training step its rows are for (replay bundles)

    def pretrain_batch(self, step: int) -> DistBatch:
        """Prompt + ground-truth answer sequences for the Safe-RLHF pretrain (SFT) loss term."""
        bs = self.cfg.data.batch_size
        start = (step * bs) % max(1, len(self.train_set))
        items = [self.train_set[(start + i) % len(self.train_set)] for i in range(bs)]
        answers = [self.tokenizer.encode(str(it.ground_truth), add_special_tokens=False) + [self.tokenizer.eos_token_id]
                   for it in items]
        p, r = max(len(it.input_ids) for it in items), max(len(a) for a in answers)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((bs, p + r), pad, dtype=torch.long)
        mask = torch.zeros((bs, p + r), dtype=torch.long)
        for i, (it, a) in enumerate(zip(items, answers, strict=True)):
            ids[i, p - len(it.input_ids):p] = torch.tensor(it.input_ids)
            ids[i, p:p + len(a)] = torch.tensor(a)
            mask[i, p - len(it.input_ids):p + len(a)] = 1
        return self.put({"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
                          "responses": ids[:, p:], "response_mask": mask[:, p:]}, {})


def generated_rows(dc: DataConfig) -> tuple[str, tuple[list[dict], list[dict]]]:
    """The training and held-out rows of a run without data files, and the key that made them:
    data.source's reasoning-gym tasks, else the built-in synthetic task."""
    if dc.source:
        from asyncrl.data.reasoning_gym import make_rows

        return "data.source", make_rows(dc.source, **asdict(dc.reasoning_gym))
    from asyncrl.data.synthetic import disjoint_splits

    syn = dc.synthetic
    return "data.synthetic", disjoint_splits(syn.task, syn.n_train, syn.n_val, syn.seed)


def environment_tools(mt: Any) -> list[dict] | None:
    """The tool descriptions of `rollout.multi_turn`'s environment, for the prompts' chat template
    (None without multi-turn or tools)."""
    from asyncrl.agents.api import is_api_agent
    from asyncrl.agents.tools import load_environment

    if not mt.enable or is_api_agent(mt.env):  # an API agent sends its tools with its requests
        return None

    return load_environment(mt.env)(**mt.env_kwargs).tools_schema()
