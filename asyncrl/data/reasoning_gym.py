"""reasoning-gym's procedural tasks as prompt rows: `data.source=reasoning_gym:<task>[,<task>...]`.

reasoning-gym (`pip install 'asyncrl[gym]'`) generates each task's questions from a seed and
checks answers with the task's own scorer. The rows made here are in verl's layout (the question
as chat messages, `reward_model.ground_truth`, `data_source` = `reasoning_gym/<task>`), so they
take the path data files take (`asyncrl.run_data.RunData`); `extra_info["reasoning_gym"]`
holds what the built-in reward needs to score a response with the task's own scorer
(`asyncrl.rewards.reasoning_gym`): the generator's settings, the row's index and its entry
(question, answer, metadata) made JSON-safe.

The held-out rows are disjoint from the training rows by seed: reasoning-gym draws a task's row i
from `Random(seed + i)`, so a task's n training rows use the seeds seed ... seed + n - 1 and its
held-out generator starts at seed + n. A task with few distinct questions (two one-digit terms
make 200) still asks some of the same questions in both splits; the load logs how many.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from transport.checks import ConfigError

if TYPE_CHECKING:  # the config module imports this one for its checks
    from asyncrl.data.config import ReasoningGymConfig

log = logging.getLogger(__name__)

SOURCE_PREFIX = "reasoning_gym:"  # data.source
DATA_SOURCE_PREFIX = "reasoning_gym/"  # a row's data_source: the built-in reward dispatches on it
INSTALL = "pip install 'asyncrl[gym]'"
GENERATOR_KEYS = ("size", "seed")  # data.reasoning_gym sets these for every task
LIST_TASKS = 'python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))"'
GYM_TASK = "reasoning_gym"  # model.build_tiny.task: a tiny model for data.source's tasks
# tasks whose scorer runs eval() on the model's answer (reasoning-gym 0.1.25): model-written code
# outside the sandbox, so they are refused
EVAL_SCORERS = frozenset({"binary_matrix", "spiral_matrix", "string_insertion", "n_queens"})


def gym() -> Any:
    """The reasoning_gym package, or a ConfigError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.source names reasoning-gym tasks but reasoning-gym is not installed here: "
                          f"{INSTALL}") from None
    return reasoning_gym


def registered() -> dict[str, tuple[type, type]]:
    """reasoning-gym's tasks by name: (dataset class, config class). `composite` is left out:
    data.source lists the tasks to mix itself."""
    gym()
    from reasoning_gym.factory import DATASETS

    return {name: classes for name, classes in DATASETS.items() if name != "composite"}


def source_tasks(source: str) -> list[str]:
    """The task names of `reasoning_gym:a,b` (spaces around a name ignored)."""
    return [name.strip() for name in source.removeprefix(SOURCE_PREFIX).split(",")]


def is_gym_source(source: str | None) -> bool:
    return bool(source) and source.startswith(SOURCE_PREFIX)


# ---- checks: the config's own `check` calls these ----------------------------------------------


def check_source(at: str, source: str, cfg: ReasoningGymConfig) -> None:
    """`source` (data.source) names known reasoning-gym tasks, once each, and `cfg`
    (data.reasoning_gym) sets only their settings, each as the task's own config accepts."""
    names = source_tasks(source)
    if not is_gym_source(source) or not all(names):
        raise ConfigError(f"bad configuration: {at}source={source!r}: must look like {SOURCE_PREFIX}<task>[,<task>...], "
                          f"e.g. {SOURCE_PREFIX}chain_sum,basic_arithmetic (on the command line quote a list: "
                          f"'{at}source=\"{SOURCE_PREFIX}chain_sum,basic_arithmetic\"')")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"bad configuration: {at}source={source!r} names {', '.join(twice)} more than once; "
                          "name each task once (the tasks share data.reasoning_gym.size equally)")
    known = registered()
    for name in names:
        if name not in known:
            raise ConfigError(_unknown_task(f"{at}source={source!r}", name, known))
        if name in EVAL_SCORERS:
            raise ConfigError(f"bad configuration: {at}source={source!r}: {name}'s scorer runs eval() on the model's "
                              "answer, which would run model-written code outside the sandbox; choose another task "
                              "(or score it with a reward.fn of your own that parses the answer)")
    for name, settings in cfg.tasks.items():
        key = f"{at}reasoning_gym.tasks.{name}"
        if name not in names:
            raise ConfigError(f"bad configuration: {key}: {name} is not in {at}source ({', '.join(names)}); add it "
                              "there or remove its settings")
        _check_settings(key, name, settings, known[name][1])
    if cfg.size < len(names):
        raise ConfigError(f"bad configuration: {at}reasoning_gym.size={cfg.size}: fewer training rows than the "
                          f"{len(names)} tasks of {at}source; raise it")


