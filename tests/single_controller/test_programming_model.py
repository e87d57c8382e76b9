"""Programming model: Worker, @register protocols, WorkerGroup, DistBatch resharding, dataflow."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch

from asyncrl import Batch, DistBatch, WorkerCallError, register_protocol
from asyncrl.single_controller.context import JobContext, local_cluster
from asyncrl.single_controller.distbatch import Piece
from asyncrl.single_controller.parallel import LayoutError, ParallelConfig, ParallelLayout
from tests.helpers import pm_workers as W


@pytest.fixture
async def ctx(tmp_path):
    async with local_cluster(cpu_devices=8, log_dir=tmp_path / "logs", insecure=True,
                             allowed_packages=("tests", "os", "posix")) as c:  # apply("os:getpid")
        yield c


async def test_dp_chain_reshards_without_the_controller(ctx):
    producers = await ctx.spawn_group(ctx.create_pool("prod", world_size=2), W.Producer)
    consumers = await ctx.spawn_group(ctx.create_pool("cons", per_node=[6]), W.Consumer)
    spec = ctx.put(Batch({"idx": torch.arange(10)}))
    made = producers.make(spec)  # a future, not a value
    assert not made.done()
    seen = await consumers.rows_seen(made)  # dataflow edge: waits for `made`
    # 10 rows over 6 ranks: padded to 12 by reference, 2 rows each
    assert [s["rows"] for s in seen] == [2] * 6
    assert [s["first"] for s in seen] == [0, 2, 4, 6, 8, 0]
    doubled = await consumers.double(made)
    assert isinstance(doubled, DistBatch) and len(doubled) == 10  # padding dropped
    full = await doubled.union(await made).fetch()
    assert torch.equal(full["y"], full["x"] * 2)
    assert torch.equal(full["idx"], torch.arange(10))
    assert full["tag"] == [f"r{i}" for i in range(10)]
    assert full["seen_by"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert full["owner"].tolist() == [0] * 5 + [1] * 5


async def test_protocols_one_to_all_rank_zero_all_to_all(ctx):
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=3), W.Consumer)
    assert await g.noop() == [None, None, None]
    assert await g.rank_zero() == 0
    assert await g.echo(["a", "b", "c"]) == [[0, "a"], [1, "b"], [2, "c"]]
    with pytest.raises(ValueError, match="ALL_TO_ALL"):
        await g.echo(["only one"])
    with pytest.raises(AttributeError, match="registered"):
        g.not_a_method()


async def test_3d_protocols_follow_the_mesh(ctx):
    g = await ctx.spawn_group(ctx.create_pool("mesh", world_size=4), W.Mesh3D)
    train = g.layouts["train"]
    assert train == ParallelLayout(("pp", "dp", "tp"), (1, 2, 2))
    assert [(c["dp"], c["tp"]) for c in map(train.coords, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    out = await (await g.tag(ctx.put(Batch({"idx": torch.arange(6)})))).fetch()
    # split over dp=2, broadcast over tp, collected from tp rank 0 only
    assert out["idx"].tolist() == list(range(6))
    assert out["dp"].tolist() == [0, 0, 0, 1, 1, 1] and out["tp"].tolist() == [0] * 6
    gen = await (await g.gen(ctx.put(Batch({"idx": torch.arange(4)})))).fetch()
    assert gen["micro"].tolist() == [0, 0, 1, 1]
    names = await g.names()
    assert [n[0] for n in names] == [0]  # pp=1: one stage reports
    # a layout changed inside a call reaches the driver with that call's result
    await g.relayout(1)
    assert g.layouts["train"].dp_size == 4
    out = await (await g.tag(ctx.put(Batch({"idx": torch.arange(4)})))).fetch()
    assert out["dp"].tolist() == [0, 1, 2, 3]


async def test_a_bad_layout_fails_construction_with_what_to_change(ctx):
    with pytest.raises(Exception, match="tp=3 = 3 does not divide the world size 4"):
        await ctx.spawn_group(ctx.create_pool("bad", world_size=4), W.Mesh3D, 3)


async def test_two_contexts_do_not_share_a_tracker(ctx):
    other = await JobContext(ctx.coordinator, None).open()
    try:
        assert other.tracker is not ctx.tracker
        mine, theirs = ctx.put(Batch({"x": torch.ones(2)})), other.put(Batch({"x": torch.ones(2)}))
        assert mine.tracker is ctx.tracker and theirs.tracker is other.tracker
        assert mine.slice(0, 1).tracker is ctx.tracker  # derived plans keep their tracker
        assert ctx.tracker.live == 1 and other.tracker.live == 1
        del theirs
        gc.collect()
        assert ctx.tracker.live == 1 and other.tracker.live == 0
        with pytest.raises(ValueError, match="different JobContexts"):
            DistBatch.concat([mine, other.put(Batch({"x": torch.ones(2)}))])
    finally:
        await other.close()


async def test_user_protocol_and_apply(ctx):
    def distribute(c, args, kwargs):
        return {r: ((args[0] * (r + 1),), {}) for r in range(c.world_size)}

    register_protocol("SCALED", distribute, lambda c, outs: sum(o[1] for o in outs.values()))
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Consumer)
    # apply a protocol by name to a registered method's function through apply()
    made = ctx.put(Batch({"x": torch.ones(4, 2)}))
    z = await g.apply(W.add_column, made, 1.5, protocol="DP_PROTO")
    assert (await z.fetch())["z"].tolist() == [2.5] * 4
    assert await g.apply("tests.helpers.pm_workers:add_column", made, 0.5, protocol="RANK_ZERO") is not None
    with pytest.raises(ValueError, match="unknown transfer protocol"):
        g.apply(W.add_column, made, 1.0, protocol="NOPE")


async def test_a_parts_registered_methods_are_the_workers(ctx):
    """`Worker.parts`: an object the worker holds whose registered methods the driver calls on
    the group as the worker's own, with their protocols; its other methods stay private."""
    from asyncrl.single_controller.worker import registered_methods

    assert {"bump", "tag", "count"} <= set(registered_methods(W.WithPart)) and "hidden" not in registered_methods(W.WithPart)
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.WithPart)
    assert await g.bump(3) == [[0, 3], [1, 3]]
    assert await g.count() == [3, 3]  # the same object the worker holds
    tagged = await (await g.tag(ctx.put(Batch({"x": torch.zeros(4)})))).fetch()
    assert tagged["rank"].tolist() == [0, 0, 1, 1] and tagged["count"].tolist() == [3] * 4
    with pytest.raises(AttributeError, match="hidden"):
        getattr(g, "hidden")  # noqa: B009 - the attribute access is what fails


