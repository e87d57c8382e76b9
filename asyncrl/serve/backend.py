"""What crosses the endpoint's boundary: the sampling a request asks for, the backend that
generates, and the record of every choice the endpoint returned.

The endpoint knows no engine. It calls a `Backend`: the multi-turn rollout's `TurnGenerator`
shape (`asyncrl.agents.rollout.WaveGenerator` over a `RolloutEngine`, `BatcherGenerator` over a
`ContinuousBatcher`) with the request's `Sampling` as a keyword. Each finished choice goes to a
`Recorder` before the client sees it, so a trainer can group calls into trajectories (by
`trajectory_id`) and train on exactly the ids and log-probs the model produced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from asyncrl.rollout.params import SamplingParams

Generation = tuple[list[int], list[float], list[int]]  # token ids, their log-probs, the policy version of each


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings; None keeps the backend's own (`Backend.params`)."""

    temperature: float | None = None  # 0: greedy (log-probs then reported at temperature 1)
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; 0 or -1: off
    seed: int | None = None  # a generator of the request's own instead of the backend's shared one

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the settings this request gives in place of its own."""
        asked = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                 "top_k": None if self.top_k is None else max(self.top_k, 0)}
        return replace(params, **{k: v for k, v in asked.items() if v is not None})

    def shared(self) -> Sampling | None:
        """The settings requests must share to decode together (all but the seed); None: the backend's."""
        rest = replace(self, seed=None)
        return None if rest == Sampling() else rest

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """A generator seeded with `seed` on `device`, or None when the request gives no seed."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


class Backend(Protocol):
    """One sample per call: the ids that follow `ids` (at most `max_tokens`, ending at an end
    token or the budget), their log-probs (under `log_softmax(logits / T)` of the temperature
    that sampled them, 1 when greedy: `asyncrl.rollout.engine`'s convention) and versions."""

    params: SamplingParams  # the defaults a request's `Sampling` overrides

    async def __call__(self, ids: list[int], max_tokens: int, sampling: Sampling | None = None) -> Generation: ...


@dataclass(frozen=True)
class ChoiceRecord:
    """One choice as the model produced it and the client received it (after a stop string cut
    it): what a trainer needs to rebuild a trajectory's tokens without re-tokenizing text."""

    trajectory_id: str | None  # the X-Trajectory-Id header, else the request's `user`, else None
    request_id: str  # the response's `id`, shared by the choices of one request
    index: int  # the choice's `index` in the response
    model: str
    prompt_ids: list[int]  # the prompt as the model saw it (the chat template applied)
    token_ids: list[int]  # the generated ids the response carries (an end token included)
    logprobs: list[float]
    versions: list[int]  # the policy version that produced each token
    finish_reason: str  # "stop" (an end token or a stop string) or "length"
    temperature: float  # the log-probs are under log_softmax(logits / temperature)


# Called for every choice before its response is sent (awaited when it returns an awaitable); a
# recorder that raises fails the request with a 500: a call is answered only once it is recorded.
Recorder = Callable[[ChoiceRecord], Awaitable[None] | None]
