"""Training backends and rollout engines by name (asyncrl.engines): one from another package,
through its entry point, runs a job without a line of asyncrl changed; unknown names say which
there are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.engines import backend, backends, rollout_engine, rollout_engines
from transport.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
import os

from asyncrl.engines import RolloutEngineKind
from asyncrl.rollout import RolloutEngine


class CountingEngine(RolloutEngine):
    """The native engine, counting its generate calls in a file."""

    def generate(self, *args, **kwargs):
        with open(os.environ["COUNTING_ENGINE_LOG"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return super().generate(*args, **kwargs)


def build(worker, model, colocated):
    tok = worker.tokenizer
    return CountingEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, device=worker.device)


ENTRY = RolloutEngineKind("counting_engine:build", records_routes=True, continuous_batching=True)
'''


def test_a_rollout_engine_of_another_package_runs_a_job_by_its_name(tmp_path):
    from asyncrl.models.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", task="sort", hidden=32, layers=1, heads=2, sft_steps=0)
    plugin = tmp_path / "plugin"
    (plugin / "counting_engine-0.1.dist-info").mkdir(parents=True)
    (plugin / "counting_engine.py").write_text(PLUGIN)
    (plugin / "counting_engine-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: counting-engine\nVersion: 0.1\n")
    (plugin / "counting_engine-0.1.dist-info" / "entry_points.txt").write_text(
        "[asyncrl.rollout_engines]\ncounting = counting_engine:ENTRY\n")
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(plugin)]), "COUNTING_ENGINE_LOG": str(calls),
           "ASYNCRL_STATE_DIR": str(tmp_path / "state")}
    args = [sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo", f"trainer.output_dir={tmp_path / 'run'}",
            f"model.path={model}", "model.build_tiny=null", "data.batch_size=4", "rollout.n=2", "rollout.max_tokens=4",
            "data.synthetic.n_train=16", "data.synthetic.n_val=4", "trainer.total_steps=2", "trainer.eval_every=100",
            "trainer.save_every=100", "trainer.loggers=[jsonl]"]
    res = subprocess.run([*args, "rollout.engine=counting"], capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    pids = calls.read_text().split()
    assert len(pids) >= 2 * 2 and len(set(pids)) == 2, pids  # 2 steps (and evaluations) on each of 2 ranks
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    res = subprocess.run([*args, "rollout.engine=nope"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert res.returncode == 2 and "rollout.engine" in res.stderr and "must be one of native, vllm, counting" in res.stderr, res.stderr[-2000:]


def test_unknown_names_list_the_known_ones():
    assert {"fsdp2", "megatron"} <= set(backends()) and {"native", "vllm"} <= set(rollout_engines())
    with pytest.raises(ConfigError, match="no rollout engine 'sglang'; known: native, vllm"):
        rollout_engine("sglang")
    with pytest.raises(ConfigError, match="no training backend 'deepspeed'; known: fsdp2, megatron"):
        backend("deepspeed")
