"""trainer.loggers: metrics.jsonl always, TensorBoard and Weights & Biases (offline) on request."""

from __future__ import annotations

import json
import subprocess

import pytest

from asyncrl.metrics import MetricsWriter
from transport.checks import ConfigError

wandb = pytest.importorskip("wandb", reason="wandb is a test dependency: pip install -e '.[test]'")

from tests.helpers.wandb_records import history, run_info  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb writes only under tmp_path: no network, no files in the user's home."""
    for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def _runs(out):
    return sorted((out / "wandb").glob("offline-run-*"))


def test_wandb_gets_every_step_the_config_and_the_samples(offline):
    out = offline / "run"
    w = MetricsWriter(out, ["console", "jsonl", "wandb"], run={"project": "proj", "name": "grpo-test",
                                                              "config": {"actor": {"optim": {"lr": 0.001}}}})
    w.write(0, {"val/reward": 0.25})
    w.write_samples(1, [{"data_source": "gsm8k", "score": 1.0, "prompt": "2+2?", "response": "4"}])
    w.write(1, {"critic/score_mean": 0.5, "actor/pg_loss": float("nan"), "note": "text is skipped"})
    w.close()
    w.close()  # idempotent
    (run,) = _runs(out)
    info = run_info(run)
    assert info.project == "proj" and info.display_name == "grpo-test"
    assert any(u.key == "actor" and "0.001" in u.value_json for u in info.config.update)
    rows = history(run)
    assert [int(r["_step"]) for r in rows] == [0, 1]
    assert json.loads(rows[0]["val/reward"]) == 0.25
    assert json.loads(rows[1]["critic/score_mean"]) == 0.5 and rows[1]["actor/pg_loss"] == "NaN"
    assert rows[1]["samples/_type"] == '"table-file"' and "note" not in rows[1]
    # metrics.jsonl is written as always
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [0, 1] and lines[1]["actor/pg_loss"] is None


def test_a_resumed_run_continues_the_same_wandb_run(offline):
    out = offline / "run"
    first = MetricsWriter(out, ["jsonl", "wandb"], run={"name": "r"})
    first.write(1, {"x": 1.0})
    first.close()
    run_id = (out / "wandb" / "run-id").read_text().strip()
    second = MetricsWriter(out, ["jsonl", "wandb"], resume_step=1, run={"name": "r"})
    second.write(2, {"x": 2.0})
    second.close()
    assert (out / "wandb" / "run-id").read_text().strip() == run_id
    runs = _runs(out)
    assert len(runs) == 2 and all(run_id in r.name for r in runs)
    assert [int(r["_step"]) for r in history(runs[-1])] == [2]


def test_without_wandb_nothing_is_started(tmp_path):
    w = MetricsWriter(tmp_path / "run", ["jsonl"])
    w.write(1, {"x": 1.0})
    w.close()
    assert not (tmp_path / "run" / "wandb").exists() and not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.parametrize("loggers,words", [
    ("[console,tensorboard]", "must keep jsonl"),
    ("[jsonl,mlflow]", "must be one of console, jsonl, tensorboard, wandb"),
    ("[jsonl,jsonl]", "names a logger twice"),
])
def test_bad_logger_lists_are_config_errors(loggers, words):
    from asyncrl.launch import load_config

    with pytest.raises(ConfigError, match=words):
        load_config("grpo", [f"trainer.loggers={loggers}"])


def test_a_writer_left_open_does_not_capture_the_next_run(offline):
    """A job that failed before closing its writer leaves its wandb run open in the process: the
    next writer gets a run of its own."""
    left_open = MetricsWriter(offline / "a", ["jsonl", "wandb"], run={"name": "a"})
    left_open.write(1, {"x": 1.0})
    second = MetricsWriter(offline / "b", ["jsonl", "wandb"], run={"name": "b"})
    second.write(1, {"x": 2.0})
    second.close()
    left_open.close()
    first_id = (offline / "a" / "wandb" / "run-id").read_text().strip()
    second_id = (offline / "b" / "wandb" / "run-id").read_text().strip()
    assert first_id != second_id
    (run,) = _runs(offline / "b")
    assert run_info(run).display_name == "b" and [r["x"] for r in history(run)] == ["2"]


@pytest.mark.alone  # no wandb-core process may be running on the host
def test_no_wandb_process_is_left_behind(offline):
    w = MetricsWriter(offline / "run", ["jsonl", "wandb"], run={"name": "r"})
    w.write(1, {"x": 1.0})
    w.close()
    left = subprocess.run(["pgrep", "-f", "wandb-core"], capture_output=True, text=True).stdout.split()
    assert not left, f"wandb processes still running: {left}"


def test_tensorboard_gets_every_number_of_every_step_and_a_resume_purges(tmp_path):
    """One event per step carries all its numbers (TensorBoard reads each as a scalar series);
    a run resumed at step 2 replaces the steps after it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    w = MetricsWriter(out, ["jsonl", "tensorboard"])
    for step in range(1, 5):
        w.write(step, {"critic/score_mean": step / 10, "timing/step_s": 0.5, "note": "not a number"})
    w.close()
    second = MetricsWriter(out, ["jsonl", "tensorboard"], resume_step=2)
    second.write(3, {"critic/score_mean": 0.9, "timing/step_s": 0.25})
    second.close()
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    assert set(ea.Tags()["scalars"]) == {"critic/score_mean", "timing/step_s"}
    got = {e.step: round(e.value, 6) for e in ea.Scalars("critic/score_mean")}
    assert got == {1: 0.1, 2: 0.2, 3: 0.9}, got
