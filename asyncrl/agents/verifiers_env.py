"""verifiers environments (the `verifiers` package's v0 API: `SingleTurnEnv`, `MultiTurnEnv`,
`ToolEnv`, ...) as asyncrl agents, and their datasets as asyncrl prompt files.

    # my_env.py                          rollout.multi_turn.env=verifiers:my_env.py:load_environment
    import verifiers as vf

    def load_environment(**kwargs):
        return vf.SingleTurnEnv(dataset=..., rubric=vf.Rubric(funcs=[correct]))

    # its dataset as the run's prompts:  write_verifiers_data(load_environment(), "train.jsonl")
    #                                    data.train_files=train.jsonl

Each trajectory is one `Environment.run_rollout` in the worker: the environment's own loop (turns,
tools, `env_response`), every request sent through the `openai.AsyncOpenAI` client `ApiRollout`
hands the agent (so each carries the trajectory's `X-Trajectory-Id` and is recorded), then the
environment's rubric scores the rollout; that score is the trajectory's reward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transport.checks import ConfigError

log = logging.getLogger(__name__)

Agent = Callable[[Any, str, dict[str, Any]], Awaitable[float]]
COLUMNS = "verifiers_columns"  # extra_info key: the dataset's columns besides prompt, answer and info
LENGTH_KEYS = ("max_tokens", "max_completion_tokens")
INERT = {"n": 1, "extra_body": {}}  # verifiers' own defaults in `Environment.sampling_args`
# A model that ends its turn at once is not an error of the environment: its rollout is scored.
POLICY_ERRORS = ("EmptyModelResponseError",)
_building = threading.Lock()


class VerifiersRolloutError(RuntimeError):
    """verifiers stopped a rollout with an error (a request the endpoint refused, a tool in the
    environment's `stop_errors`, ...): the trajectory is not trained on."""


def _verifiers() -> Any:
    """The `verifiers` package, with the v0 names this module uses."""
    try:
        import verifiers as vf
        from verifiers.clients import OpenAIChatCompletionsClient  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"a verifiers environment needs the verifiers package ({e}): pip install verifiers "
                          "(asyncrl is tested with verifiers==0.3.1, whose v0 API answers at verifiers.*)") from None
    return vf


def environment_agent(load_environment: Callable[..., Any], kwargs: dict[str, Any]) -> Agent:
    """`verifiers_agent(load_environment(**kwargs))`, safe where asyncrl builds agents: off the
    main thread, in a worker that owns its signal handlers (see `_signals_untouched`)."""
    vf = _verifiers()
    with _building, _signals_untouched(vf):
        env = load_environment(**kwargs)
    return verifiers_agent(env)


@contextmanager
def _signals_untouched(vf: Any) -> Iterator[None]:
    """While an environment is built, verifiers' `signal.signal` does nothing.

    `Environment.__post_init__` installs SIGINT/SIGTERM handlers (its teardown, then exit 143):
    off the main thread `signal.signal` raises ValueError, and on it they would replace the
    worker's own. Its teardown still runs at exit (verifiers registers it with atexit too)."""
    module = sys.modules.get(vf.Environment.__module__)
    if getattr(module, "signal", None) is not signal:
        yield
        return
    module.signal = _QuietSignals()
    try:
        yield
    finally:
        module.signal = signal


class _QuietSignals:
    """The `signal` module, but `signal.signal` leaves the handler as it is."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signum: int, handler: Any) -> Any:
        return signal.getsignal(signum)


def verifiers_agent(env: Any) -> Agent:
    """The agent `(client, model, row) -> reward` that runs one rollout of `env` per trajectory.

    Requests go through verifiers' `OpenAIChatCompletionsClient` wrapped around the given
    client, so each carries its trajectory header. They ask for no sampling settings (verifiers
    needs none) but the environment's own `max_tokens`: the endpoint then samples with the
    trainer's temperature, top-p and top-k, so the recorded log-probs are the policy's; the other
    settings in `env.sampling_args` (temperature, ...) are dropped, with a warning.

    The reward is the rubric's. A rollout verifiers stopped with an error raises
    `VerifiersRolloutError` (`ApiRollout` counts the trajectory and trains none of it), except a
    reply with no text: that is the policy's answer, and its score stands."""
    vf = _verifiers()
    from verifiers.clients import OpenAIChatCompletionsClient

    _check_environment(env, vf)
    sampling = _sampling_args(env)

    async def agent(client: Any, model: str, row: dict[str, Any]) -> float:
        output = await env.run_rollout(rollout_input(row), OpenAIChatCompletionsClient(client), model, dict(sampling))
        return _reward(output)

    return agent


