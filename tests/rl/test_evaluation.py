"""What a researcher sees: pass@k and per-source scores, completions at each evaluation, dict
rewards with logged extras, evaluation mode, and RL jobs submitted to a daemon by config name."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms import advantage
from asyncrl.evaluation import format_samples, pass_at_k, pass_at_ks, sample_rows, source_means
from asyncrl.rewards import REWARD_EXTRA, NonFiniteRewardError
from asyncrl.roles.reward import RuleRewardWorker
from asyncrl.single_controller.batch import Batch
from tests.helpers import forked
from tests.rl.test_rl import _launch, tiny_model  # noqa: F401  (a module-scoped fixture)


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def _rows(spec: dict[str, list[float]]) -> list[dict]:
    """Two samples per prompt, prompts numbered across sources in order."""
    rows = []
    for source, scores in spec.items():
        for s in scores:
            rows.append({"prompt_index": len(rows) // 2, "data_source": source, "score": s,
                         "prompt": f"p{len(rows) // 2}", "response": f"r{len(rows)}"})
    return rows


def test_pass_at_ks_per_data_source():
    rows = _rows({"gsm8k": [1.0, 0.0, 0.0, 0.0], "math": [1.0, 1.0]})  # prompts 0, 1 (gsm8k), 2 (math)
    out = pass_at_ks(rows, [1, 2], correct_at=1.0)
    assert out["eval/gsm8k/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["eval/gsm8k/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["eval/math/pass@1"] == 1.0 and out["eval/math/prompts"] == 1.0
    assert out["eval/all/pass@2"] == pytest.approx(2 / 3)
    assert out["eval/gsm8k/mean@2"] == pytest.approx(0.25)
    assert source_means(rows) == {"val/reward/gsm8k": 0.25, "val/reward/math": 1.0}
    picked = sample_rows(rows, 2)
    assert {r["data_source"] for r in picked} == {"gsm8k", "math"}  # spread over sources
    assert "score 1.000" in format_samples(5, picked)


def _reward_batch(n: int) -> Batch:
    return Batch({"response_mask": torch.ones(n, 3, dtype=torch.long)},
                 {"data_source": ["s"] * n, "ground_truth": ["1"] * n, "extra_info": [None] * n,
                  "raw_prompt": ["p"] * n})


def test_dict_rewards_give_the_score_and_log_numeric_extras():
    def fn(source, text, truth, extra):
        return {"score": float(text == "a"), "acc": text == "a", "pred": text} if text != "c" else {"score": 0.5}

    scores, extras = RuleRewardWorker._score(fn, "reward.fn=f", ["a", "b", "c"], _reward_batch(3))
    assert scores.tolist() == [1.0, 0.0, 0.5]
    acc = extras[REWARD_EXTRA + "acc"]
    assert acc[:2].tolist() == [1.0, 0.0] and math.isnan(acc[2]) and set(extras) == {REWARD_EXTRA + "acc"}
    with pytest.raises(NonFiniteRewardError, match="without a 'score'"):
        RuleRewardWorker._score(lambda *a: {"acc": 1.0}, "reward.fn=f", ["a"], _reward_batch(1))
    batch = Batch({"response_mask": torch.ones(4, 2), "scores": torch.tensor([1.0, 0.0, 1.0, 1.0]),
                   REWARD_EXTRA + "acc": torch.tensor([1.0, 0.0, float("nan"), 1.0])},
                  {"uid": ["x", "x", "y", "y"]})
    meta = advantage.grpo(batch).meta
    assert meta["reward/acc"] == pytest.approx(2 / 3)  # the rows that reported it


def test_own_parquet_and_dict_reward_train_with_completions_shown(tmp_path, tiny_model):  # noqa: F811
    """The user's own verl-layout parquet and a dict-returning reward, only paths overridden."""
    from asyncrl.data.synthetic import disjoint_splits, write_rows

    train, val = disjoint_splits("sort", 64, 6, seed=3)
    write_rows(train, tmp_path / "train.parquet")
    write_rows(val, tmp_path / "test.parquet")
    reward = tmp_path / "my_reward.py"
    reward.write_text("import logging\n"
                      "def score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    logging.getLogger('my_reward').warning('scoring %s', data_source)\n"
                      "    ok = solution_str.strip() == str(ground_truth).strip()\n"
                      "    return {'score': float(ok), 'acc': ok, 'length': len(solution_str)}\n")
    out = tmp_path / "run"
    r = _launch("grpo", out, tiny_model, ["trainer.total_steps=2", "trainer.eval_every=2", "trainer.save_every=2",
                                          f"reward.fn={reward}:score", "trainer.loggers=[console,jsonl]",
                                          f"data.train_files={tmp_path / 'train.parquet'}",
                                          f"data.val_files={tmp_path / 'test.parquet'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out completions" in r.stderr and "response:" in r.stderr  # on the console
    # a warning logged on the workers reaches the console, once for all calls and ranks
    assert r.stderr.count("WARNING my_reward: scoring asyncrl/sort") == 1, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["step"] > 0]
    assert all("reward/acc" in row and "reward/length" in row for row in trained)
    assert all(0 <= row["response/clip_ratio"] <= 1 and row["actor/entropy"] > 0 for row in trained)
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 2} and all(s["prompt"] and "score" in s for s in samples)
    # each evaluation's greedy pass@1 per source (a prompt passes when its score reaches evaluation.correct_at)
    evaluated = [row for row in rows if "val/reward" in row and row["step"] > 0]
    assert evaluated and all(0 <= row["eval/asyncrl/sort/pass@1"] == row["eval/all/pass@1"] <= row["val/reward"] + 1e-9
                             for row in evaluated), evaluated


