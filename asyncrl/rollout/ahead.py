"""Generation launched ahead of training: with rollout.max_staleness = k > 0, or a rollout pool
of its own (trainer.placement=split), batch i is generated while earlier batches train; on one
synchronous pool (rollout.launch_next_early), batch i + 1 is sent behind step i's last update.

The trainer launches batches; an algorithm step asks `roles.rollout.generate_sequences(prompts)`
and gets the generation already running for those prompts."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

from asyncrl.single_controller.distbatch import DistBatch


class Generations:
    """Generation launched ahead of training (rollout.max_staleness = k > 0, or a separate
    rollout pool): batch i starts once the policy version it may use (>= i - k) is on the
    generating workers, and runs there while earlier batches train."""

    def __init__(self, group: Any, loader: Any, stream: bool, behind: bool = False) -> None:
        self.group, self.loader, self.behind = group, loader, behind
        # a rollout pool of its own takes overlapping calls into one continuous batch
        self.generate = group.generate_stream if stream else group.generate_sequences
        # behind: a launch runs right after the last call on the (shared) processes, on every rank
        self.start = functools.partial(group.behind, "generate_sequences") if behind else self.generate
        self.ahead: dict[int, tuple[DistBatch, Any, int, dict]] = {}  # step -> prompts, future, version, loader state

    def launch(self, step: int, next_prompts: Callable[[int], DistBatch], version: int) -> None:
        if step in self.ahead:
            return
        loader_state = copy.deepcopy(self.loader.state_dict())
        prompts = next_prompts(step)
        self.ahead[step] = (prompts, self.start(prompts), version, loader_state)

    def prompts(self, step: int) -> DistBatch:
        return self.ahead[step][0]

    def generate_sequences(self, prompts: DistBatch) -> Any:
        """What an algorithm step's `roles.rollout.generate_sequences(prompts)` gets: the
        generation launched ahead for these prompts, or a new one on the generating group."""
        for p, future, _, _ in self.ahead.values():
            if p is prompts:
                return future
        return self.generate(prompts)

    def done(self, step: int) -> dict[str, float]:
        """Forget batch `step` (trained by version `step`); its staleness as metrics."""
        entry = self.ahead.pop(step, None)
        if entry is None or self.behind:
            return {"async/staleness": 0.0}
        return {"async/staleness": float(step - entry[2]), "async/in_flight": float(len(self.ahead))}

    def loader_state(self, step: int) -> dict:
        """The loader's state before the first batch not yet trained (batches drawn ahead are
        drawn again after a resume)."""
        ahead = sorted(s for s in self.ahead if s >= step)
        return self.ahead[ahead[0]][3] if ahead else self.loader.state_dict()

    def drop(self) -> None:
        """Forget every batch launched (the step failed: a launched batch's error is not news)."""
        for _, future, _, _ in self.ahead.values():
            future.awaited = True
            future.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.ahead.clear()