async def test_rank_exception_surfaces_with_rank_and_traceback(ctx):
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Consumer)
    fut = g.fail_on_rank_one(ctx.put(Batch({"x": torch.ones(4, 2)})))
    with pytest.raises(WorkerCallError) as info:
        await fut
    e = info.value
    assert e.rank == 1 and e.method == "fail_on_rank_one" and e.remote_type == "ValueError"
    assert "rank one refuses" in str(e) and "pm_workers.py" in e.remote_traceback
    assert await g.noop() == [None, None]  # the group keeps working


async def test_disjoint_pools_overlap_shared_pool_orders(ctx):
    a = await ctx.spawn_group(ctx.create_pool("a", world_size=1), W.Consumer)
    b = await ctx.spawn_group(ctx.create_pool("b", world_size=1), W.Consumer)
    [(start_a, end_a)], [(start_b, end_b)] = await asyncio.gather(a.sleep(1.0), b.sleep(1.0))
    assert start_a < end_b and start_b < end_a  # the two sleeps overlapped: concurrent
    # colocated roles share processes: calls run in issue order even when the first is slower
    groups = await ctx.spawn(ctx.create_pool("c", world_size=2), first=W.Consumer, second=W.Colocated)
    assert await groups.first.apply("os:getpid", protocol="ONE_TO_ALL") == await groups.second.pid()
    slow = groups.first.sleep(0.5)
    quick = groups.first.stamp("after")
    done_slow, (label, t_quick) = (await slow)[0][1], (await quick)[0]
    assert label == "after" and t_quick >= done_slow


