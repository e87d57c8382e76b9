"""Advantages where the rows live: `LOCAL_ROWS` gives every rank the rows its own store holds,
batch-wide numbers are summed over the ranks (`Peers`), and the result equals one rank
estimating the whole batch (`RANK_ZERO`, what the steps did before) without moving a row."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms import advantage
from asyncrl.single_controller.context import local_cluster
from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.peers import GATHER_BYTES
from asyncrl.single_controller.protocols import RANK_ZERO
from tests.helpers.pm_workers import RowsWorker, gathered_sizes

pytestmark = pytest.mark.asyncio

ESTIMATORS = [(advantage.grpo, {}), (advantage.rloo, {}), (advantage.reinforce_pp, {"gamma": 1.0}),
              (advantage.gae, {"gamma": 1.0, "lam": 0.95, "kl_coef": 0.1})]


async def test_advantages_are_estimated_where_the_rows_live(tmp_path):
    """4 ranks holding 6, 6, 4 and 0 rows, prompt groups of 4 (so groups reach across ranks 0/1
    and 1/2): every estimator gives the advantages and metrics of one rank estimating the whole
    batch, rank 3 joins the sums with no rows, and no advantage call pulls a byte from another
    rank (one rank estimating everything pulled the other ranks' rows)."""
    async with local_cluster(cpu_devices=4, log_dir=tmp_path / "logs", insecure=True,
                             allowed_packages=("tests",)) as ctx:
        g = await ctx.spawn_group(ctx.create_pool("rows", world_size=4), RowsWorker)
        batch = DistBatch.concat(await g.make_samples([6, 6, 4, 0], 4))
        before = await g.pulled_bytes()
        for fn, kwargs in ESTIMATORS:
            local = await (await g.apply(fn, batch, **kwargs)).fetch()
            after = await g.pulled_bytes()
            assert [a["advantage"][1] - b.get("advantage", [0, 0])[1] for a, b in zip(after, before, strict=True)] == [0] * 4
            one = await (await g.apply(fn, batch, protocol=RANK_ZERO, **kwargs)).fetch()
            before = await g.pulled_bytes()
            assert before[0]["advantage"][1] > after[0]["advantage"][1]  # rank 0 pulled the rows of 1 and 2
            torch.testing.assert_close(local["advantages"], one["advantages"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(local["returns"], one["returns"], rtol=1e-5, atol=1e-6)
            assert local.meta.keys() == one.meta.keys() and len(local) == 16, fn.__name__
            for k, v in one.meta.items():
                if k.startswith("timing/"):  # each call's own time
                    continue
                assert local.meta[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (fn.__name__, k)


async def test_a_group_on_one_rank_gets_the_bits_of_a_lone_estimate(tmp_path):
    """Groups that stay on their rank: the advantages are bit for bit those of one rank (the
    quickstart's numbers do not move when the estimate moves to the rows)."""
    async with local_cluster(cpu_devices=2, log_dir=tmp_path / "logs", insecure=True,
                             allowed_packages=("tests",)) as ctx:
        g = await ctx.spawn_group(ctx.create_pool("rows", world_size=2), RowsWorker)
        batch = DistBatch.concat(await g.make_samples([8, 8], 4))
        local = await (await g.apply(advantage.grpo, batch)).fetch()
        one = await (await g.apply(advantage.grpo, batch, protocol=RANK_ZERO)).fetch()
        assert torch.equal(local["advantages"], one["advantages"])
        # a gathered value above one collective's room takes a second: every rank agrees on it
        for big in (10, GATHER_BYTES - 20, GATHER_BYTES + 1000):
            assert await g.apply(gathered_sizes, batch, big=big) == [[big + 1, 4, 8, 8]] * 2