def test_eval_mode_reports_pass_at_k_per_data_source(tmp_path, tiny_model):  # noqa: F811
    out = tmp_path / "eval"
    r = _launch("eval", out, tiny_model, ["rollout.n=4", "evaluation.ks=[1,2,4]", "data.synthetic.n_val=6",
                                          "rollout.max_tokens=4"], small=False)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["mode"] == "eval" and result["samples_per_prompt"] == 4
    assert result["eval/asyncrl/sort/prompts"] == 6.0
    assert 0.0 <= result["eval/asyncrl/sort/pass@1"] <= result["eval/asyncrl/sort/pass@2"] <= result["eval/asyncrl/sort/pass@4"] <= 1.0
    generations = [json.loads(ln) for ln in Path(result["generations"]).read_text().splitlines()]
    assert len(generations) == 24 and {g["sample"] for g in generations} == {0, 1, 2, 3}
    assert not (out / "checkpoints").exists()  # nothing trained, nothing saved


@pytest.mark.slow  # ~27 s (suite time); test_eval_mode_reports_pass_at_k_per_data_source runs --config-name eval by default
def test_the_readme_eval_command_on_a_users_parquet_and_reward_file_twice(tmp_path, tiny_model):  # noqa: F811
    """`asyncrl-launch --config-name eval model.path=<model> data.val_files=<parquet>
    reward.fn=<file>:<fn>` exactly as the README writes it (the installed command, nothing else
    set but a small rollout), run twice into the same output directory: both print pass@k."""
    from asyncrl.data.synthetic import disjoint_splits, write_rows

    _, val = disjoint_splits("sort", 8, 5, seed=7)
    write_rows(val, tmp_path / "test.parquet")
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return float(solution_str.strip() == str(ground_truth).strip())\n")
    launch = Path(sys.executable).parent / "asyncrl-launch"
    args = [str(launch), "--config-name", "eval", f"model.path={tiny_model}",
            f"data.val_files={tmp_path / 'test.parquet'}", f"reward.fn={reward}:score",
            "rollout.n=2", "evaluation.ks=[1,2]", "rollout.max_tokens=4"]
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "state")}
    results = []
    for _ in range(2):  # the second evaluation writes beside the first one's file
        r = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    for result in results:
        assert result["mode"] == "eval" and result["eval/asyncrl/sort/prompts"] == 5.0
        assert 0.0 <= result["eval/asyncrl/sort/pass@1"] <= result["eval/asyncrl/sort/pass@2"] <= 1.0
    files = sorted((tmp_path / "outputs" / "eval").glob("eval-*.jsonl"))
    assert [f.name for f in files] == sorted(Path(r["generations"]).name for r in results) and len(files) == 2
    assert all(len(f.read_text().splitlines()) == 10 for f in files)  # 5 prompts x 2 samples