async def test_distbatch_plans_are_row_arithmetic(ctx):
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Producer)
    d = await g.make_rows(8, 3)  # ONE_TO_ALL -> list of per-rank batches
    assert [len(x) for x in d] == [4, 4]
    whole = DistBatch.concat(d)
    assert len(whole) == 8 and len(whole.blocks) == 2
    mid = whole.slice(3, 6)
    # each block: the small columns' piece (idx, inline in its ref) and x's, over the same rows
    assert [[(p.start, p.stop, p.columns) for p in b] for b in mid.blocks] == [
        [(3, 4, ("idx",)), (3, 4, ("x",))], [(0, 2, ("idx",)), (0, 2, ("x",))]]
    assert [p.ref.inline is not None for p in mid.blocks[0]] == [True, False]
    rep = whole.slice(0, 2).repeat(2)
    assert (await rep.fetch())["idx"].tolist() == [0, 0, 1, 1]
    padded = whole.slice(0, 5).pad_to_divisor(4)
    assert len(padded) == 8 and padded.pad_size == 3 and len(padded.unpad()) == 5
    sel = whole.select("idx")
    assert sel.columns == ["idx"]
    with pytest.raises(KeyError):
        whole.select("nope")
    assert all(isinstance(p, Piece) for b in whole.blocks for p in b)


async def test_dropped_distbatches_are_freed(ctx):
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Producer)
    stats = lambda: asyncio.gather(*(h.call("store_stats") for h in g.handles))  # noqa: E731
    d = await g.make_rows(64, 64)
    assert sum(s["objects"] for s in await stats()) == 4  # per rank: idx (small, inline) and x
    del d
    gc.collect()
    for _ in range(50):
        if sum(s["objects"] for s in await stats()) == 0:
            break
        await asyncio.sleep(0.05)
    assert sum(s["objects"] for s in await stats()) == 0


def test_layout_coordinates_tp_innermost():
    m = ParallelLayout.from_config(ParallelConfig(pp=2, tp=2), 8)
    assert m.dims == ("pp", "dp", "tp") and m.sizes == (2, 2, 2)
    assert m.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert not m.is_collect_rank(5) and m.is_collect_rank(6)
    assert m.collect_ranks() == [4, 6]  # last stage, tp rank 0, in dp order
    with pytest.raises(LayoutError, match="outside"):
        m.coords(8)
    dp_tp = ParallelLayout.from_config(ParallelConfig(tp=2), 4)
    assert [dp_tp.coords(r) for r in range(4)] == [{"pp": 0, "dp": d, "tp": t} for d in (0, 1) for t in (0, 1)]
    assert [dp_tp.dp_rank(r) for r in range(4)] == [0, 0, 1, 1] and dp_tp.dp_size == 2
    assert dp_tp.collect_ranks() == [0, 2]
    assert dp_tp.mesh_dims() == ("dp", "tp")
    assert ParallelLayout.from_wire(dp_tp.to_wire()) == dp_tp
    rollout = ParallelLayout.of(4, "rollout", dp=1, micro_dp=2, tp=2)
    assert [rollout.data_index(r, ("dp", "micro_dp")) for r in range(4)] == [0, 0, 1, 1]


def test_layout_validation_says_what_to_change():
    with pytest.raises(LayoutError, match=r"tp=3 = 3 does not divide the world size 4; choose pp\*tp among \[1, 2, 4\]"):
        ParallelLayout.from_config(ParallelConfig(tp=3), 4)
    with pytest.raises(LayoutError, match="= 8 ranks, but the world size is 4; set dp=0"):
        ParallelLayout.from_config(ParallelConfig(dp=4, tp=2), 4)
    with pytest.raises(LayoutError, match="parallel.tp=0"):
        ParallelLayout.from_config(ParallelConfig(tp=0), 4)
    with pytest.raises(LayoutError, match="covers 2 ranks, but the world size is 4"):
        ParallelLayout.of(4, "rollout", dp=1, micro_dp=2)
    assert issubclass(LayoutError, ValueError)
    assert ParallelLayout.from_config(ParallelConfig(), 3).sizes == (1, 3, 1)  # dp=0 fills


