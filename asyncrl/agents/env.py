"""The environment API of multi-turn rollouts: reset with a dataset row, then one step per model turn.

    class Guess(Environment):
        async def reset(self, row):
            self.secret = int(row["ground_truth"])
        async def step(self, action):
            guess = int(action.text.split()[-1])
            if guess == self.secret:
                return StepResult("correct", reward=1.0, done=True)
            return StepResult("higher" if guess < self.secret else "lower")

`reset` and `step` may be plain functions: they then run on a thread of a bounded pool, off the
rollout's event loop. One environment object serves one trajectory (a new one per trajectory).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Action:
    """One model turn: exactly the token ids the engine generated, and their text."""

    token_ids: tuple[int, ...]
    text: str


@dataclass
class StepResult:
    """The environment's answer to a turn.

    `observation` is the text of the message that comes back (rendered by the chat template as
    a message of `role`), or "" for none; `images` (a vision-language policy: PIL images, encoded
    bytes or paths) come with it, as image parts before its text; `reward` adds to the
    trajectory's environment reward; `done` ends the trajectory; `info` counts go into the
    rollout's metrics (numbers only)."""

    observation: str = ""
    reward: float | None = None
    done: bool = False
    role: str = "tool"
    info: dict[str, float] = field(default_factory=dict)
    images: Sequence[Any] = ()


class Environment:
    """Base class: override `reset` and `step` (async or plain)."""

    def reset(self, row: dict[str, Any]) -> None:
        """Start a trajectory for this row (`ground_truth`, `data_source`, `extra_info`, `raw_prompt`)."""

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(action) -> StepResult")

    def tools_schema(self) -> list[dict] | None:
        """Tool descriptions for the chat template's `tools=` (None: no tools)."""
        return None


async def call(pool: Any, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, awaited if it is a coroutine function, else on a thread of `pool`."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
