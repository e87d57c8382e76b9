"""`rollout.multi_turn`: trajectories of several turns between the model and an environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from asyncrl.single_controller.schema import choices_of
from transport.checks import check, check_positive

Schedule = Annotated[str, Literal["per_trajectory", "lockstep"]]
SCHEDULES = choices_of(Schedule)


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts: the model acts, an environment (tools, a game, a user simulator)
    answers, until it says done or a budget runs out (`asyncrl.agents`)."""

    enable: bool = False
    """Roll out trajectories of turns instead of one response per prompt."""
    env: str = "python_tool"
    """The environment: a built-in name (`python_tool`: Python code run in the sandbox through
    Hermes-style `<tool_call>` tags) or `path/to/file.py:Class` (an `asyncrl.agents.Environment`)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""
    max_turns: int = 4
    """Model turns per trajectory at most (the last turn's observation is not appended). All
    turns' tokens, the model's and the observations', share the response budget rollout.max_tokens."""
    max_turn_tokens: int = 0
    """Tokens the model may generate in one turn; 0 = what is left of the response budget."""
    max_observation_tokens: int = 256
    """An observation longer than this is cut to its first tokens."""
    step_timeout_s: float = 30.0
    """An environment step that takes longer ends the trajectory with an error observation."""
    schedule: Schedule = "per_trajectory"
    """per_trajectory: a turn is decoded as soon as its trajectory asks (others may be waiting on
    their environment); lockstep: every live trajectory's turn t is decoded together, before any
    turn t + 1 (TRL's GRPOTrainer; the baseline of `benchmarks.agentic_rl`)."""
    concurrency: int = 64
    """Environment steps running at once per rollout worker (sync environments: threads)."""

    def check(self, at: str) -> None:
        check(bool(self.env), at + "env", self.env, "name a built-in environment or path/to/file.py:Class")
        check_positive(at + "max_turns", self.max_turns)
        check_positive(at + "max_turn_tokens", self.max_turn_tokens, allow_zero=True)
        check_positive(at + "max_observation_tokens", self.max_observation_tokens)
        check_positive(at + "step_timeout_s", self.step_timeout_s)
        check_positive(at + "concurrency", self.concurrency)