async def test_padding_is_dropped_per_output_row_multiple(ctx):
    """3 prompts over 2 ranks with 2 outputs per prompt: 6 rows, not 7 (the pad's outputs go)."""
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Consumer)
    out = await (await g.repeat_rows(ctx.put(Batch({"idx": torch.arange(3)})), 2)).fetch()
    assert out["idx"].tolist() == [0, 0, 1, 1, 2, 2]


async def test_next_call_waits_for_every_rank_of_a_failed_call(ctx):
    g = await ctx.spawn_group(ctx.create_pool("p", world_size=2), W.Consumer)
    failing = g.fail_fast_or_sleep(1.0)
    after = g.stamp("after")
    with pytest.raises(WorkerCallError, match="fails at once") as info:
        await failing
    surfaced = time.monotonic()
    failed_at = float(str(info.value).split("(at ")[1].split(")")[0])
    stamps = await after
    # the error surfaced before rank 0's sleep ended, and the next call ran only after it had; rank
    # 0 began its sleep as rank 1 began failing, not after (a loaded CI machine: 2 ms before), so
    # its end is within a tenth of a second of failed_at + 1.0 (a call that did not wait: ~failed_at)
    assert surfaced < failed_at + 0.9 <= min(t for _, t in stamps) and all(label == "after" for label, _ in stamps)


def test_distbatch_rows_follow_python_semantics():
    from objectstore import ObjectRef

    ref = ObjectRef(object_id="o", node_id="n", endpoint="tcp://x:1", bulk_addr="", kind="batch",
                    device="cpu", nbytes=80, columns=(("x", "float32", (10,)),), num_rows=10)
    d = DistBatch([(Piece(ref, 0, 10, ("x",)),)])
    assert len(d.slice(-2, 10)) == 2 and len(d.slice(0, -2)) == 8
    rows = d.take(torch.tensor([9, 0, 1]))
    assert [(p.start, p.stop) for b in rows.blocks for p in b] == [(9, 10), (0, 2)]
    assert all(type(p.start) is int for b in rows.blocks for p in b)
    with pytest.raises(IndexError):
        d.take([9, 10])
    twice = d.slice(0, 3).pad_to_divisor(2).pad_to_divisor(4)
    assert len(twice) == 4 and twice.pad_size == 1 and len(twice.unpad()) == 3
    with pytest.raises(ValueError, match="unpad"):
        DistBatch.concat([d.slice(0, 3).pad_to_divisor(2), d])


def test_3d_protocol_follows_a_layout_on_the_driver():
    """pp=2 × dp=2 × tp=2: rows split over dp, broadcast over pp and tp; the last stage's tp
    rank 0 of each dp group reports."""
    from asyncrl.single_controller.protocols import (
        THREE_D_PP_ONLY,
        THREE_D_PROTO,
        CallContext,
        get_protocol,
    )

    layout = ParallelLayout.from_config(ParallelConfig(pp=2, tp=2), 8)
    call = CallContext("g", "m", 8, {"train": layout})
    proto = get_protocol(THREE_D_PROTO)
    plan = proto.distribute(call, (Batch({"i": torch.arange(4)}),), {})
    assert {r: a[0]["i"].tolist() for r, (a, _) in plan.items()} == {
        r: [0, 1] if layout.dp_rank(r) == 0 else [2, 3] for r in range(8)}
    out = proto.collect(call, {r: Batch({"r": torch.full((2,), r)}) for r in plan})
    assert out["r"].tolist() == [4, 4, 6, 6]
    stages = get_protocol(THREE_D_PP_ONLY).collect(CallContext("g", "m", 8, {"train": layout}),
                                                   {r: r for r in range(8)})
    assert stages == [0, 4]  # stage 0's first rank, then stage 1's
