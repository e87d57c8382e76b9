"""reasoning-gym's tasks as data and reward (`data.source=reasoning_gym:<task>`): rows in verl's
layout scored by each task's own scorer through the built-in reward, held-out rows apart from
training by seed, settings checked with errors that say what to do, and the tiny model learning a
task end to end."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

from asyncrl.config import rl_config
from asyncrl.data.dataset import PromptDataset, collate_prompts
from asyncrl.data.reasoning_gym import row_words
from asyncrl.launch import load_config
from asyncrl.models.resolve import tiny_settings
from asyncrl.models.tiny import build_tokenizer, ensure_tiny_model
from asyncrl.preflight import check_round_trip
from asyncrl.rewards import load_reward_fn
from asyncrl.roles.reward import RuleRewardWorker
from asyncrl.run_data import generated_rows
from asyncrl.single_controller.batch import Batch
from transport.checks import ConfigError
from transport.codec import decode, encode

# chain_sum's rows are short sums; rearc's scorer compares boards as tuples, which JSON and the
# wire codec turn into lists
TWO_TASKS = {"source": "reasoning_gym:chain_sum,rearc",
             "reasoning_gym": {"size": 6, "n_val": 4, "tasks": {"chain_sum": {"max_terms": 3}}}}


def _rows(data: dict) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows as the trainer makes them for a `data` section."""
    return generated_rows(rl_config({"data": data}).data)[1]


def _scores(rows: list[dict], responses: list[str]) -> list[float]:
    """Each row's response scored by the built-in reward as the reward worker scores it: the rows
    tokenised and collated as training prompts are, their batch sent through the wire codec."""
    tokenizer = build_tokenizer(row_words(rows))
    prompts = collate_prompts(PromptDataset(rows, tokenizer, max_prompt_len=4096).items, tokenizer.pad_token_id)
    columns = {k: prompts[k] for k in ("data_source", "ground_truth", "extra_info", "raw_prompt")}
    batch = decode(encode(Batch({"response_mask": torch.ones(len(rows), 1)}, columns)))
    scores, _ = RuleRewardWorker._score(load_reward_fn(None), "the built-in reward", responses, batch)
    return scores.tolist()


def test_rows_are_in_verls_layout_and_json_safe():
    train, val = _rows(TWO_TASKS)
    assert len(train) == 6 and len(val) == 4
    assert [r["data_source"] for r in train[:2]] == ["reasoning_gym/chain_sum", "reasoning_gym/rearc"]  # mixed
    row = train[0]
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["reasoning_gym"]["entry"]["question"]}]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["reasoning_gym"]["entry"]["answer"]
    assert row["extra_info"]["reasoning_gym"]["settings"]["max_terms"] == 3
    assert json.loads(json.dumps(train + val)) == train + val
    system = _rows({**TWO_TASKS, "source": "reasoning_gym:chain_sum",
                    "reasoning_gym": {"size": 2, "n_val": 0, "system_prompt": "direct"}})[0]
    assert system[0]["prompt"][0]["role"] == "system" and "<answer>" in system[0]["prompt"][0]["content"]


def test_right_answers_score_one_and_wrong_ones_zero():
    train, val = _rows(TWO_TASKS)
    rows = train + val
    answers = [r["reward_model"]["ground_truth"] for r in rows]
    assert _scores(rows, answers) == [1.0] * len(rows)
    # reasoning-gym's answer tags, a thinking model's reasoning before them
    tagged = [f"<think>let me see: 1 + 1</think>\nso <answer> {a} </answer>" for a in answers]
    assert _scores(rows, tagged) == [1.0] * len(rows)
    assert _scores(rows, ["I do not know"] * len(rows)) == [0.0] * len(rows)
    sums = [r for r in rows if r["data_source"].endswith("chain_sum")]
    wrong = [f"<answer>{int(r['reward_model']['ground_truth']) + 1}</answer>" for r in sums]
    assert _scores(sums, wrong) == [0.0] * len(sums)


def test_held_out_rows_are_apart_from_training_by_seed():
    """reasoning-gym draws row i of a generator from Random(seed + i): the held-out generator
    starts where the training rows' seeds end, so no seed makes a row of both."""
    data = {"source": "reasoning_gym:chain_sum", "reasoning_gym": {"size": 50, "n_val": 20, "seed": 7}}
    train, val = _rows(data)

    def seeds(rows: list[dict]) -> set[int]:
        return {r["extra_info"]["reasoning_gym"]["settings"]["seed"] + r["extra_info"]["index"] for r in rows}

    assert seeds(train) == set(range(7, 57)) and seeds(val) == set(range(57, 77))
    questions = {r["prompt"][-1]["content"] for r in train}
    assert not any(r["prompt"][-1]["content"] in questions for r in val)  # chain_sum's default space is large
    assert _rows(data) == (train, val)  # a pure function of the settings
    assert _rows({**data, "reasoning_gym": {**data["reasoning_gym"], "seed": 8}})[0] != train


