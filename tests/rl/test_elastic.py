"""An elastic rollout pool (rollout.elastic): a rollout worker killed mid-run is dropped and its
prompts are generated again on the others, a node that joins mid-run (`asyncrl-launch --join`)
gets a rollout worker with the current weights, and the ledger shows every prompt trained once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemons.proc import free_port, kill_group
from objectstore import remove_stale_segments
from tests.rl.test_rl import SMALL, _env

REPO = Path(__file__).resolve().parents[2]
STEPS = 10


def _steps(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if '"actor/pg_loss"' in x] if path.exists() else []


def _cluster_inputs(tmp_path: Path) -> tuple[Path, Path, int]:
    """A tiny model, cluster keys (another node can join with them) and a free coordinator port."""
    from asyncrl.models.tiny import ensure_tiny_model
    from transport.auth import generate_keys

    model = ensure_tiny_model(tmp_path / "model", task="sort", hidden=32, layers=1, heads=2, sft_steps=0)
    generate_keys(tmp_path / "keys")
    # outside the kernel's ephemeral range: no outgoing connection takes it before the coordinator binds
    return model, tmp_path / "keys", free_port()


def _wait(cond, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def test_rollout_workers_leave_and_join_while_every_prompt_trains_once(tmp_path):
    """A gate in the reward function holds the run between the events (no race with its pace).
    Weights go as deltas (rollout.weight_sync=delta); tests/daemons/test_multinode.py's elastic
    pool pulls whole versions."""
    model, keys, port = _cluster_inputs(tmp_path)
    out, gate = tmp_path / "run", tmp_path / "gate"
    env = {**_env(out), "ASYNCRL_TEST_GATE": str(gate)}
    head_cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo", f"trainer.output_dir={out}",
                f"model.path={model}", "model.build_tiny=null", *SMALL, f"trainer.total_steps={STEPS}",
                f"trainer.save_every={STEPS}", f"trainer.eval_every={STEPS}", "trainer.loggers=[jsonl]",
                "trainer.placement=split", "trainer.n_workers=1", "rollout.n_workers=2", "rollout.elastic=true",
                "rollout.weight_sync=delta", f"reward.fn={REPO / 'tests' / 'helpers' / 'gated_reward.py'}:score",
                "cluster.cpu_devices=3", f"cluster.port={port}", f"cluster.key_dir={keys}"]
    head_log, join_log = tmp_path / "head.log", tmp_path / "join.log"
    with head_log.open("w") as err:
        head = subprocess.Popen(head_cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env,
                                start_new_session=True)
    joiner = None
    try:
        _wait(lambda: len(_steps(out)) >= 2, head, head_log)
        gate.touch()  # the run holds at its next scoring
        pid = int(re.search(r"spawned worker rollout-1-\S+ pid (\d+)", head_log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)  # a rollout worker dies mid-run
        gate.unlink()
        _wait(lambda: len(_steps(out)) >= 4, head, head_log)
        gate.touch()
        with join_log.open("w") as err:  # a node joins the running job
            joiner = subprocess.Popen([sys.executable, "-m", "asyncrl.launch", "--join", f"127.0.0.1:{port}",
                                       "--config-name", "grpo", f"cluster.key_dir={keys}", "cluster.cpu_devices=1",
                                       f"cluster.log_dir={tmp_path / 'join-logs'}"],
                                      stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path, env=_env(tmp_path / "joiner"),
                                      start_new_session=True)
        _wait(lambda: re.search(r"rollout-\d+ on vm-\d{4,} is live", head_log.read_text()) is not None, head, head_log,
              timeout=120)  # while the run holds: the pool admits a node that joins without waiting for a step
        gate.unlink()
        stdout, _ = head.communicate(timeout=240)
    finally:
        gate.unlink(missing_ok=True)
        kill_group(head, grace_s=10)
        if joiner is not None:
            kill_group(joiner, grace_s=5)
        remove_stale_segments()
    log = head_log.read_text()
    assert head.returncode == 0, log[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS
    last = _steps(out)[-1]
    assert last["rollout/workers_lost"] == 1 and last["rollout/workers_joined"] == 1, last
    # 2 workers live then, or 3 when the pool had not called the killed worker since it died
    version = int(re.search(r"on vm-\d{4,} is live \([23] workers, weights version (\d+)\)", log).group(1))
    assert version >= 4  # the joiner started from the newest weights (the run was past step 4), not step 0's
    assert last["rollout/workers"] == 2, last
    # every sync's bytes: what the live workers pulled; as deltas (rollout.weight_sync=delta) once a
    # worker holds the version before: the joiner took the newest version in full when it joined
    # (above), then deltas like the others; every delta rebuilt its version
    rows = _steps(out)
    assert all(r["perf/weight_sync_mb"] > 0 for r in rows), [r["perf/weight_sync_mb"] for r in rows]
    assert [r["rollout/weights_pulled_in_full"] for r in rows[1:]] == [0.0] * (len(rows) - 1), rows
    assert rows[-1]["perf/weight_sync_fallbacks"] == 0 and 0 < rows[-1]["perf/weight_sync_delta_ratio"] < 1.05, rows[-1]
    # the ledger: the rows each step's update consumed (written from the update's batches)
    ledger = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [row["step"] for row in ledger] == list(range(1, STEPS + 1))  # each step once, resumed or not
    drawn = [u for row in ledger for u in row["uids"]]
    assert all(len(row["uids"]) == 4 for row in ledger) and len(set(drawn)) == len(drawn)  # no prompt in two steps
    for row in ledger:  # rollout.n rows of each drawn prompt: none lost with the worker, none twice
        assert sorted(row["rows"]) == sorted(u for u in row["uids"] for _ in range(2)), row


@pytest.mark.slow  # ~22 s; the refusal is one coordinator query (cluster.join), the join itself runs by default
def test_joining_a_job_without_an_elastic_pool_is_refused_and_the_job_goes_on(tmp_path):
    model, keys, port = _cluster_inputs(tmp_path)
    out, gate = tmp_path / "run", tmp_path / "gate"
    env = {**_env(out), "ASYNCRL_TEST_GATE": str(gate)}
    gate.touch()  # the job holds at its first scoring while a node tries to join
    head_log = tmp_path / "head.log"
    with head_log.open("w") as err:
        head = subprocess.Popen([sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo",
                                 f"trainer.output_dir={out}", f"model.path={model}", "model.build_tiny=null", *SMALL,
                                 "trainer.total_steps=2", "trainer.eval_every=2", "trainer.loggers=[jsonl]",
                                 f"reward.fn={REPO / 'tests' / 'helpers' / 'gated_reward.py'}:score",
                                 f"cluster.port={port}", f"cluster.key_dir={keys}"],
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env, start_new_session=True)
    try:
        _wait(lambda: "spawned worker" in head_log.read_text(), head, head_log)
        join = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--join", f"127.0.0.1:{port}", "--config-name",
                               "grpo", f"cluster.key_dir={keys}", "cluster.cpu_devices=1",
                               f"cluster.log_dir={tmp_path / 'join-logs'}"], capture_output=True, text=True, cwd=tmp_path,
                              env=_env(tmp_path / "joiner"), timeout=120)
        gate.unlink()
        stdout, _ = head.communicate(timeout=240)
    finally:
        gate.unlink(missing_ok=True)
        kill_group(head, grace_s=10)
        remove_stale_segments()
    assert join.returncode == 2 and "no job there takes nodes joining mid-run" in join.stderr, join.stderr[-2000:]
    assert head.returncode == 0 and json.loads(stdout.strip().splitlines()[-1])["steps"] == 2, head_log.read_text()[-2000:]


def test_a_share_whose_worker_dies_is_generated_again_on_another(monkeypatch):
    """ElasticRollout on stand-in groups: rows [0, 6) over three workers, the second dies during its
    call; its rows come from a live worker, the result keeps the prompts' order, nothing twice."""
    import asyncio

    from asyncrl.rollout import elastic
    from daemons.errors import WorkerDiedError

    class Rows:
        def __init__(self, rows):
            self.rows, self.meta = list(rows), {}

        def __len__(self):
            return len(self.rows)

        def slice(self, lo, hi):
            return Rows(self.rows[lo:hi])

        def with_meta(self, **kw):
            return self

        @staticmethod
        def concat(parts):
            return Rows([r for p in parts for r in p.rows])

    class Group:
        def __init__(self, name, dies=False):
            self.name, self.dies, self.calls = name, dies, []

        def generate_sequences(self, part):
            self.calls.append(part.rows)

            async def run():
                if self.dies:
                    raise WorkerDiedError(f"{self.name}-0", "node-x", 0, "killed by SIGKILL")
                return Rows([(r, self.name) for r in part.rows])
            return asyncio.ensure_future(run())

    async def hold(batch):
        return batch

    monkeypatch.setattr(elastic, "DistBatch", Rows)
    groups = [Group("a"), Group("b", dies=True), Group("c")]

    async def main():
        pool = elastic.ElasticRollout(ctx=None, spawn=None, hold=hold, min_workers=1, wait_s=5)
        pool.admit = lambda: None  # no cluster to look for new nodes in
        for g in groups:
            pool.members[g.name] = elastic.Member(g.name, g, "node", 0.0, late=False)
        out = await pool._generate(Rows(range(6)), "generate_sequences")
        return pool, out

    pool, out = asyncio.run(main())
    assert [r for r, _ in out.rows] == list(range(6))  # every row once, in order
    assert dict(out.rows)[2] in ("a", "c") and dict(out.rows)[3] in ("a", "c")  # b's share, made elsewhere
    assert groups[1].calls == [[2, 3]] and "b" not in pool.members
    assert pool.metrics()["rollout/workers_lost"] == 1 and pool.metrics()["rollout/regenerated_prompts"] == 2


