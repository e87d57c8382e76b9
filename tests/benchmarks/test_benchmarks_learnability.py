"""benchmarks.learnability: the reference loop's numerics, and a 3-step run of both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.config import ActorConfig
from benchmarks.learnability import clipped_loss, first_gain_step, grpo_advantage

REPO = Path(__file__).resolve().parents[2]


def test_grpo_advantage_by_hand() -> None:
    adv = grpo_advantage(torch.tensor([1.0, 0.0, 0.5, 0.5]), n=2)
    std = 2 ** -0.5  # unbiased std of (1, 0)
    assert torch.allclose(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(grpo_advantage(torch.tensor([1.0, 0.0]), n=2, norm_by_std=False),
                          torch.tensor([0.5, -0.5]))


def test_clipped_loss_by_hand() -> None:
    ac = ActorConfig(clip_ratio=0.2, clip_ratio_c=3.0)
    mask = torch.ones(3, 1)
    old = torch.zeros(3, 1)
    # ratios 2, 2, 5 for advantages +1, -1, -1: clipped to 1.2; -A*ratio = 2; dual clip at 3
    logp = torch.log(torch.tensor([[2.0], [2.0], [5.0]]))
    loss = clipped_loss(logp, old, torch.tensor([1.0, -1.0, -1.0]), mask, ac, norm_len=1)
    assert loss.item() == pytest.approx((-1.2 + 2.0 + 3.0) / 3, abs=1e-5)


def test_first_gain_step() -> None:
    assert first_gain_step([(0, 0.1), (25, 0.2), (50, 0.3), (75, 0.5)]) == 50
    assert first_gain_step([(0, 0.1), (25, 0.2)]) is None


@pytest.mark.slow  # ~20 s: the benchmark's harness; the learning tests cover the signal
def test_three_steps_both_sides(tmp_path: Path) -> None:
    """The quickstart (as a subprocess) and the reference, 3 steps each: same start on the same
    held-out prompts, one JSON summary, and no run directory left in the temp dir."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.learnability", "--steps", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "learnability" and out["seeds"] == [0]
    assert out["steps_asyncrl"] == out["steps_reference"] == [3]
    assert out["recipe"]["total_steps"] == 3 and out["recipe"]["n_val"] == 128
    # the same init, prompts and greedy decoding: the same step-0 reward up to rounding paths
    assert abs(out["reward_start_asyncrl"][0] - out["reward_start_reference"][0]) <= 0.02
    assert "gain_ratio" in out and out["wall_s_asyncrl"][0] > 0 and out["wall_s_reference"][0] > 0
    # (torch may keep its own compile cache there: not ours to remove)
    assert list(tmp_path.glob("asyncrl-learnability-*")) == []
