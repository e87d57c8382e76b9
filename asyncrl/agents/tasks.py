"""Built-in tasks that need a tool: `lookup`, which the tiny CPU model learns to solve with one.

`lookup c a f` asks for a digit that only the tool knows (a hash of the key,
`asyncrl.data.synthetic.lookup_value`). A turn whose first word is `call` calls the tool, and
its answer comes back as the next message; any other turn is the final answer, rewarded 1.0 when
its first word is the digit (what follows the first word is not read: an answer `3 call` is the
answer 3). Without the tool a model is right one time in ten.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

from asyncrl.agents.env import Action, Environment, StepResult
from asyncrl.data.synthetic import LETTERS, lookup_value

CALL = "call"


class LookupEnvironment(Environment):
    """The `lookup` task's tool: a turn that starts with `call` looks the prompt's key up. `latency_ms` > 0
    makes each tool call wait a log-normal time of that median (σ = 1), as a remote tool would
    (`benchmarks.agentic_rl` sweeps it); the waits are seeded by `seed` and the key."""

    def __init__(self, latency_ms: float = 0.0, seed: int = 0) -> None:
        self.latency_s, self.seed = latency_ms / 1000, seed
        self.calls = 0

    def reset(self, row: dict[str, Any]) -> None:
        self.truth = str(row.get("ground_truth", ""))
        self.key = _key(row)
        self.rng = random.Random(f"{self.seed}:{self.key}")

    async def step(self, action: Action) -> StepResult:
        words = action.text.split()
        if words[:1] == [CALL]:
            if self.latency_s:
                await asyncio.sleep(self.latency_s * self.rng.lognormvariate(0.0, 1.0))
            return StepResult(lookup_value(self.key) if self.key else "unknown key", role="user",
                              info={"tool_calls": 1.0})
        return StepResult(reward=float(bool(words) and words[0] == self.truth), done=True,
                          info={"tool_calls": 0.0})


def _key(row: dict[str, Any]) -> str:
    """The key of a `lookup a b c` prompt, from the row's raw prompt (its last user message)."""
    prompt = row.get("raw_prompt") or row.get("prompt") or ""
    if isinstance(prompt, list):
        prompt = next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")
    words = str(prompt).split()
    if "lookup" not in words:
        return ""
    rest = words[words.index("lookup") + 1:]
    return " ".join(itertools.takewhile(lambda w: w in LETTERS, rest))


def lookup_demonstration(prompt: str, answer_digits: list[str], call: bool) -> list[dict[str, str]]:
    """A conversation of the task's format for the warm start: with `call`, the tool is called and
    its answer shown, then a digit; the digits are given (random ones teach the format only)."""
    messages = [{"role": "user", "content": prompt}]
    if call:
        key = prompt.split(maxsplit=1)[1]
        messages += [{"role": "assistant", "content": CALL}, {"role": "user", "content": lookup_value(key)}]
    return messages + [{"role": "assistant", "content": answer_digits[0]}]
