"""`trainer.replay`: every step's actor update kept on its ranks (the last `window` steps), and
`asyncrl replay RUN_DIR --step N` re-running it from the checkpoint before it, bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asyncrl.roles.replay import NonFiniteWatch, _prune
from tests.helpers import forked


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The quickstart for 8 steps on two ranks, a checkpoint at 5, the last 4 steps kept; two
    epochs a step, so the old log-probs are a pass of their own."""
    tmp = tmp_path_factory.mktemp("replay")
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state")}
    res = forked.launch(["--config-name", "quickstart", f"trainer.output_dir={tmp / 'run'}", f"model.path={tmp / 'model'}",
                         "trainer.total_steps=8", "trainer.save_every=5", "trainer.eval_every=8",
                         "trainer.loggers=[jsonl]", "trainer.replay.window=4", "actor.ppo_epochs=2"],
                        env=env, cwd=tmp, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp, env


def _replay(run, *args: str):
    tmp, env = run
    return forked.launch(["replay", str(tmp / "run"), *args], env=env, cwd=tmp, timeout=600, command="asyncrl")


def test_a_kept_step_replays_bit_for_bit(run):
    tmp, _ = run
    assert sorted(p.name for p in (tmp / "run" / "replay").glob("step_*")) == [f"step_{s}" for s in (5, 6, 7, 8)]
    hydra = {p.name: p.read_bytes() for p in (tmp / "run" / ".hydra").iterdir()}
    res = _replay(run, "--step", "7", "--log-probs")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["from_checkpoint"] == 5 and summary["replayed_steps"] == 2, summary
    assert summary["bit_exact"] and summary["weights_equal"] and summary["loss_equal"], summary
    assert summary["old_log_probs_equal"] is True
    assert {p.name: p.read_bytes() for p in (tmp / "run" / ".hydra").iterdir()} == hydra  # the run's record kept


def test_a_planted_nan_is_named_with_its_module_and_micro_batch(run):
    res = _replay(run, "--step", "6", "--plant-nan", "model.layers.1.mlp@1")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    found = summary["nonfinite"]
    assert (found["module"], found["micro_batch"], found["value"]) == ("model.layers.1.mlp", 1, "nan"), found
    assert not summary["bit_exact"] and not summary["weights_equal"]  # a NaN'd update is no longer the run's


def test_a_step_that_cannot_be_replayed_exits_2_saying_why(run, tmp_path):
    res = _replay(run, "--step", "3")
    assert res.returncode == 2 and "trainer.replay.window" in res.stderr and "Traceback" not in res.stderr, res.stderr
    tmp, env = run
    res = forked.launch(["replay", str(tmp_path), "--step", "1"], env=env, cwd=tmp, timeout=60, command="asyncrl")
    assert res.returncode == 2 and "is not a run directory" in res.stderr, res.stderr


def test_bundles_keep_the_window_and_the_disk_budget(tmp_path):
    for step in range(1, 7):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "rank0.pt").write_bytes(b"x" * 1000)
        (tmp_path / f"step_{step}" / "rank1.pt").write_bytes(b"x" * 1000)
    _prune(tmp_path, 0, window=4, budget=2500)  # rank 0: its newest two fit the budget
    assert [s for s in range(1, 7) if (tmp_path / f"step_{s}" / "rank0.pt").exists()] == [5, 6]
    assert all((tmp_path / f"step_{s}" / "rank1.pt").exists() for s in range(1, 7))  # another rank's are its own
    _prune(tmp_path, 1, window=1, budget=10**6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5", "step_6"]  # emptied steps go


def test_the_finder_names_the_innermost_module_whose_output_is_not_finite():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    watch = NonFiniteWatch(model, plant="1.0@2")
    for _ in range(3):
        watch.next_micro_batch()
        model(torch.ones(1, 2))
    watch.close()
    assert (watch.first.module, watch.first.micro_batch) == ("1.0", 2)
