"""The `data` section of the RL config (asyncrl.config.RLConfig): prompts from files in verl's
layout, or a built-in synthetic task (asyncrl/data/synthetic.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from daemons.errors import ConfigError
from daemons.errors import check as _check
from daemons.errors import check_one_of as _one_of
from daemons.errors import check_positive as _positive


def synthetic_tasks() -> tuple[str, ...]:
    """asyncrl.data.synthetic's tasks, imported when checked (the schema loads no generator)."""
    from asyncrl.data.synthetic import TASKS

    return tuple(TASKS)



@dataclass
class SyntheticDataConfig:
    task: str = "sort"
    n_train: int = 4096
    n_val: int = 128
    seed: int = 0

    def check(self, at: str) -> None:
        _one_of(at + "task", self.task, synthetic_tasks())
        _positive(at + "n_train", self.n_train)
        _positive(at + "n_val", self.n_val, allow_zero=True)


@dataclass
class DataConfig:
    train_files: str | None = None  # parquet/jsonl (verl layout); None = the built-in synthetic task
    val_files: str | None = None
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    batch_size: int = 32  # prompts per step
    max_prompt_len: int = 32
    apply_chat_template: bool = True
    shuffle: bool = True
    prompt_key: str = "prompt"  # the column holding the prompt (a string or chat messages)
    # the column holding the reference answer, dotted for nested ones; None = verl's
    # reward_model.ground_truth, or a flat ground_truth or answer column
    answer_key: str | None = None

    def check(self, at: str) -> None:
        _positive(at + "batch_size", self.batch_size)
        _positive(at + "max_prompt_len", self.max_prompt_len)
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            _check(value is None or bool(value.strip()), at + name, value,
                   "must name a .parquet or .jsonl file (or be null for the built-in synthetic task)")
        for name in ("prompt_key", "answer_key"):
            value = getattr(self, name)
            _check(value is None or re.fullmatch(r"\w+(\.\w+)*", value) is not None, at + name, value,
                   "must be a column name (dotted for a nested field, e.g. reward_model.ground_truth)")

    def check_val_only(self, at: str, mode: str) -> None:
        if self.val_files and not self.train_files and mode != "eval":
            raise ConfigError(f"bad configuration: {at}val_files={self.val_files!r} is set but {at}train_files "
                              "is not, so training would use the built-in synthetic task and ignore it; set "
                              f"{at}train_files too (or {at}val_files=null)")
