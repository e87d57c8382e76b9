"""benchmarks.reshard: Table 2's volumes by hand, and a tiny 4-rank run of all four methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.reshard import table2

REPO = Path(__file__).resolve().parents[2]


def test_table2_by_hand() -> None:
    # HybridFlow's comparison point t=4, tg=2, p=pg=d=1: (tp - tg·pg)/(tg·pg·tp)·M = 2/8·M
    f = table2(split_bytes=800, replicated_bytes=0, t=4, tg=2, d=1)
    assert f["hybridflow"] == pytest.approx(200)
    assert f["hybridflow_v"] == pytest.approx(600)  # (tp-1)/tp·M
    assert f["dschat"] == pytest.approx(600)  # (tpd-1)/tpd·M
    assert f["peak_hybridflow"] == pytest.approx(400)  # M/(tg·pg)
    # replicated weights move only when FSDP shards them over d > 1
    assert table2(800, 16, t=4, tg=2, d=1)["hybridflow"] == pytest.approx(200)
    f = table2(800, 16, t=4, tg=2, d=2)
    assert f["hybridflow"] == pytest.approx(800 * (1 / 2 - 1 / 8) + 8)  # M/(tg·pg) - M/(tpd)
    assert f["dschat"] == pytest.approx(816 * 7 / 8)
    assert f["peak_hybridflow"] == pytest.approx(400 + 16)


def test_tiny_run() -> None:
    """4 gloo ranks, t=4 -> tg=2, a 2-layer model: every method's shards checked inside the run,
    the reshard's bytes on Table 2's formula, the peers' bytes on theirs."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmarks.reshard", "--hidden", "64", "--layers", "2",
           "--heads", "4", "--vocab", "64", "--reps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["correct"] is True
    assert (out["ranks"], out["t"], out["tg"], out["d"]) == (4, 4, 2, 1)
    assert abs(out["bytes_ratio"] - 1) <= 0.01
    assert out["bytes_per_rank"] == out["bytes_per_rank_min"] == out["expected_bytes"]
    assert out["bytes_per_rank_v"] == pytest.approx(out["formula_bytes_v"], rel=0.01)
    assert out["bytes_per_rank_dschat"] == pytest.approx(out["formula_bytes_dschat"], rel=0.01)
    assert out["bytes_per_rank"] < out["bytes_per_rank_v"]
    # The generation buffer is exactly the formula's M/(tg·pg). At this size one bucket of the
    # Resharder's 64 KiB staging floor is ~40 % of that buffer, so the 1.05x bound only holds
    # at real sizes (3 % at the 117 M default); here the peak is buffer + at most one bucket.
    assert out["buffer_bytes"] == out["peak_formula_bytes"]
    assert out["buffer_bytes"] <= out["peak_extra_bytes"] <= out["buffer_bytes"] + out["staging_bytes"]
    assert all(out[f"time_{m}_s"] > 0 for m in ("hybridflow", "hybridflow_v", "dschat", "full_state"))


@pytest.mark.slow  # ~14 s (suite time); tests/rl/test_hybrid_engine.py checks the pipeline reshard (p2-t2-tg1)
def test_tiny_pipeline_run() -> None:
    """4 gloo ranks, p=2 stages of t=2 -> tg=1: the full model's generation shards checked inside
    the run for every method, the reshard's bytes equal to the Resharder's exact count."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmarks.reshard", "--tp", "2", "--gen-tp", "1", "--pp", "2",
           "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "64", "--reps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["correct"] is True
    assert (out["ranks"], out["p"], out["t"], out["tg"], out["d"]) == (4, 2, 2, 1, 1)
    assert out["model"]["tied"] is False and out["model"]["untied_for_pp"] is True
    assert out["bytes_per_rank"] == out["expected_bytes"]
    assert out["bytes_per_stage"] == out["expected_bytes_per_stage"]
    assert sum(out["stage_bytes"]) == out["M_bytes"]
    # unequal stages move bytes_ratio off 1 by the stage imbalance (tg=1: 1 - r/(t·p) over 1 - 1/(t·p))
    r = out["stage_imbalance"]
    assert out["bytes_ratio"] == pytest.approx((1 - r / 4) / (1 - 1 / 4), abs=0.01)
    assert out["bytes_per_rank_dschat"] == pytest.approx(out["formula_bytes_dschat"], rel=0.01)
    assert all(out[f"time_{m}_s"] > 0 for m in ("hybridflow", "hybridflow_v", "dschat", "full_state"))
