"""A trainer job for failover tests and `benchmarks.failover`: the real trainer; with
ASYNCRL_PROBE_KILL=STEP:RANK, that rank's worker is SIGKILLed halfway through step STEP's
update (half the last update's time after it was sent). Returns the summary, the final weights'
digest and when the kill happened."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from asyncrl.single_controller.protocols import ONE_TO_ALL
from asyncrl.trainer import main as trainer_main
from tests.helpers.worker_probes import weights_digest

KILL_ENV = "ASYNCRL_PROBE_KILL"


def _arm(t: Any, step: int, rank: int, killed: dict) -> None:
    """Wrap the actor group's update_actor: at `step`, kill `rank` midway through it."""
    group, send = t.roles.actor, t.roles.actor.update_actor

    def update_actor(*args: Any, **kwargs: Any) -> Any:
        fut = send(*args, **kwargs)
        if t.step + 1 == step and not killed:
            last = t.history[-1].get("timing/update_actor_s", 0.2) if t.history else 0.2
            handle = group.handles[rank]
            killed.update(pid=handle.info.pid, worker=handle.info.worker_id, delay_s=last / 2)

            def kill() -> None:
                killed["at"] = time.time()
                os.kill(killed["pid"], signal.SIGKILL)

            asyncio.get_running_loop().call_later(last / 2, kill)
        return fut

    group.update_actor = update_actor


async def main(ctx: Any) -> dict[str, Any]:
    trainers: list[Any] = []
    killed: dict[str, Any] = {}
    plan = os.environ.get(KILL_ENV)

    def setup(t: Any) -> None:
        trainers.append(t)
        if plan:
            step, rank = (int(x) for x in plan.split(":"))
            _arm(t, step, rank, killed)

    summary = await trainer_main(ctx, on_setup=setup)
    digest = (await trainers[0].roles.actor.apply(weights_digest, protocol=ONE_TO_ALL))[0]
    return {**summary, "weights_digest": digest, "killed": killed}