def _check_environment(env: Any, vf: Any) -> None:
    """Refuse, before any rollout, an environment whose rollouts asyncrl could not score."""
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"load_environment returned a {type(env).__name__}, not a verifiers Environment "
                          "(vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv, ...)")
    if not env.score_rollouts:
        raise ConfigError(f"{type(env).__name__} was built with score_rollouts=False: its rubric would not run "
                          "and every reward would be 0; build it with score_rollouts=True")
    for rubric in _leaf_rubrics(env.rubric):
        names = [getattr(f, "__name__", repr(f)) for f in rubric.funcs]
        if rubric.has_group_rewards:
            raise ConfigError(f"{type(rubric).__name__} has group reward functions ({', '.join(names)}): asyncrl "
                              "scores each trajectory on its own (GRPO groups them in the trainer); write "
                              "per-rollout functions (completion, answer, state, ... -> float)")
        if not names and type(rubric).score_rollout is vf.Rubric.score_rollout:
            raise ConfigError(f"{type(env).__name__}'s rubric has no reward function; pass "
                              "rubric=vf.Rubric(funcs=[your_reward])")


def _leaf_rubrics(rubric: Any) -> list[Any]:
    inner = getattr(rubric, "rubrics", None)  # a RubricGroup
    return [leaf for r in inner for leaf in _leaf_rubrics(r)] if inner is not None else [rubric]


def _sampling_args(env: Any) -> dict[str, Any]:
    """The environment's turn-length bound from `env.sampling_args`, nothing else."""
    asked = dict(env.sampling_args or {})
    dropped = sorted(k for k, v in asked.items() if k not in LENGTH_KEYS and v is not None and INERT.get(k) != v)
    if dropped:
        log.warning("%s asks for sampling settings %s; asyncrl ignores them: the trainer's rollout settings "
                    "sample every trajectory", type(env).__name__, dropped)
    return {k: asked[k] for k in LENGTH_KEYS if asked.get(k) is not None}


def rollout_input(row: dict[str, Any]) -> dict[str, Any]:
    """verifiers' `RolloutInput` of an asyncrl row (`messages`: the prompt's chat messages,
    `ground_truth`, `extra_info`): the dataset's other columns come back from where
    `verifiers_rows` put them. No `task`: verifiers reads one as a serialized task payload, not a name."""
    prompt = row.get("messages")
    if not isinstance(prompt, list):
        raise TypeError(f"row['messages'] is a {type(prompt).__name__}: a verifiers environment takes the "
                        "prompt as chat messages ([{role, content}, ...]), as the data file's prompt holds them")
    info = dict(row.get("extra_info") or {})
    columns = dict(info.pop(COLUMNS, None) or {})
    truth = row.get("ground_truth")
    example_id = columns.get("example_id")
    return {**columns, "prompt": prompt, "answer": "" if truth is None else str(truth), "info": info,
            "example_id": _prompt_id(prompt) if example_id is None else int(example_id)}


def _prompt_id(prompt: list[dict[str, Any]]) -> int:
    """An example id for a row written elsewhere: one per prompt, as verifiers' examples have."""
    return int(hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:12], 16)


def _reward(output: dict[str, Any]) -> float:
    error = output.get("error")
    if error and error.get("error") not in POLICY_ERRORS:
        raise VerifiersRolloutError(f"the verifiers rollout stopped with {error.get('error_chain_repr') or error}")
    return float(output["reward"])


def verifiers_rows(env: Any, split: str = "train", n: int | None = None) -> list[dict[str, Any]]:
    """The environment's dataset (`split` "train" or "eval", the first `n` rows) in asyncrl's
    data layout; its columns besides prompt, answer and info travel in `extra_info`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: 'train' or 'eval'")
    get = env.get_dataset if split == "train" else env.get_eval_dataset
    try:
        dataset = get(n=-1 if n is None else n)
    except ValueError as e:
        raise ConfigError(f"{type(env).__name__} has no {split} dataset ({e}); pass dataset= (train) or "
                          "eval_dataset= when building it") from None
    source = f"verifiers/{getattr(env, 'env_id', '') or type(env).__name__}"
    return [_row(record, source) for record in dataset.to_list()]


def _row(record: dict[str, Any], source: str) -> dict[str, Any]:
    info = record.get("info") or {}
    info = json.loads(info) if isinstance(info, str) else dict(info)
    columns = {k: v for k, v in record.items() if k not in ("prompt", "answer", "info")}
    answer = record.get("answer")
    return {"prompt": record["prompt"], "reward_model": {"ground_truth": "" if answer is None else answer},
            "data_source": source, "extra_info": {**info, COLUMNS: columns}}


def write_verifiers_data(env: Any, path: str | Path, split: str = "train", n: int | None = None) -> Path:
    """Write `verifiers_rows(env, split, n)` as a .jsonl file for `data.train_files` / `data.val_files`."""
    out = Path(path)
    if out.suffix not in (".jsonl", ".ndjson"):
        raise ValueError(f"{out}: write a .jsonl file")
    lines = []
    for i, row in enumerate(verifiers_rows(env, split, n)):
        try:
            lines.append(json.dumps(row))
        except TypeError as e:
            raise ValueError(f"row {i} of {row['data_source']} is not JSON ({e}); make its columns plain values") from None
    out.write_text("".join(line + "\n" for line in lines))
    return out
