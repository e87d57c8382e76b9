"""A training rank killed mid-run: with trainer.max_restarts the job restarts its workers from the
last complete checkpoint and finishes with the same step count; the log and metrics say so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from daemons.proc import kill_group
from objectstore import remove_stale_segments
from tests.rl.test_rl import SMALL, _env

REPO = Path(__file__).resolve().parents[2]


def _steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(x) for x in metrics.read_text().splitlines() if '"actor/pg_loss"' in x]


def test_a_killed_training_rank_fails_over_to_the_last_checkpoint(tmp_path):
    from asyncrl.models.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", task="sort", hidden=32, layers=1, heads=2, sft_steps=0)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo", f"trainer.output_dir={out}",
           f"model.path={model}", "model.build_tiny=null", *SMALL, "trainer.total_steps=8", "trainer.save_every=2",
           "trainer.eval_every=8", "trainer.max_restarts=1", "trainer.loggers=[jsonl]"]
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=_env(out),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while len(_steps(out / "metrics.jsonl")) < 3:  # past the step-2 checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.2)
        pid = int(re.search(r"spawned worker actor_rollout_ref-1-1 pid (\d+)", stderr.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc, grace_s=10)
        remove_stale_segments()
    log = stderr.read_text()
    assert proc.returncode == 0, log[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["restarts"] == 1, summary
    assert "failover 1 of trainer.max_restarts=1" in log and "actor_rollout_ref-1-1" in log
    rows = _steps(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)), [r["step"] for r in rows]  # each step once
    restarted = [r["step"] for r in rows if r["trainer/restarts"] == 1]
    assert restarted and restarted == list(range(restarted[0], 9)) and restarted[0] <= 5, restarted


FAILOVER = ["trainer.failover.enable=true", "rollout.launch_next_early=false", "trainer.total_steps=4",
            "trainer.eval_every=2", "trainer.save_every=4", "trainer.loggers=[jsonl]", "actor.optim.warmup_steps=2",
            "actor.optim.total_steps=8",
            "job.entry=benchmarks.failover:job", "cluster.allowed_packages=[benchmarks,tests]"]


def test_a_rank_killed_mid_update_is_replaced_and_the_run_ends_bit_for_bit(tmp_path):
    """trainer.failover: rank 1 SIGKILLed halfway through step 3's update; its replacement alone
    starts, every rank takes step 3's start back (rank 1's from rank 0's copy) and step 3 runs
    again. The run ends with the weights of an uninterrupted run, bit for bit, each step once
    (step 2's end was kept before its evaluation, which changes nothing the next step draws from).
    Then rank 0 (the rendezvous' host) and rank 1 again, in one run: two failovers, the same end.
    The kills are at steps no evaluation follows: a death during one is trainer.max_restarts' to handle."""
    from asyncrl.models.tiny import ensure_tiny_model
    from benchmarks.failover import KILL_ENV, _trained
    from tests.rl.test_rl import _launch

    model = ensure_tiny_model(tmp_path / "model", task="sort", hidden=64, layers=2, heads=4, sft_steps=0)
    runs = {}
    for name, env in (("plain", {}), ("killed", {KILL_ENV: "3:1"}), ("twice", {KILL_ENV: "1:0,3:1"})):
        res = _launch("grpo", tmp_path / name, model, FAILOVER, env=env)
        assert res.returncode == 0, res.stderr[-4000:]
        runs[name] = json.loads(res.stdout.strip().splitlines()[-1])
    plain, killed, twice = runs["plain"], runs["killed"], runs["twice"]
    assert killed["killed"]["worker"].startswith("actor_rollout_ref-1-"), killed["killed"]
    (event,) = killed["failovers"]
    assert event["rank"] == 1 and event["worker"] == killed["killed"]["worker"], event
    # the redone step's prompts drawn again: the same ones; every step trained the uninterrupted run's
    steps = [s for s, _ in killed["draws"]]
    assert steps == sorted(steps) and len(steps) == 5 and steps.count(event["step"]) == 2, killed["draws"]
    assert _trained(killed["draws"]) == _trained(plain["draws"]) == _trained(twice["draws"])
    assert plain["failovers"] == [] and killed["steps"] == plain["steps"] == twice["steps"] == 4
    # the same weights, bit for bit
    assert killed["weights_digest"] == plain["weights_digest"] == twice["weights_digest"]
    rows = _steps(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["trainer/failovers"] for r in rows] == [float(r["step"] >= event["step"]) for r in rows]
    assert 0 < rows[event["step"] - 1]["trainer/failover_resume_s"] < 60
    assert all(r["trainer/restarts"] == 0 for r in rows)
    assert [e["rank"] for e in twice["failovers"]] == [0, 1], twice["failovers"]
    assert [r["step"] for r in _steps(tmp_path / "twice" / "metrics.jsonl")] == [1, 2, 3, 4]
    # what the run kept of its rollouts (trainer.keep_rollouts=32: every one of 8 rows a step here)
    import pyarrow.parquet as pq

    kept = [r for f in sorted((tmp_path / "plain" / "rollouts").glob("rank*/*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    assert sorted({r["rank"] for r in kept}) == [0, 1] and [sum(r["step"] == s for r in kept) for s in range(1, 5)] == [8] * 4
    assert all(r["prompt"].startswith("<bos>") and len(r["rollout_log_probs"]) == len(r["response_ids"]) for r in kept)