def _unknown_task(key: str, name: str, known: dict) -> str:
    close = difflib.get_close_matches(name, list(known), n=5, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else f"no name of its {len(known)} tasks is close."
    return f"bad configuration: {key}: reasoning-gym has no task {name!r}; {hint} All of them: {LIST_TASKS}"


def _check_settings(key: str, task: str, settings: dict, config_cls: type) -> None:
    """Each setting is a field of the task's config class, and the class's own `validate` passes."""
    valid = [f.name for f in fields(config_cls) if f.name not in GENERATOR_KEYS]
    for name in settings:
        if name in GENERATOR_KEYS:
            raise ConfigError(f"bad configuration: {key}.{name}: set for every task by data.reasoning_gym.{name}; "
                              "remove it here")
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
            raise ConfigError(f"bad configuration: {key}.{name}: {task} has no setting {name!r}"
                              + (f"; did you mean {close[0]}?" if close else ".")
                              + f" Its settings: {', '.join(valid)}")
    try:
        config = config_cls(**settings)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(f"bad configuration: {key}={settings}: reasoning-gym's {config_cls.__name__} refuses "
                          f"these settings ({e or type(e).__name__})") from None


def check_system_prompt(key: str, name: str) -> None:
    """`name` is one of reasoning-gym's system prompts."""
    gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name not in SYSTEM_PROMPTS:
        raise ConfigError(f"bad configuration: {key}={name!r}: must name one of reasoning-gym's system prompts: "
                          f"{', '.join(SYSTEM_PROMPTS)} (or be null for none)")


# ---- rows ---------------------------------------------------------------------------------------


def make_rows(source: str, *, size: int, n_val: int, seed: int, tasks: dict[str, dict],
              system_prompt: str | None) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of `source`'s tasks (data.reasoning_gym's fields as keywords),
    the tasks interleaved so that every stretch of rows mixes them."""
    names = source_tasks(source)
    system = _system_prompt(system_prompt)
    train, val = [], []
    for name, n_train, n_held in zip(names, _shares(size, len(names)), _shares(n_val, len(names)), strict=True):
        settings = dict(tasks.get(name, {}))
        train.append(task_rows(name, {**settings, "size": n_train, "seed": seed}, "train", system))
        val.append(task_rows(name, {**settings, "size": n_held, "seed": seed + n_train}, "test", system))
    train, val = _interleave(train), _interleave(val)
    asked = {_question(r) for r in train}
    log.info("reasoning-gym %s: %d training rows, %d held-out (%d of these ask a question some training row "
             "asks too)", ",".join(names), len(train), len(val), sum(_question(r) in asked for r in val))
    return train, val


def task_rows(task: str, settings: dict, split: str, system: str | None) -> list[dict]:
    """Rows 0 .. size-1 of `task`'s generator built with `settings` (its config, size and seed)."""
    if settings["size"] == 0:
        return []
    settings = json_safe(settings)
    ds = dataset(task, settings)
    return [_row(task, ds[i], i, settings, split, system) for i in range(settings["size"])]


def _row(task: str, entry: dict, index: int, settings: dict, split: str, system: str | None) -> dict:
    messages = [{"role": "user", "content": entry["question"]}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    answer = entry["answer"]
    return {
        "data_source": DATA_SOURCE_PREFIX + task,
        "prompt": messages,
        "ability": "reasoning_gym",
        # a task that accepts many answers (graph_color, rush_hour, ...) has none; its scorer checks
        "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
        "extra_info": {"split": split, "index": index,
                       "reasoning_gym": {"settings": settings, "index": index, "entry": json_safe(entry)}},
    }


def dataset(task: str, settings: dict) -> Any:
    """The generator of `task` with `settings` (one object per task and settings in a process:
    some build tables or load word lists when made)."""
    return _dataset(task, json.dumps(settings, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _dataset(task: str, settings_json: str) -> Any:
    return gym().create_dataset(task, **json.loads(settings_json))


@functools.lru_cache(maxsize=8192)
def _entry(task: str, settings_json: str, index: int) -> dict:
    return _dataset(task, settings_json)[index]


def generated_entry(task: str, settings: dict, index: int) -> dict:
    """Row `index` of `task`'s generator as reasoning-gym made it (tuples and all), cached."""
    return _entry(task, json.dumps(settings, sort_keys=True), index)


def json_safe(value: Any) -> Any:
    """`value` as JSON gives it back: tuples become lists, anything else JSON cannot hold its str."""
    return json.loads(json.dumps(value, default=str))


def row_words(rows: list[dict]) -> list[str]:
    """Every whitespace-separated word of `rows`' messages and answers, sorted: a word-level
    tokenizer over them covers the rows exactly (the tiny model's vocabulary)."""
    texts = [m["content"] for r in rows for m in r["prompt"]] + [r["reward_model"]["ground_truth"] for r in rows]
    return sorted({word for text in texts for word in text.split()})


def _system_prompt(name: str | None) -> str | None:
    if name is None:
        return None
    gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS[name]


def _shares(total: int, k: int) -> list[int]:
    """`total` split into `k` near-equal parts, the larger ones first."""
    return [total // k + (i < total % k) for i in range(k)]


def _interleave(groups: list[list[dict]]) -> list[dict]:
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def _question(row: dict) -> str:
    return row["prompt"][-1]["content"]
