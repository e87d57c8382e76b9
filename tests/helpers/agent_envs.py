"""Environments for the multi-turn tests (`rollout.multi_turn.env=tests/helpers/agent_envs.py:Name`)."""

from __future__ import annotations

import asyncio

from asyncrl.agents.env import Action, Environment, StepResult


class Countdown(Environment):
    """Answers each turn with the turns left ("sort k k" as a user message) and rewards 1.0 when
    they run out; `latency_s` of simulated tool time per step (a coroutine: no thread held)."""

    def __init__(self, turns: int = 3, latency_s: float = 0.0) -> None:
        self.left, self.latency_s = turns, latency_s

    def reset(self, row: dict) -> None:  # a plain function: runs on the environment pool
        self.row = row

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(self.latency_s)
        self.left -= 1
        if self.left == 0:
            return StepResult(reward=1.0, done=True, info={"tool_calls": 1.0})
        return StepResult(f"sort {self.left} {self.left}", role="user", info={"tool_calls": 1.0})


class CountOnes(Environment):
    """Two turns; the reward is the share of the model's words (both turns) that are "1", so a
    policy can learn it and samples of one prompt differ."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.turns = 0

    def step(self, action: Action) -> StepResult:  # a plain function: runs on the environment pool
        self.words += action.text.split()
        self.turns += 1
        if self.turns == 2:
            return StepResult(reward=self.words.count("1") / max(1, len(self.words)), done=True,
                              info={"ones": float(self.words.count("1"))})  # a number of its own
        return StepResult("sort 1 1", role="user")


class Flaky(Environment):
    """Every other trajectory's first step raises (a model's output the environment cannot parse)."""

    made = 0

    def __init__(self) -> None:
        Flaky.made += 1
        self.breaks = Flaky.made % 2 == 0

    async def step(self, action: Action) -> StepResult:
        if self.breaks:
            raise ValueError(f"cannot parse {action.text!r}")
        return StepResult(reward=1.0, done=True)


class Broken(Environment):
    def step(self, action: Action) -> StepResult:
        raise KeyError("answer")