def test_below_min_workers_a_call_waits_for_one_to_join(monkeypatch):
    import asyncio

    from asyncrl.rollout import elastic

    async def main():
        pool = elastic.ElasticRollout(ctx=None, spawn=None, hold=None, min_workers=2, wait_s=5)
        pool.members["a"] = elastic.Member("a", object(), "n", 0.0, late=False)
        joins = []

        def join():
            pool.members["b"] = elastic.Member("b", object(), "m", 0.0, late=True)
            pool.changed.set()

        def admit():  # the first look starts a worker on a node that joined; it is live 0.2 s later
            joins.append(1)
            if len(joins) == 1:
                asyncio.get_running_loop().call_later(0.2, join)
        monkeypatch.setattr(pool, "admit", admit)
        live = await asyncio.wait_for(pool._live(), timeout=30)
        pool.members.pop("b")
        pool.wait_s = 0.3
        with pytest.raises(TimeoutError, match="fewer than rollout.min_workers=2"):
            await pool._live()
        return live

    assert sorted(m.name for m in asyncio.run(main())) == ["a", "b"]


def test_one_worker_per_node_pulls_a_version_and_hands_it_to_the_others():
    """ElasticRollout.sync on stand-in groups: node "train" hosts the training ranks (its workers
    pull from them: shared memory already), node "b" two workers, node "c" one. One of b's pulls
    (the one holding the version before, so it takes deltas) and hands its copy to the other
    (`share_weights`, pulled as whole tensors); a leader that dies pulling leaves the other to pull
    for itself, and so does one whose copy cannot be read (then two copies reached that node)."""
    import asyncio
    from types import SimpleNamespace

    from asyncrl.rollout import elastic
    from daemons.errors import WorkerDiedError

    class Group:
        def __init__(self, name, dies=False, lost_share=False):
            self.name, self.dies, self.lost_share, self.calls = name, dies, lost_share, []

        async def pull_weights(self, version, pieces, rows):
            self.calls.append(("full", [p.name for p in pieces], rows))
            if self.dies:
                raise WorkerDiedError(f"{self.name}-0", "b", 0, "killed by SIGKILL")
            if self.lost_share and pieces[0].name.startswith("share"):
                raise RuntimeError("ObjectLostError: the owner of that object is gone")
            return [100.0]

        async def pull_weight_deltas(self, version, deltas, rows):
            self.calls.append(("delta", [p.name for p in deltas], rows))
            if self.dies:
                raise WorkerDiedError(f"{self.name}-0", "b", 0, "killed by SIGKILL")
            return [10.0]

        async def share_weights(self, version):
            self.calls.append(("share", version))
            return [SimpleNamespace(name=f"share-of-{self.name}")]  # a group of one

    class Pieces(SimpleNamespace):
        def refs(self):
            return {"weights": SimpleNamespace(node_id="train", nbytes=8)}

    def pool_of(groups):
        pool = elastic.ElasticRollout(ctx=None, spawn=None, hold=None, min_workers=1, wait_s=5)
        pool.rows = [[4, 4]]
        for g, node, version in groups:
            pool.members[g.name] = elastic.Member(g.name, g, node, 0.0, late=False, version=version)
        return pool

    t1, t2, b1, b2, c1 = Group("t1"), Group("t2"), Group("b1"), Group("b2"), Group("c1")
    pool = pool_of([(t1, "train", 1), (t2, "train", 1), (b1, "b", 0), (b2, "b", 1), (c1, "c", 1)])
    asyncio.run(pool.sync(2, [Pieces(name="full")], [Pieces(name="deltas")]))
    assert t1.calls == t2.calls == c1.calls == [("delta", ["deltas"], [[4, 4]])]
    assert b2.calls == [("delta", ["deltas"], [[4, 4]]), ("share", 2)]  # it held version 1: deltas
    assert b1.calls == [("full", ["share-of-b2"], None)]  # b2's whole copy, through shared memory
    metrics = pool.metrics()
    assert metrics["rollout/weight_copies_per_node"] == 1 and pool.pulled_bytes == 40
    assert metrics["rollout/weights_relayed_mb"] == 100 / 2**20 and metrics["rollout/weights_pulled_in_full"] == 0

    b1, b2 = Group("b1", dies=True), Group("b2")  # b1 leads (the first of equals) and dies pulling
    pool = pool_of([(b1, "b", 1), (b2, "b", 1)])
    asyncio.run(pool.sync(2, [Pieces(name="full")], None))
    assert "b1" not in pool.members and b2.calls == [("full", ["full"], [[4, 4]])]  # it pulled for itself
    assert pool.metrics()["rollout/workers_lost"] == 1 and pool.metrics()["rollout/weight_copies_per_node"] == 1

    b1, b2 = Group("b1"), Group("b2", lost_share=True)  # b1's copy cannot be read from b2
    pool = pool_of([(b1, "b", 1), (b2, "b", 1)])
    asyncio.run(pool.sync(2, [Pieces(name="full")], [Pieces(name="deltas")]))
    assert b2.calls == [("full", ["share-of-b1"], None), ("delta", ["deltas"], [[4, 4]])]  # then its own deltas
    assert pool.metrics()["rollout/weight_copies_per_node"] == 2 and set(pool.members) == {"b1", "b2"}
