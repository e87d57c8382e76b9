"""The `data` section of the RL config (asyncrl.config.RLConfig): prompts from files in verl's
layout, reasoning-gym's procedural tasks (asyncrl/data/reasoning_gym.py), or a built-in synthetic
task (asyncrl/data/synthetic.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from asyncrl.data.reasoning_gym import GYM_TASK, check_source, check_system_prompt
from transport.checks import ConfigError
from transport.checks import check as _check
from transport.checks import check_one_of as _one_of
from transport.checks import check_positive as _positive


def synthetic_tasks() -> tuple[str, ...]:
    """asyncrl.data.synthetic's tasks, imported when checked (the schema loads no generator)."""
    from asyncrl.data.synthetic import TASKS

    return tuple(TASKS)


def tiny_model_tasks() -> tuple[str, ...]:
    """What `model.build_tiny.task` may name: a synthetic task, or `reasoning_gym` (a vocabulary
    and warm start made from data.source's reasoning-gym rows)."""
    return (*synthetic_tasks(), GYM_TASK)


@dataclass
class SyntheticDataConfig:
    task: str = "sort"  # the built-in task when no files or source are given (asyncrl.data.synthetic)
    n_train: int = 4096  # training rows generated
    n_val: int = 128  # held-out rows generated
    seed: int = 0  # the generator's seed

    def check(self, at: str) -> None:
        _one_of(at + "task", self.task, synthetic_tasks())
        _positive(at + "n_train", self.n_train)
        _positive(at + "n_val", self.n_val, allow_zero=True)


@dataclass
class ReasoningGymConfig:
    """`data.source=reasoning_gym:<task>[,<task>...]`: rows drawn from reasoning-gym's generators.
    The held-out rows are disjoint from the training rows by seed: each task's held-out generator
    starts at the seed after its training rows' last (asyncrl/data/reasoning_gym.py)."""

    size: int = 10000  # training rows, shared equally by data.source's tasks
    n_val: int = 200  # held-out rows (evaluated greedily every trainer.eval_every), shared alike; 0 = none
    seed: int = 0  # the training generators' seed; the held-out ones start where the training rows end
    # per-task settings of reasoning-gym's config class, e.g. {chain_sum: {min_terms: 2, max_terms: 3}};
    # a task not listed here takes reasoning-gym's defaults (size and seed come from above)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    # a system message before each question: a name from reasoning_gym.utils.SYSTEM_PROMPTS
    # ("default", "DeepSeekZero", "direct", ...: ask for the answer in <answer> tags); None = none
    system_prompt: str | None = None

    def check(self, at: str) -> None:
        _positive(at + "size", self.size)
        _positive(at + "n_val", self.n_val, allow_zero=True)
        _positive(at + "seed", self.seed, allow_zero=True)
        if self.system_prompt is not None:
            check_system_prompt(at + "system_prompt", self.system_prompt)


@dataclass
class DataConfig:
    train_files: str | None = None  # parquet/jsonl (verl layout); None = data.source, else the synthetic task
    val_files: str | None = None  # held-out rows for evaluation, same layout; None = none with train_files
    # generated rows instead of files: "reasoning_gym:<task>[,<task>...]" (pip install 'asyncrl[gym]'),
    # set up in data.reasoning_gym; None = data.train_files, or the built-in synthetic task
    source: str | None = None
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    batch_size: int = 32  # prompts per step
    max_prompt_len: int = 32  # prompts longer than this many tokens are dropped
    apply_chat_template: bool = True  # render chat-message prompts with the tokenizer's template
    shuffle: bool = True  # a new order of the training rows each epoch
    prompt_key: str = "prompt"  # the column holding the prompt (a string or chat messages)
    # the column holding the reference answer, dotted for nested ones; None = verl's
    # reward_model.ground_truth, or a flat ground_truth or answer column
    answer_key: str | None = None
    # a vision-language model's images are resized to hold this many pixels at least / at most
    # (None = its image processor's own); their tokens count toward max_prompt_len
    min_pixels: int | None = None
    max_pixels: int | None = None

    def check(self, at: str) -> None:
        _positive(at + "batch_size", self.batch_size)
        _positive(at + "max_prompt_len", self.max_prompt_len)
        for name in ("min_pixels", "max_pixels"):
            if getattr(self, name) is not None:
                _positive(at + name, getattr(self, name))
        if self.min_pixels is not None and self.max_pixels is not None:
            _check(self.min_pixels <= self.max_pixels, at + "min_pixels", self.min_pixels,
                   f"must be at most {at}max_pixels={self.max_pixels}")
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            _check(value is None or bool(value.strip()), at + name, value,
                   "must name a .parquet or .jsonl file (or be null for the built-in synthetic task)")
        for name in ("prompt_key", "answer_key"):
            value = getattr(self, name)
            _check(value is None or re.fullmatch(r"\w+(\.\w+)*", value) is not None, at + name, value,
                   "must be a column name (dotted for a nested field, e.g. reward_model.ground_truth)")
        self._check_source(at)

    def _check_source(self, at: str) -> None:
        """data.source against the files (one or the other) and data.reasoning_gym (its tasks)."""
        if self.source is None:
            _check(not self.reasoning_gym.tasks, at + "reasoning_gym.tasks", self.reasoning_gym.tasks,
                   f"only applies with {at}source=reasoning_gym:<task>[,<task>...]; set that (or remove these)")
            return
        _check(not (self.train_files or self.val_files), at + "source", self.source,
               f"replaces {at}train_files and {at}val_files; set those to null (or {at}source=null)")
        check_source(at, self.source, self.reasoning_gym)

    def check_val_only(self, at: str, mode: str) -> None:
        if self.val_files and not self.train_files and mode != "eval":
            raise ConfigError(f"bad configuration: {at}val_files={self.val_files!r} is set but {at}train_files "
                              "is not, so training would use the built-in synthetic task and ignore it; set "
                              f"{at}train_files too (or {at}val_files=null)")
