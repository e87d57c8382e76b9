"""Fault-injection jobs and workers (tests and `benchmarks.chaos_live`): a driver that blocks its
event loop, ranks busy in gloo collectives (to be killed mid-call), calls that hang."""

from __future__ import annotations

import asyncio
import os
import time

import torch

from asyncrl.single_controller.protocols import ONE_TO_ALL
from asyncrl.single_controller.worker import Worker, register

STALL_ENV = "ASYNCRL_FAULT_STALL_S"  # how long `stall` blocks the driver's loop (default 8 s)


class Collective(Worker):
    """Ranks in one gloo process group."""

    @register(ONE_TO_ALL)
    def setup(self) -> int:
        from asyncrl.train.fsdp import init_distributed

        torch.set_num_threads(1)
        init_distributed("gloo")
        return os.getpid()

    @register(ONE_TO_ALL)
    def allreduce_for(self, seconds: float) -> int:
        """All-reduce a small tensor over and over for `seconds` (a rank to kill mid-call)."""
        import torch.distributed as dist

        t, n, end = torch.ones(1024), 0, time.monotonic() + seconds
        while time.monotonic() < end:
            dist.all_reduce(t)
            t.fill_(1.0)
            n += 1
        return n

    @register(ONE_TO_ALL)
    def hang_in_collective(self, rank: int) -> None:
        """Every rank but `rank` enters an all-reduce that `rank` never joins."""
        import torch.distributed as dist

        if self.rank == rank:
            time.sleep(3600)
        dist.all_reduce(torch.ones(4))

    @register(ONE_TO_ALL)
    def sleep_on(self, rank: int, seconds: float) -> int:
        """Rank `rank` sleeps `seconds`; the others return at once."""
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank


def pid() -> int:
    return os.getpid()


def nap(seconds: float) -> None:
    time.sleep(seconds)


async def stall(ctx) -> dict:
    """Spawn two workers, then block the driver's event loop (a user's `time.sleep` in async
    code) while a call is in flight; the job must still succeed."""
    seconds = float(os.environ.get(STALL_ENV, "8"))
    pool = ctx.create_pool("stall", world_size=2)
    workers = await ctx.spawn_workers(pool, group="stall")
    before = [await w.run("asyncrl.jobs.faults:pid") for w in workers]
    pending = asyncio.ensure_future(workers[0].run("asyncrl.jobs.faults:nap", 0.5))
    t0 = time.monotonic()
    time.sleep(seconds)  # noqa: ASYNC251 - the fault under test
    stalled = time.monotonic() - t0
    await pending
    after = [await w.run("asyncrl.jobs.faults:pid") for w in workers]
    return {"stalled_s": round(stalled, 1), "same_workers": before == after}