@pytest.mark.parametrize("data,message", [
    ({"source": "reasoning_gym:chian_sum"}, "no task 'chian_sum'; did you mean chain_sum"),
    ({"source": "gym:chain_sum"}, r"must look like reasoning_gym:<task>\[,<task>...\]"),
    ({"source": "reasoning_gym:chain_sum,chain_sum"}, "more than once"),
    ({"source": "reasoning_gym:chain_sum", "reasoning_gym": {"tasks": {"chain_sum": {"min_term": 2}}}},
     "chain_sum has no setting 'min_term'; did you mean min_terms"),
    ({"source": "reasoning_gym:chain_sum", "reasoning_gym": {"tasks": {"chain_sum": {"min_terms": 3, "max_terms": 2}}}},
     "ChainSumConfig refuses these settings .max_terms must be >= min_terms"),
    ({"source": "reasoning_gym:chain_sum", "reasoning_gym": {"tasks": {"chain_sum": {"seed": 1}}}},
     "set for every task by data.reasoning_gym.seed"),
    ({"source": "reasoning_gym:chain_sum", "reasoning_gym": {"tasks": {"gcd": {}}}}, "gcd is not in data.source"),
    ({"reasoning_gym": {"tasks": {"gcd": {}}}}, "only applies with data.source=reasoning_gym"),
    ({"source": "reasoning_gym:chain_sum", "reasoning_gym": {"system_prompt": "defualt"}}, "DeepSeekZero, default"),
    ({"source": "reasoning_gym:chain_sum", "reasoning_gym": {"size": 0}}, "size=0: must be > 0"),
    ({"source": "reasoning_gym:chain_sum", "train_files": "train.parquet"}, "replaces data.train_files"),
    ({"source": "reasoning_gym:chain_sum,n_queens"}, r"n_queens's scorer runs eval\(\) on the model's answer"),
], ids=["unknown_task", "form", "twice", "setting_typo", "refused_value", "seed_per_task", "task_not_in_source",
        "tasks_without_source", "system_prompt", "size", "and_files", "eval_scorer"])
def test_bad_settings_are_config_errors_that_say_what_to_do(data, message):
    with pytest.raises(ConfigError, match=message):
        rl_config({"data": data})


def test_missing_reasoning_gym_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'asyncrl\[gym\]'"):
        rl_config({"data": {"source": "reasoning_gym:chain_sum"}})


def test_the_tiny_model_speaks_the_rows_words(tmp_path):
    """A reasoning-gym tiny build: every word of the rows is in its vocabulary (the prompts
    round-trip, no <unk>); other rows are another model, refused rather than reused; without
    data.source there is nothing to build from."""
    cfg = rl_config({"data": {**TWO_TASKS, "source": "reasoning_gym:chain_sum"},
                     "model": {"build_tiny": {"task": "reasoning_gym", "hidden": 32, "layers": 1, "heads": 1,
                                              "sft_steps": 2}}})
    path = ensure_tiny_model(tmp_path / "m", **tiny_settings(cfg.model.build_tiny, cfg.data))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    train, val = generated_rows(cfg.data)[1]
    items = PromptDataset(train + val, tokenizer, max_prompt_len=64).items
    assert len(items) == len(train + val) and check_round_trip(tokenizer, items)
    assert all(tokenizer.unk_token_id not in it.input_ids for it in items)
    other = replace(cfg.data, reasoning_gym=replace(cfg.data.reasoning_gym, seed=1))
    with pytest.raises(ConfigError, match="other settings"):
        ensure_tiny_model(path, **tiny_settings(cfg.model.build_tiny, other))
    with pytest.raises(ConfigError, match="set data.source=reasoning_gym"):
        tiny_settings(cfg.model.build_tiny, replace(cfg.data, source=None))


@pytest.mark.slow  # ~50 s (suite time); GRPO's learning signal: tests/rl/test_rl.py::test_grpo_learns_by_default
@pytest.mark.timeout(300)
def test_the_tiny_model_learns_a_reasoning_gym_task(tmp_path):
    """`--config-name gym_quickstart` shortened to 100 steps: the warm-started model answers every
    question alike; GRPO, scored by reasoning-gym's count_bits scorer, must have it read the number
    and raise the held-out greedy reward by 0.2 (measured 0.33 -> 0.76; seeds 1 and 2: 0.76, 0.70)."""
    from tests.rl.test_rl import _launch

    cfg = rl_config(load_config("gym_quickstart", []))
    model = ensure_tiny_model(tmp_path / "model", **tiny_settings(cfg.model.build_tiny, cfg.data))
    out = tmp_path / "gym"
    res = _launch("gym_quickstart", out, model, ["trainer.total_steps=100", "trainer.eval_every=100",
                                                 "trainer.save_every=100", "trainer.loggers=[console,jsonl]"],
                  small=False, timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["val_reward_end"] - summary["val_reward_start"] >= 0.2, summary
