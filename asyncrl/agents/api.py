"""Rollouts driven by code that talks to the policy over the OpenAI API (`rollout.multi_turn.env`
`agent:path/to/file.py:fn` or `verifiers:path/to/file.py:load_environment`).

For each rollout the worker serves its engine behind an `asyncrl.serve.OpenAIServer` on
loopback (a fresh key per rollout), runs the agent once per trajectory on its dataset row
(`messages`: the prompt's chat messages; `ground_truth`, `data_source`, `extra_info`;
`raw_prompt`: the rendered text) with an official `openai.AsyncOpenAI` client whose every
request carries the trajectory's id (`X-Trajectory-Id`), and records every choice the endpoint
returns. A trajectory's calls become one row of the same
masked batch the built-in multi-turn loop makes (`assemble`): the first call's prompt is the
row's prompt; each later call's prompt must extend an earlier call's prompt and generated ids
token for token — the extension (the environment's messages, rendered by the chat template) is
an observation (mask 0), the call's generated ids are trained (mask 1) with their sampling
log-probs and versions. A call whose prompt extends no earlier one (a client that rewrote
history, or re-tokenised text) starts a new branch (the n choices of one request are sibling
branches, not splits): the trajectory is split, never re-tokenised;
the row is the branch of the last call, and the split and the generated tokens left out are
counted (`agent/api_splits_mean`, `agent/api_dropped_tokens_mean`). The agent's return value is
the trajectory's reward (`env_reward`).

    # my_agent.py                                       rollout.multi_turn.env=agent:my_agent.py:solve
    async def solve(client, model, row):
        reply = await client.chat.completions.create(model=model, messages=row["messages"])
        return float(reply.choices[0].message.content.strip() == row["ground_truth"])
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import secrets
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.rollout import EnvironmentStepError, Trajectory, TurnGenerator
from asyncrl.serve.backend import ChoiceRecord
from asyncrl.serve.http import Limits
from transport.checks import ConfigError

log = logging.getLogger(__name__)
KINDS = ("agent", "verifiers")


@dataclass
class _Call:
    """One recorded choice placed in its trajectory's tree: `parent` is the call whose prompt and
    generated ids its prompt extends (None: a root), `observation` the ids in between."""

    record: ChoiceRecord
    parent: _Call | None
    observation: list[int]
    full: list[int] = field(default_factory=list)  # prompt_ids + token_ids


def _extended(calls: list[_Call], prompt: list[int]) -> _Call | None:
    """The call whose whole context `prompt` extends, the longest if several (None: none does)."""
    best = None
    for c in calls:
        if len(c.full) <= len(prompt) and prompt[:len(c.full)] == c.full and (best is None or len(c.full) > len(best.full)):
            best = c
    return best


def assemble(records: list[ChoiceRecord], budget: int, max_prompt: int | None = None) -> Trajectory | None:
    """One trajectory's calls (in the order they finished) as the built-in loop's `Trajectory`:
    the branch that ends at the last call whose branch's prompt fits `max_prompt` (the batch's
    prompt width), cut to `budget` tokens after its prompt; None when no branch fits."""
    calls: list[_Call] = []
    for rec in records:
        parent = _extended(calls, rec.prompt_ids)
        observation = list(rec.prompt_ids[len(parent.full):] if parent is not None else rec.prompt_ids)
        calls.append(_Call(rec, parent, observation, [*rec.prompt_ids, *rec.token_ids]))
    chains = [_chain(c) for c in reversed(calls)]
    chain = next((ch for ch in chains if max_prompt is None or len(ch[0].observation) <= max_prompt), None)
    if chain is None:
        return None
    traj = Trajectory(chain[0].observation)
    for i, c in enumerate(chain):
        if i:
            traj.add(c.observation, False)
        traj.add(list(c.record.token_ids), True, list(c.record.logprobs), list(c.record.versions))
    generated = sum(len(r.token_ids) for r in records)
    kept = sum(len(c.record.token_ids) for c in chain)
    traj.counts.update(api_calls=float(len(records)), api_splits=float(len({c.record.request_id for c in calls if c.parent is None}) - 1),
                       api_dropped_tokens=float(generated - kept), api_truncated_tokens=0.0)
    return _cut(traj, budget)


def _chain(call: _Call) -> list[_Call]:
    """The calls from `call`'s root to it."""
    chain = []
    while call is not None:
        chain.append(call)
        call = call.parent
    return chain[::-1]


def _cut(traj: Trajectory, budget: int) -> Trajectory:
    """The trajectory's first `budget` tokens after the prompt (the batch's response width)."""
    extra = len(traj.tokens) - budget
    if extra > 0:
        traj.counts["api_truncated_tokens"] = float(extra)
        for name in ("tokens", "mask", "logprobs", "versions"):
            setattr(traj, name, getattr(traj, name)[:budget])
    return traj


