"""Failover without a restart (trainer.failover), the driver's side: the end of each step is
kept on the workers (`failover_mark`, asyncrl.roles.failover), and a step in which a training
rank died runs again on the pool re-formed around that rank's replacement: no other worker
restarts, no recorded step is lost, and the step's prompts are trained once (its first try never
ended on every rank, so nothing of it was kept)."""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncrl.single_controller.group import WorkerCallError
from daemons.errors import PlacementError, WorkerDiedError
from daemons.messages import WorkerState

log = logging.getLogger(__name__)

PREPARE = "asyncrl.roles.failover:prepare"


class StepGuard:
    """Runs the trainer's steps; a step a rank of the actor's pool died in runs again.

    The workers keep their state at the end of each step (`failover_mark`, before the step's
    metrics are recorded), the driver its data loader, controllers and counters beside it: a rank
    lost during a step, or while its end is being kept, takes every rank back to the last kept
    end and that step runs again, recorded once."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.limit = trainer.cfg.trainer.failover.max_failovers
        self.events: list[dict[str, Any]] = []  # per failover: step, rank, node, worker, seconds
        self.kept: dict[int, tuple] = {}  # the driver's side of the last kept steps
        self.noticed: float | None = None  # when the driver learnt of the last death (monotonic)

    async def _mark(self) -> list[dict[str, float]]:
        t = self.trainer
        marked = await t.roles.actor.failover_mark(t.step)
        self.kept = {s: v for s, v in self.kept.items() if s >= t.step - 1}
        self.kept[t.step] = (t.data.loader.state_dict(), t.ctl.state_dict(), t.tokens, t.step_time)
        return marked

    async def run_step(self) -> dict[str, float]:
        t = self.trainer
        while True:
            try:
                if t.step not in self.kept:  # the run's first step: its start
                    await self._mark()
                started = time.monotonic()
                if self.noticed is not None:
                    self.events[-1]["resumed_at"] = time.time()  # wall clock: beside a kill's own stamp
                metrics = await t.train_step()
                marked = await self._mark()
            except WorkerDiedError as e:
                await self.recover(e, time.monotonic())
                continue
            if self.noticed is not None:  # from the death's notice to the step's start on the re-formed pool
                metrics["trainer/failover_resume_s"] = started - self.noticed
                self.noticed = None
            metrics["trainer/failovers"] = float(len(self.events))
            metrics["perf/failover_mark_s"] = max(m["seconds"] for m in marked)
            metrics["perf/failover_held_gib"] = max(m["held_bytes"] for m in marked) / 2**30
            metrics["perf/failover_state_gib"] = max(m["state_bytes"] for m in marked) / 2**30
            return metrics

    async def recover(self, err: WorkerDiedError, noticed: float) -> None:
        """A new process for the dead rank, the actor rebuilt on every rank of a new process group,
        the kept states restored; the driver back at the kept step (raises `err` when this
        is beyond trainer.failover.max_failovers or not one rank of the actor's pool)."""
        t = self.trainer
        procs = t.roles.actor.procs
        dead = [h for h in procs.handles if h.info.state is WorkerState.DEAD]
        if len(self.events) >= self.limit or len(dead) != 1:
            why = (f"trainer.failover.max_failovers={self.limit} reached" if len(self.events) >= self.limit
                   else f"{len(dead)} ranks of pool {procs.pool.name} died (failover replaces one at a time)")
            log.error("no failover: %s", why)
            raise err
        info = dead[0].info
        log.warning("step %d: rank %d (worker %s on node %s) died (%s); failover %d of %d: replacing it and "
                    "running the step again", t.step + 1, info.rank, info.worker_id, info.node_id, info.exit_reason,
                    len(self.events) + 1, self.limit)
        try:
            new = await t.ctx.replace_rank(procs.pool.name, info.rank, rebuild=(t.roles.actor.role,),
                                           before_rebuild=PREPARE)
        except PlacementError as e:  # nowhere to run it: trainer.max_restarts may still restart the job
            log.error("no failover: %s", e)
            raise err from None
        try:
            step = (await t.roles.actor.failover_restore(info.rank))[0]
        except WorkerCallError as e:  # the kept states do not line up (FailoverError): a restart may still help
            log.error("no failover: restoring the kept states failed: %s", e.remote_message)
            raise err from None
        if step not in self.kept:
            raise RuntimeError(f"failover: the workers kept step {step}'s start, the driver steps {sorted(self.kept)}")
        loader, ctl, t.tokens, t.step_time = self.kept[step]
        t.step = step
        t.data.loader.load_state_dict(loader)
        t.ctl.load_state_dict(ctl)
        self.noticed, recover_s = noticed, time.monotonic() - noticed
        self.events.append({"step": step + 1, "rank": info.rank, "node": info.node_id, "worker": info.worker_id,
                            "replacement": new.info.worker_id, "replacement_node": new.info.node_id,
                            "recover_s": round(recover_s, 3)})
        log.warning("failover %d: rank %d is worker %s on node %s; step %d runs again (%.1f s after the death "
                    "was noticed)", len(self.events), info.rank, new.info.worker_id, new.info.node_id, step + 1,
                    recover_s)
