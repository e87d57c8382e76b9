"""Smoke job: two workers exchange an object directly; the driver only passes the ref."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.single_controller.config import LaunchConfig
from asyncrl.single_controller.schema import typed
from daemons.worker import WorkerRuntime


@dataclass
class SmokeSection:
    rows: int = 4096
    """Rows of the batch worker 0 makes; worker 1 pulls the second half."""
    cols: int = 256


@dataclass
class SmokeConfig(LaunchConfig):
    """The smoke job's schema (`smoke_schema`): the launch sections and `smoke`."""

    smoke: SmokeSection = field(default_factory=SmokeSection)


def make_batch(rows: int, cols: int, seed: int, *, runtime: WorkerRuntime) -> object:
    """Runs in worker 0: produce a batch in this worker's object store, return only its ref."""
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(rows, cols, generator=g), "idx": torch.arange(rows)}
    return runtime.put(batch)


def checksum(ref: object, start: int, stop: int, *, runtime: WorkerRuntime) -> dict:
    """Runs in worker 1: pull rows [start, stop) straight from the owner and summarise them."""
    rt = runtime
    shard = rt.get(ref, (start, stop))
    return {"rank": rt.rank, "rows": int(shard["x"].shape[0]), "sum": float(shard["x"].double().sum()),
            "first_idx": int(shard["idx"][0]), "pid_owner_differs": ref.node_id == rt.node_id}


async def main(ctx) -> dict:
    # a daemon's config has no smoke section: what a submit's overrides leave out takes the defaults
    cfg = typed(SmokeConfig, {"smoke": ctx.cfg["smoke"]} if "smoke" in ctx.cfg else {}).smoke
    pool = ctx.create_pool("smoke", world_size=2)
    producer, consumer = await ctx.spawn_workers(pool, group="smoke")
    ref = await producer.run("asyncrl.jobs.smoke:make_batch", cfg.rows, cfg.cols, 0)
    half = cfg.rows // 2
    got = await consumer.run("asyncrl.jobs.smoke:checksum", ref, half, cfg.rows)
    expected = torch.randn(cfg.rows, cfg.cols, generator=torch.Generator().manual_seed(0))[half:]
    assert got["rows"] == cfg.rows - half and got["first_idx"] == half, got
    assert abs(got["sum"] - float(expected.double().sum())) < 1e-6 * max(1.0, abs(got["sum"])), got
    sent, received = map(sum, zip(*(h.client.bytes_transferred for h in (producer, consumer)), strict=True))
    ctx.log.info("consumer pulled %d rows (%d bytes) from the producer; the driver moved %d bytes",
                 got["rows"], (cfg.rows - half) * (cfg.cols * 4 + 8), sent + received)
    return {"workers": 2, "rows_pulled": got["rows"], "driver_bytes": sent + received}


async def hold(ctx) -> None:
    """A job that keeps two workers alive until it is stopped (for `asyncrl status/stop` tests)."""
    import asyncio

    pool = ctx.create_pool("hold", world_size=2)
    workers = await ctx.spawn_workers(pool, group="hold")
    await workers[0].run("asyncrl.jobs.smoke:make_batch", 64, 8, 0)
    ctx.log.info("holding %d workers until stopped", len(workers))
    await asyncio.Event().wait()
