"""Pipelined calls: a LOCAL_ROWS call on the pending outputs of the calls before it on the same
processes is sent before their replies, and gives what the ordered path gives."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl import Batch, WorkerCallError
from asyncrl.single_controller import group as group_module
from asyncrl.single_controller.context import local_cluster
from asyncrl.single_controller.group import union_all
from asyncrl.single_controller.pipeline import CallOutputs, PipelineError
from tests.helpers import pm_workers as W


@pytest.fixture
async def chain(tmp_path):
    async with local_cluster(cpu_devices=2, log_dir=tmp_path / "logs", insecure=True,
                             allowed_packages=("tests",)) as ctx:
        yield ctx, await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Chain)


async def _run(ctx, g, rows: int, delay: float):
    made = g.make(ctx.put(Batch({"idx": torch.arange(rows)})), delay=delay)
    scored = g.score(made)
    total = g.apply(W.totals, union_all(made, scored))
    return made, scored, total


async def test_a_local_rows_call_on_pending_outputs_is_sent_before_they_end(chain):
    ctx, g = chain
    made, scored, total = await _run(ctx, g, 8, delay=0.5)
    # both consumers went out (their rows promised) while the producer still ran
    assert await asyncio.wait_for(scored.source[0].sent, 5) is True
    assert await asyncio.wait_for(total.source[0].sent, 5) is True
    assert not made.done()
    out = await (await total).union(await made).union(await scored).fetch()
    x = torch.arange(8).float() * 10 + torch.tensor([0] * 4 + [1] * 4)
    assert torch.equal(out["x"], x)
    assert torch.equal(out["score"], x + 1)
    assert torch.equal(out["scored_by"], out["made_by"])  # each rank scored its own rows
    assert torch.equal(out["total"], 2 * x + 1)
    assert torch.equal(out["everything"], torch.full((8,), float((2 * x + 1).sum())))


async def test_the_ordered_path_gives_the_same_and_is_taken_where_outputs_move(chain, monkeypatch):
    ctx, g = chain
    made, scored, total = await _run(ctx, g, 7, delay=0.2)  # 7 rows on 2 ranks: a padded shard
    assert await asyncio.wait_for(made.source[0].sent, 5) is False  # rank 1's pad row is dropped
    ahead = await (await total).union(await made).union(await scored).fetch()
    monkeypatch.setattr(group_module, "PIPELINE", False)
    made, scored, total = await _run(ctx, g, 7, delay=0.0)
    ordered = await (await total).union(await made).union(await scored).fetch()
    assert ahead.tensors.keys() == ordered.tensors.keys()
    for k in ordered.tensors:
        assert torch.equal(ahead[k], ordered[k]), k


async def test_a_failed_producer_fails_the_calls_sent_ahead_and_the_pool_goes_on(chain):
    ctx, g = chain
    made = g.make(ctx.put(Batch({"idx": torch.arange(4)})), delay=0.2, fail_rank=1)
    scored = g.score(made)
    with pytest.raises(WorkerCallError, match="make failed on rank 1"):
        await made
    with pytest.raises(WorkerCallError, match=r"rank 1: .*PipelineError: call #\d+, whose output this call takes, failed"):
        await scored
    made, scored, total = await _run(ctx, g, 4, delay=0.0)
    assert len(await total) == 4


async def test_a_call_sent_behind_goes_out_before_the_last_call_ends_and_runs_after_it_on_every_rank(chain):
    ctx, g = chain
    first = g.span(ctx.put(Batch({"idx": torch.arange(4)})), delay=0.5)
    second = g.behind("span", ctx.put(Batch({"idx": torch.arange(4)})))
    assert await asyncio.wait_for(second.source[0].sent, 5) is not None  # out while the first runs
    assert not first.done()
    a, b = await (await first).fetch(), await (await second).fetch()
    for rank in (0, 1):
        ended = a["ended"][a["rank"] == rank].max()
        assert b["began"][b["rank"] == rank].min() >= ended  # the workers kept the order


async def test_a_call_sent_behind_a_failed_call_does_not_run_and_the_pool_goes_on(chain):
    ctx, g = chain
    first = g.span(ctx.put(Batch({"idx": torch.arange(4)})), delay=0.2, fail_rank=1)
    second = g.behind("span", ctx.put(Batch({"idx": torch.arange(4)})))
    with pytest.raises(WorkerCallError, match="span failed on rank 1"):
        await first
    with pytest.raises(WorkerCallError, match=r"rank 1: .*not run: it was sent behind call #\d+"):
        await second
    with pytest.raises(AttributeError, match="not an ordered registered method"):
        g.behind("no_such_method")
    made, scored, total = await _run(ctx, g, 4, delay=0.0)
    assert len(await total) == 4


async def test_a_call_sent_ahead_of_a_call_still_behind_another_waits_for_it(chain):
    """The consumer begins on each rank while its producer still waits behind the call before
    it: the producer then begins out of its number's order, and the consumer takes its rows."""
    ctx, g = chain
    first = g.span(ctx.put(Batch({"idx": torch.arange(4)})), delay=0.5)
    made = g.behind("make", ctx.put(Batch({"idx": torch.arange(4)})))
    scored = g.score(made)
    assert await asyncio.wait_for(scored.source[0].sent, 5) is True  # out while `first` runs
    assert not first.done()
    out = await (await made).union(await scored).fetch()
    assert torch.equal(out["score"], out["x"] + 1)
    assert torch.equal(out["scored_by"], out["made_by"])


async def test_call_outputs_tell_a_dropped_output_from_one_not_begun_yet():
    outputs = CallOutputs(keep=3)
    outputs.begin(5)  # begins before 4, which it does not read
    waiting = asyncio.ensure_future(outputs.wait_ended(4))
    outputs.begin(4)
    outputs.ended(4, "four")
    await asyncio.wait_for(waiting, 1)
    for seq in (6, 7, 8):
        outputs.begin(seq)
    assert sorted(outputs.outputs) == [6, 7, 8] and outputs.floor == 5
    with pytest.raises(PipelineError, match="call #4 is no longer held on this rank"):
        outputs.begin(4)
    await asyncio.wait_for(outputs.wait_ended(5), 1)  # dropped: long ended