class ApiRollout:
    """`MultiTurnRollout`'s interface for agents that call the policy over the OpenAI API."""

    def __init__(self, spec: str, kwargs: dict[str, Any], tokenizer: Any, model_name: str,
                 concurrency: int, timeout_s: float, context_length: int | None = None) -> None:
        self.agent = load_agent(spec, kwargs)
        self.tokenizer, self.model_name, self.context_length = tokenizer, model_name, context_length
        self.concurrency, self.timeout_s = concurrency, timeout_s

    def rollout(self, prompts: list[list[int]], rows: list[dict[str, Any]], n: int,
                generate: TurnGenerator, budget: int) -> list[Trajectory]:
        """`n` trajectories per row (interleaved like single-turn samples), on an event loop of
        their own (the worker method runs on a thread); the endpoint lives as long as the call."""
        return asyncio.run(self._all(prompts, rows, n, generate, budget))

    async def _all(self, prompts: list[list[int]], rows: list[dict[str, Any]], n: int,
                   generate: TurnGenerator, budget: int) -> list[Trajectory]:
        from asyncrl.serve.server import OpenAIServer

        records: dict[str, list[ChoiceRecord]] = defaultdict(list)
        key, run = secrets.token_urlsafe(24), secrets.token_hex(4)
        gate = asyncio.Semaphore(self.concurrency)
        width = max(map(len, prompts))  # the batch's prompt width: a branch must start within it
        server = OpenAIServer(_TrainerSampling(generate), self.tokenizer, model_name=self.model_name, api_key=key,
                              recorder=lambda r: records[r.trajectory_id].append(r),
                              limits=Limits(max_tokens=budget), context_length=self.context_length)
        async with server:
            async def one(i: int, k: int) -> Trajectory:
                tid = f"{run}-{i}-{k}"
                async with gate:
                    reward, error = await self._drive(server.url, key, tid, rows[i], generate)
                traj = assemble(records.pop(tid, []), budget, width) or Trajectory(list(prompts[i]))
                traj.error = error
                if error is None:
                    traj.reward(reward)
                else:
                    traj.counts["env_errors"] = 1.0
                return traj

            trajs = await asyncio.gather(*(one(i, k) for i in range(len(rows)) for k in range(n)))
        if trajs and all(t.error for t in trajs):
            raise EnvironmentStepError(f"every agent run raised (first: {trajs[0].error}); fix the agent")
        return trajs

    async def _drive(self, url: str, key: str, tid: str, row: dict[str, Any],
                     generate: TurnGenerator) -> tuple[float | None, str | None]:
        """Run the agent on one row with a client bound to trajectory `tid`: (reward, error)."""
        from openai import AsyncOpenAI

        generate.begin(1)
        client = AsyncOpenAI(base_url=url, api_key=key, max_retries=0, default_headers={"X-Trajectory-Id": tid})
        try:
            reward = await asyncio.wait_for(self.agent(client, self.model_name, row), self.timeout_s)
            return _reward(reward), None
        except Exception as e:  # the agent's failure ends its trajectory (counted), the rest go on
            log.warning("agent run for trajectory %s raised %s: %s", tid, type(e).__name__, e)
            return None, f"{type(e).__name__}: {e}"
        finally:
            generate.retire()
            await client.close()


class _TrainerSampling:
    """The backend an agent trains through: the job's sampling settings hold whatever a request
    asks (the trainer scores the tokens at the job's temperature, so the rollout's log-probs must
    be under it too); a request's own temperature, top-p or seed is ignored, with one warning."""

    def __init__(self, generate: TurnGenerator) -> None:
        self.generate, self.params, self.warned = generate, getattr(generate, "params", None), False

    async def __call__(self, ids: list[int], max_tokens: int, sampling: Any = None) -> tuple[list[int], list[float], list[int]]:
        if sampling is not None and any(v is not None for v in vars(sampling).values()) and not self.warned:
            self.warned = True
            log.warning("an agent's request asks for its own sampling (%s); training samples with the job's "
                        "rollout settings instead", sampling)
        return await self.generate(ids, max_tokens)


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the agent returned a reward of {value!r}; return a finite number or None")
    return reward


def load_agent(spec: str, kwargs: dict[str, Any]) -> Any:
    """The coroutine `agent(client, model, row) -> reward` that `spec` names:
    `agent:path/to/file.py:fn` (that function, called with `kwargs` bound if any) or
    `verifiers:path/to/file.py:load_environment` (a verifiers environment: its rollout against
    the endpoint, its rubric's reward)."""
    from functools import partial

    from asyncrl.agents.tools import load_environment

    kind, _, target = spec.partition(":")
    if kind not in KINDS or not target:
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: an API-driven agent is "
                          f"{' or '.join(k + ':path/to/file.py:name' for k in KINDS)}")
    fn = load_environment(target)
    if kind == "verifiers":
        from asyncrl.agents.verifiers_env import environment_agent

        return environment_agent(fn, kwargs)  # built with verifiers' signal handlers kept off the worker's
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: {target} must be an async function "
                          "(client, model, row) -> reward")
    return partial(fn, **kwargs) if kwargs else fn


def is_api_agent(spec: str) -> bool:
    """Whether `rollout.multi_turn.env` names an API-driven agent rather than an `Environment`."""
    return spec.partition(":")[0] in KINDS