def test_eval_mode_refuses_k_above_the_samples(tmp_path):
    r = forked.run([sys.executable, "-m", "asyncrl.launch", "--config-name", "eval", "rollout.n=2",
                        "evaluation.ks=[1,4]", f"trainer.output_dir={tmp_path}"],
                       timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2 and "evaluation.ks" in r.stderr


def test_dataset_keys_are_configurable(tmp_path):
    from asyncrl.data.dataset import DatasetError, PromptDataset, check_data_file
    from asyncrl.data.synthetic import write_rows
    from asyncrl.models.tiny import build_tokenizer

    rows = [{"question": "sort 3 1 2", "meta": {"solution": "1 2 3"}}]
    path = write_rows(rows, tmp_path / "mine.parquet")
    check_data_file(path, prompt_key="question", answer_key="meta.solution")
    with pytest.raises(DatasetError, match="data.prompt_key"):
        check_data_file(path)  # the default keys are not there, and the message says which keys to set
    items = PromptDataset(rows, build_tokenizer(), 64, prompt_key="question", answer_key="meta.solution").items
    assert items[0].ground_truth == "1 2 3"
    with pytest.raises(DatasetError, match="meta.answer"):
        PromptDataset(rows, build_tokenizer(), 64, prompt_key="question", answer_key="meta.answer")


def test_tokenizer_round_trip_check_catches_dropped_spaces():
    from asyncrl.data.dataset import PromptDataset
    from asyncrl.data.synthetic import make_rows
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.preflight import check_round_trip

    tok = build_tokenizer()
    items = PromptDataset(make_rows("sort", 4, 0), tok, 64).items
    assert check_round_trip(tok, items)  # a word-level decoder adds spaces: fine

    class SpaceEater:  # what a mismatched pre-tokenizer does
        def decode(self, ids):
            return tok.decode(ids).replace(" ", "")

    assert not check_round_trip(SpaceEater(), items)


def test_batched_reward_functions_score_the_whole_batch():
    calls = []

    def batched(sources, texts, truths, extras):
        calls.append(len(texts))
        return [{"score": float(t == "a"), "len": len(t)} for t in texts]

    scores, extras = RuleRewardWorker._score(batched, "reward.fn=f", ["a", "bb"], _reward_batch(2), batched=True)
    assert calls == [2] and scores.tolist() == [1.0, 0.0] and extras[REWARD_EXTRA + "len"].tolist() == [1.0, 2.0]
    with pytest.raises(NonFiniteRewardError, match="returned 1 values for 2"):
        RuleRewardWorker._score(lambda *a: [1.0], "reward.fn=f", ["a", "b"], _reward_batch(2), batched=True)


@pytest.mark.slow  # ~18 s (suite time); test_user_paths scores with a reward model by default
def test_a_learned_reward_model_can_be_the_reward(tmp_path, tiny_model):  # noqa: F811
    out = tmp_path / "rm"
    # the tiny LM loaded as a sequence classifier (a fresh one-output head) scores the responses
    r = _launch("grpo", out, tiny_model, ["trainer.total_steps=2", "trainer.eval_every=2", "trainer.save_every=2",
                                          f"reward.model_path={tiny_model}", "trainer.loggers=[console,jsonl]"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["step"] > 0]
    assert all("timing/reward_model_s" in row and "timing/reward_s" not in row for row in trained)
    assert len({row["critic/score_mean"] for row in trained}) == 2  # real-valued model scores
    bad = forked.run([sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo",
                          f"reward.model_path={tiny_model}", "reward.fn=x.py:f", f"trainer.output_dir={tmp_path / 'x'}"],
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert bad.returncode == 2 and "reward.model_path" in bad.stderr
