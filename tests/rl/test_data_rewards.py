"""Tiny model, synthetic data, prompt loading/batching and rule-based rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.data.dataset import (
    DatasetError,
    PromptDataset,
    PromptLoader,
    load_rows,
)
from asyncrl.data.synthetic import get_task, make_rows, score_answer, write_dataset, write_rows
from asyncrl.models.tiny import MARKER, build_tiny_model, ensure_tiny_model
from asyncrl.rewards import (
    RewardFnError,
    default_reward,
    exact_match,
    gsm8k,
    load_reward_fn,
    synthetic,
)
from transport.checks import ConfigError

SMALL = {"hidden": 32, "layers": 1, "heads": 2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", sft_steps=2, **SMALL)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


# ---- tiny model ---------------------------------------------------------------------------------


def test_tiny_model_reloads_with_auto_classes(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
    assert tokenizer.bos_token == "<bos>" and tokenizer.padding_side == "left"
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer.encode("sort 3 1 2")])
    assert model(input_ids=ids).logits.shape == (1, 4, len(tokenizer))
    assert json.loads((tiny_dir / MARKER).read_text())["sft_steps"] == 2
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"]


def test_chat_template_and_word_level_round_trip(tokenizer):
    messages = [{"role": "user", "content": "sort 3 1 2 9"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|> sort 3 1 2 9 <eos> <|assistant|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 9 and tokenizer.unk_token_id not in ids
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    answer = tokenizer.encode("1 2 3 9", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "1 2 3 9"


def test_ensure_tiny_model_builds_once_and_never_replaces_what_it_did_not_build(tmp_path):
    out = ensure_tiny_model(tmp_path / "m", **SMALL)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "m", **SMALL) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(ConfigError, match="other settings"):  # never rebuilt in place
        ensure_tiny_model(tmp_path / "m", **{**SMALL, "hidden": 16})
    assert (out / "NOTES.md").exists() and json.loads((out / MARKER).read_text())["hidden"] == SMALL["hidden"]
    (out / MARKER).unlink()  # builds land atomically, so without the marker it is someone else's
    with pytest.raises(ConfigError, match="not a tiny model built by asyncrl"):
        ensure_tiny_model(tmp_path / "m", **SMALL)
    assert (out / "model.safetensors").stat().st_mtime_ns > 0 and not (out / MARKER).exists()
    with pytest.raises(TypeError, match="hiden"):
        ensure_tiny_model(tmp_path / "m", hiden=3)


# ---- synthetic data and loading -----------------------------------------------------------------


def test_synthetic_rows_are_deterministic_and_verl_shaped():
    a, b = make_rows("sort", 5, seed=3), make_rows("sort", 5, seed=3)
    assert a == b and a != make_rows("sort", 5, seed=4)
    row = a[0]
    assert row["data_source"] == "asyncrl/sort"
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("sort ")
    digits = row["prompt"][0]["content"].split()[1:]
    assert row["reward_model"]["ground_truth"] == " ".join(sorted(digits))
    with pytest.raises(KeyError, match="choose one of"):
        get_task("nope")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_and_load_dataset(tmp_path, fmt):
    files = write_dataset(tmp_path, "sort", n_train=40, n_val=10, seed=1, fmt=fmt)
    train, test = load_rows(files["train"]), load_rows(files["test"])
    assert len(train) == 40 and len(test) == 10
    assert {r["prompt"][0]["content"] for r in train}.isdisjoint(
        r["prompt"][0]["content"] for r in test
    )
    assert train[0]["reward_model"]["style"] == "rule"
    assert test[0]["extra_info"]["split"] == "test"


def test_load_verl_parquet_layout(tmp_path):
    # the layout verl's examples/data_preprocess/gsm8k.py writes
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "What is 2 + 3 ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"split": "train", "index": i, "answer": "2 + 3 = 5 #### 5"},
        }
        for i in range(3)
    ]
    path = write_rows(rows, tmp_path / "gsm8k.parquet")
    assert load_rows(path) == rows
    assert load_rows([path, path])[3:] == rows
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        load_rows(bad)
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(tmp_path / "missing.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported"):
        load_rows(tmp_path / "x.csv")


def test_prompt_dataset_batch_is_left_padded(tokenizer):
    rows = [
        {"data_source": "asyncrl/sort", "prompt": "sort 3 1", "reward_model": {"ground_truth": "1 3"}},
        {"data_source": "asyncrl/sort", "prompt": [{"role": "user", "content": "sort 9 8 7 6"}],
         "reward_model": {"ground_truth": "6 7 8 9"}, "extra_info": {"index": 1}},
        {"data_source": "x", "prompt": "sort " + " ".join("1" * 50), "ground_truth": "y"},
    ]
    ds = PromptDataset(rows, tokenizer, max_prompt_len=16)
    assert len(ds) == 2  # the overlong prompt is dropped
    batch = ds.collate([ds[0], ds[1]])
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].shape == (2, 9) and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"][0, :2].tolist() == [pad, pad]
    assert batch["attention_mask"][0].tolist() == [0, 0] + [1] * 7
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert batch["position_ids"][1].tolist() == list(range(9))
    assert batch["ground_truth"] == ["1 3", "6 7 8 9"]
    assert batch["data_source"] == ["asyncrl/sort", "asyncrl/sort"]
    assert batch["raw_prompt"][1].endswith("<|assistant|>")
    assert batch["extra_info"] == [{}, {"index": 1}]
    assert len(set(batch["uid"])) == 2
    assert ds.collate([ds[0]])["uid"] == batch["uid"][:1]  # uid: the prompt and its row in the batch
    assert len(set(ds.collate([ds[0], ds[0]])["uid"])) == 2  # a repeated prompt is a group of its own
    with pytest.raises(DatasetError, match="max_prompt_len"):
        PromptDataset(rows[2:], tokenizer, max_prompt_len=16)


def _uids(batches) -> list[list[str]]:
    return [b["uid"] for b in batches]


def test_loader_resume_continues_exactly(tokenizer):
    ds = PromptDataset(make_rows("sort", 20, seed=0), tokenizer, max_prompt_len=16)
    ref = PromptLoader(ds, batch_size=6, shuffle=True, seed=5)
    assert len(ref) == 3
    expected = _uids(ref.next_batch() for _ in range(8))  # crosses two epoch boundaries
    assert expected[0] != expected[3]  # each epoch is reshuffled

    first = PromptLoader(ds, batch_size=6, shuffle=True, seed=5)
    got = _uids(first.next_batch() for _ in range(4))
    state = json.loads(json.dumps(first.state_dict()))  # states survive a JSON round trip
    resumed = PromptLoader(ds, batch_size=6, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    got += _uids(resumed.next_batch() for _ in range(4))
    assert got == expected

    # iteration yields the rest of the current epoch, then the next epoch
    it = PromptLoader(ds, batch_size=6, shuffle=True, seed=5)
    it.load_state_dict({"epoch": 0, "position": 1})
    assert _uids(it) == expected[1:3]
    assert _uids(it) == expected[3:6]
    with pytest.raises(DatasetError, match="batch_size=6"):
        PromptLoader(ds, batch_size=4, seed=5).load_state_dict(state)


# ---- rewards ------------------------------------------------------------------------------------


def test_gsm8k_strict_flexible_and_format_score():
    assert gsm8k("openai/gsm8k", "so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert gsm8k("openai/gsm8k", "#### 5 then #### 8", "8") == 1.0  # the last one counts
    assert gsm8k("openai/gsm8k", "the answer is 7", "7") == 0.0  # strict needs ####
    assert gsm8k("openai/gsm8k", "the answer is 7.", "7", method="flexible") == 1.0
    assert gsm8k("openai/gsm8k", "#### 6", "7", format_score=0.1) == 0.1
    assert gsm8k("openai/gsm8k", "#### 6", "7", {"format_score": 0.2}) == 0.2
    assert gsm8k("openai/gsm8k", "no number", "7", format_score=0.1) == 0.0
    assert gsm8k("openai/gsm8k", "#### 7.0", "7") == 1.0


def test_exact_match_normalises():
    assert exact_match("x", "  Paris. ", "paris") == 1.0
    assert exact_match("x", "The answer is \\boxed{42}", "42") == 1.0
    assert exact_match("x", "new  york", ["NYC", "New York"]) == 1.0
    assert exact_match("x", "london", "paris") == 0.0


def test_synthetic_reward_partial_credit_and_dispatch():
    assert score_answer("1 2 3 9", "1 2 3 9") == 1.0
    assert score_answer("1 2 5 9", "1 2 3 9") == 0.75
    assert score_answer("1 2", "1 2 3 9") == 0.5
    assert score_answer("1 2 3 9 9 9 9 9", "1 2 3 9") == 0.5  # extra symbols cost credit
    assert score_answer("", "1 2") == 0.0
    assert synthetic("asyncrl/sort", "0 0 3 9", "1 2 3 9", None) == 0.5
    assert default_reward("asyncrl/sort", "1 2 3 9", "1 2 3 9") == 1.0
    assert default_reward("openai/gsm8k", "#### 12", "12") == 1.0
    assert default_reward("someone/else", "Yes", "yes") == 1.0  # falls back to exact match
    for rows in (make_rows("max", 20, 0), make_rows("sum", 20, 0), make_rows("reverse", 20, 0)):
        for row in rows:
            gt = row["reward_model"]["ground_truth"]
            assert default_reward(row["data_source"], gt, gt, row["extra_info"]) == 1.0


def test_load_reward_fn(tmp_path):
    assert load_reward_fn(None) is default_reward
    assert load_reward_fn("asyncrl.rewards.rules:gsm8k") is gsm8k
    f = tmp_path / "my_reward.py"
    f.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(len(solution_str) == 3)\n\nNOT_FN = 3\n")
    fn = load_reward_fn(f"{f}:score")
    assert fn("d", "abc", "", None) == 1.0
    with pytest.raises(RewardFnError, match="package.module:function"):
        load_reward_fn("asyncrl.rewards.rules.gsm8k")
    with pytest.raises(RewardFnError, match="cannot import module 'no_such_mod'"):
        load_reward_fn("no_such_mod:fn")
    with pytest.raises(RewardFnError, match="has no function 'nope'"):
        load_reward_fn("asyncrl.rewards.rules:nope")
    with pytest.raises(RewardFnError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/missing.py:score")
    with pytest.raises(RewardFnError, match="not a function"):
        load_reward_fn(f"{f}:NOT_FN")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardFnError, match="boom"):
        load_reward_fn(f"{broken}:score")
