"""The recipes in examples/ compose and validate as asyncrl-launch would compose them, plan on
their devices, and the preprocessing turns published rows into what the rewards score."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import rl_config
from asyncrl.data.dataset import check_data_file, load_rows
from asyncrl.data.preprocess import main as preprocess
from asyncrl.launch import load_config
from asyncrl.plan.cli import main as plan_main
from asyncrl.rewards import default_reward
from asyncrl.rewards.rules import last_boxed, math_boxed, normalize_math

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
RECIPES = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_validates_and_plans(name, capsys):
    cfg = rl_config(load_config(name, [], str(EXAMPLES)))
    assert cfg.actor.optim.lr == pytest.approx(1e-6) and cfg.rollout.max_tokens >= 1024
    nodes = 2 if cfg.trainer.n_workers > 8 else 1
    args = ["--config-dir", str(EXAMPLES), "--config-name", name, "--json", "plan.device=h100", "plan.time_limit_s=2",
            f"cluster.nnodes={nodes}", "cluster.gpus_per_node=8"] + (["cluster.key_dir=/etc/asyncrl/keys"] if nodes > 1 else [])
    assert plan_main(args) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["step_s"] > 0 and plan["params"] > 4e8


def test_gsm8k_preprocessing_gives_rows_the_reward_scores(tmp_path):
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps({"question": "Tom has 3 apples and buys 1,000 more. How many?",
                               "answer": "3 + 1000 = <<3+1000=1003>>1003\n#### 1,003"}) + "\n")
    out = tmp_path / "gsm8k.parquet"
    assert preprocess(["gsm8k", "--input", str(src), "--output", str(out)]) == 0
    check_data_file(out)
    (row,) = load_rows(out)
    assert row["reward_model"]["ground_truth"] == "1003" and row["extra_info"]["split"] == "test"
    assert "####" in row["prompt"][0]["content"]
    assert default_reward(row["data_source"], "so the total is #### 1003", "1003") == 1.0
    assert preprocess(["gsm8k", "--input", str(src), "--output", str(out)]) == 2  # never over a file


def test_math_preprocessing_and_reward(tmp_path):
    problems = tmp_path / "MATH" / "test" / "algebra"
    problems.mkdir(parents=True)
    (problems / "1.json").write_text(json.dumps({"problem": "What is $1/2 + 1/4$?", "level": "Level 1",
                                                 "type": "Algebra", "solution": "We get $\\boxed{\\frac{3}{4}}$."}))
    out = tmp_path / "math.parquet"
    assert preprocess(["math", "--input", str(tmp_path / "MATH" / "test"), "--output", str(out)]) == 0
    (row,) = load_rows(out)
    assert row["data_source"] == "hendrycks/math" and row["reward_model"]["ground_truth"] == "\\frac{3}{4}"
    assert default_reward("hendrycks/math", "Thus \\boxed{\\dfrac{3}{4}}.", "\\frac{3}{4}") == 1.0
    assert math_boxed("math", "3/4", "\\frac{3}{4}") == 0.0  # no boxed answer: no credit
    assert last_boxed("\\boxed{a} then \\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert normalize_math("\\left( 1, 2 \\right)") == "(1,2)" and normalize_math("10.00") == "10"
