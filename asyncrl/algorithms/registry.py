"""The table of algorithms: `algorithm.name` -> its step and what it needs. The config check, the
trainer and the planner all read it. A new algorithm is a step function and one entry: here, or
from a package of yours through the `asyncrl.algorithms` entry-point group (`name =
"your_pkg.module:ALGORITHM"`, an `Algorithm`), which driver and workers alike read."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

Step = Callable[..., Awaitable[dict[str, float]]]


@dataclass(frozen=True)
class Algorithm:
    step_path: str  # "module:function": async (roles, cfg, ctl, prompts, **data) -> metrics
    needs_critic: bool = False
    needs_pretrain: bool = False  # takes a `pretrain=` batch (Safe-RLHF's SFT term)
    needs_teacher: bool = False  # a teacher worker group scores the samples (`teacher.*`)
    # the actor method a step calls once, as its last weight update: the next step's generation
    # may be sent right behind it (rollout.launch_next_early); None: only after the step
    last_update: str | None = None

    @property
    def step(self) -> Step:
        """The step function (imported on first use: the config check needs only the table)."""
        module, _, name = self.step_path.partition(":")
        return getattr(importlib.import_module(module), name)


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm("asyncrl.algorithms.ppo:ppo_step", needs_critic=True, last_update="update_actor"),
    "grpo": Algorithm("asyncrl.algorithms.grpo:grpo_step", last_update="update_actor"),
    "rloo": Algorithm("asyncrl.algorithms.grpo:rloo_step", last_update="update_actor"),
    "reinforce_pp": Algorithm("asyncrl.algorithms.grpo:reinforce_pp_step", last_update="update_actor"),
    "remax": Algorithm("asyncrl.algorithms.remax:remax_step", last_update="update_actor"),
    "safe_rlhf": Algorithm("asyncrl.algorithms.ppo:safe_rlhf_step", needs_critic=True, needs_pretrain=True),
    "opd": Algorithm("asyncrl.algorithms.opd:opd_step", needs_teacher=True, last_update="update_actor"),
}


ENTRY_POINT_GROUP = "asyncrl.algorithms"
_loaded = False


def algorithms() -> dict[str, Algorithm]:
    """The table, with the installed packages' entry points added (once)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in ALGORITHMS:
                ALGORITHMS[ep.name] = ep.load()
    return ALGORITHMS


def register_algorithm(name: str, step: Step | str, **needs: Any) -> Algorithm:
    """Add `name` to the table: `step` is a module-level async function (or its "module:function");
    `needs`: needs_critic, needs_pretrain, needs_teacher, last_update."""
    path = step if isinstance(step, str) else f"{step.__module__}:{step.__qualname__}"
    ALGORITHMS[name] = Algorithm(path, **needs)
    return ALGORITHMS[name]


def needs_critic(name: str) -> bool:
    """Whether algorithm `name` trains a critic (critic.* is used)."""
    table = algorithms()
    return name in table and table[name].needs_critic


def needs_teacher(name: str) -> bool:
    """Whether algorithm `name` distils from a teacher (teacher.* is used)."""
    table = algorithms()
    return name in table and table[name].needs_teacher
