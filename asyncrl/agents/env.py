"""The environment API of multi-turn rollouts: reset with a dataset row, then one step per model turn.

    class Guess(Environment):
        async def reset(self, row):
            self.secret = int(row["reward_model"]["ground_truth"])
        async def step(self, action):
            guess = int(action.text.split()[-1])
            if guess == self.secret:
                return StepResult("correct", reward=1.0, done=True)
            return StepResult("higher" if guess < self.secret else "lower")

`reset` and `step` may be plain functions: they then run on a thread of a bounded pool, off the
rollout's event loop. One environment object serves one trajectory (a new one per trajectory).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemons.errors import ConfigError


@dataclass(frozen=True)
class Action:
    """One model turn: exactly the token ids the engine generated, and their text."""

    token_ids: tuple[int, ...]
    text: str


@dataclass
class StepResult:
    """The environment's answer to a turn.

    `observation` is the text of the message that comes back (rendered by the chat template as
    a message of `role`), or "" for none; `reward` adds to the trajectory's environment reward;
    `done` ends the trajectory; `info` counts go into the rollout's metrics (numbers only)."""

    observation: str = ""
    reward: float | None = None
    done: bool = False
    role: str = "tool"
    info: dict[str, float] = field(default_factory=dict)


class Environment:
    """Base class: override `reset` and `step` (async or plain)."""

    def reset(self, row: dict[str, Any]) -> None:
        """Start a trajectory for this dataset row (its prompt, `reward_model`, `extra_info`)."""

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(action) -> StepResult")

    def tools_schema(self) -> list[dict] | None:
        """Tool descriptions for the chat template's `tools=` (None: no tools)."""
        return None


def load_environment(spec: str, kwargs: dict[str, Any] | None = None) -> type[Environment] | Any:
    """The environment factory `spec` names: a built-in name or `path/to/file.py:Class`."""
    from asyncrl.agents.tools import BUILTIN_ENVIRONMENTS

    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: not a built-in environment "
                          f"({', '.join(sorted(BUILTIN_ENVIRONMENTS))}) and not path/to/file.py:Class")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: no file {file.resolve()}")
    module_name = f"asyncrl_env_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        loader.loader.exec_module(module)
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: {file} has no class or function {name!r}")
    return factory


async def call(pool: Any, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, awaited if it is a coroutine function, else on a thread of `pool`."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
