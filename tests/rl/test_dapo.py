"""DAPO's dynamic sampling (algorithm.filter_groups): the filter by hand, the config, a run."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.algorithms import core
from asyncrl.data.dataset import collate_prompts, pad_prompts
from asyncrl.launch import load_config
from tests.rl.test_rl import _launch, tiny_model  # noqa: F401  (a module-scoped fixture)
from transport.checks import ConfigError


def test_flat_groups_are_split_from_varied_ones_by_hand():
    uids = ["a", "a", "b", "b", "c", "c", "d", "d", "e"]
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, float("nan"), 0.5, 0.2, float("nan"), 3.0])
    varied, flat = core.split_flat_groups(uids, values)
    assert varied == [[0, 1]]  # only a's values differ
    # b: equal; c and d: one finite value each; e: a group of one
    assert flat == [[2, 3], [4, 5], [6, 7], [8]]


def test_groups_keep_the_order_they_first_appear_in():
    varied, flat = core.split_flat_groups(["y", "x", "y", "x"], torch.tensor([1, 0, 0, 0]))
    assert varied == [[0, 2]] and flat == [[1, 3]]
    with pytest.raises(ValueError, match="3 group ids for 2 values"):
        core.split_flat_groups(["a", "a", "b"], torch.tensor([1.0, 2.0]))


def test_prompts_pad_to_the_cap_on_the_left():
    from asyncrl.data.dataset import PromptItem

    items = [PromptItem(input_ids=[5, 6], raw_prompt="p", ground_truth="g", data_source="s", extra_info={}, uid="u")]
    padded = pad_prompts(collate_prompts(items, pad_token_id=0), 4, pad_token_id=0)
    assert padded["input_ids"].tolist() == [[0, 0, 5, 6]]
    assert padded["attention_mask"].tolist() == [[0, 0, 1, 1]]
    assert padded["position_ids"][0, 2:].tolist() == [0, 1]
    with pytest.raises(ValueError, match="do not fit"):
        pad_prompts(padded, 3, pad_token_id=0)


@pytest.mark.parametrize("overrides,words", [
    (["algorithm.name=remax"], "applies to grpo and rloo"),
    (["rollout.max_staleness=1"], "needs rollout.max_staleness=0"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "must be >= 0"),
])
def test_dynamic_sampling_config_is_checked(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config("grpo", ["algorithm.filter_groups.enable=true", *overrides])


def test_dynamic_sampling_refills_the_step_with_varied_groups(tmp_path, tiny_model):  # noqa: F811
    """Three prompts in four always score 0 (flat groups); the others score by response length.
    Each step generates a second batch when the first has too few varied groups, trains on
    data.batch_size groups, and says how many flat ones it had to use."""
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    if int(str(ground_truth).split()[0]) % 4:\n"
                      "        return {'score': 0.0, 'acc': 0.0}\n"
                      "    return {'score': (len(solution_str) % 3) / 2, 'acc': 1.0}\n")
    out = tmp_path / "dapo"
    r = _launch("grpo", out, tiny_model, ["trainer.total_steps=3", "trainer.eval_every=3", "trainer.save_every=3",
                                          f"reward.fn={reward}:score", "trainer.loggers=[console,jsonl]",
                                          "algorithm.filter_groups.enable=true",
                                          "algorithm.filter_groups.max_num_gen_batches=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["step"] > 0]
    assert len(trained) == 3 and all("actor/pg_loss" in row for row in trained)
    batches = [row["dynamic/gen_batches"] for row in trained]
    assert set(batches) <= {1.0, 2.0} and 2.0 in batches
    for row in trained:
        assert 0 <= row["dynamic/varied_group_ratio"] < 1
        if row["dynamic/gen_batches"] == 1:  # enough varied groups in the first batch
            assert row["dynamic/flat_groups"] == 0
    assert sum(row["dynamic/flat_groups"] for row in trained) > 0  # the cap of 2 batches was hit


def test_an_unknown_filter_metric_names_what_the_reward_gives(tmp_path, tiny_model):  # noqa: F811
    out = tmp_path / "bad"
    r = _launch("grpo", out, tiny_model, ["trainer.total_steps=1", "trainer.loggers=[console,jsonl]",
                                          "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"])
    assert r.returncode != 0
    assert "algorithm.filter_groups.metric='acc'" in r.stderr and "['score']" in r.stderr
