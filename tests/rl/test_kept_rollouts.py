"""The training rollouts a run keeps (trainer.keep_rollouts, asyncrl.roles.kept_rollouts): each
rank's sample, every data source in turn, written as parquet by the rank that holds the rows."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import torch

from asyncrl.roles.kept_rollouts import FLUSH_STEPS, RolloutKeeper, chosen_rows
from asyncrl.single_controller.batch import Batch


class _Words:
    """A tokenizer stand-in: token id k decodes to "wk"."""

    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [" ".join(f"w{i}" for i in ids) for ids in rows]


def _batch(rows: int = 6) -> Batch:
    prompt, resp = 3, 4
    ids = torch.arange(rows * (prompt + resp)).reshape(rows, prompt + resp)
    attn = torch.ones(rows, prompt + resp, dtype=torch.long)
    attn[:, 0] = 0  # left padding of the prompt
    attn[0, -1] = 0  # row 0's response is 3 tokens
    mask = attn[:, prompt:].clone()
    mask[1, 1] = 0  # an environment's token inside row 1's response (a multi-turn trajectory)
    return Batch({"input_ids": ids, "attention_mask": attn, "responses": ids[:, prompt:], "response_mask": mask,
                  "scores": torch.arange(rows, dtype=torch.float), "advantages": torch.ones(rows, resp),
                  "rollout_log_probs": -torch.ones(rows, resp), "behav_versions": torch.full((rows, resp), 2),
                  "response_clipped": torch.tensor([0.0, 1.0] * (rows // 2)),
                  "reward_extra_acc": torch.ones(rows)},
                 {"data_source": ["a", "a", "a", "a", "b", "c"][:rows], "uid": [f"u{i}" for i in range(rows)]})


def test_rows_are_chosen_from_every_source_without_the_training_streams():
    torch.manual_seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), random.getstate())
    rows = chosen_rows(["a"] * 8 + ["b", "c"], 3, step=5, rank=0)
    assert {(["a"] * 8 + ["b", "c"])[i] for i in rows} == {"a", "b", "c"}  # each source in turn
    assert rows == chosen_rows(["a"] * 8 + ["b", "c"], 3, step=5, rank=0)  # the step's own draw
    assert chosen_rows(["a"] * 4, -1, 1, 0) == [0, 1, 2, 3] == chosen_rows(["a"] * 4, 9, 1, 0)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


def test_a_rank_writes_its_kept_rows_as_parquet(tmp_path):
    keeper = RolloutKeeper(tmp_path, rank=1, world_size=2, rows_per_step=-1, tokenizer=_Words())
    for step in range(1, FLUSH_STEPS + 1):
        keeper.add(_batch(), step, version=3)
    (path,) = (tmp_path / "rollouts" / "rank1").glob("*.parquet")  # written at the FLUSH_STEPS-th step
    assert path.name == f"steps_{1:07d}-{FLUSH_STEPS:07d}.parquet" and keeper.columns == {}
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 6 * FLUSH_STEPS and {r["step"] for r in rows} == set(range(1, FLUSH_STEPS + 1))
    r0, r1 = rows[0], rows[1]
    assert r0["prompt"] == "w1 w2" and r0["response"] == "w3 w4 w5" and r0["response_ids"] == [3, 4, 5]
    assert r0["response_length"] == 3 and r0["finish_reason"] == "stop" and r1["finish_reason"] == "length"
    assert r1["model_token"] == [1, 0, 1, 1] and r1["response_length"] == 3  # the environment's token is not the model's
    assert r0["reward"] == 0.0 and r1["reward"] == 1.0 and json.loads(r0["reward_parts"]) == {"acc": 1.0}
    assert r0["rollout_log_probs"] == [-1.0] * 3 and r0["trainer_log_probs"] is None and r0["advantage"] == 1.0
    assert r0["weights_version"] == 2 and r0["staleness"] == 1 and r0["rank"] == 1 and r0["uid"] == "u0"
    assert keeper.flush() is None  # nothing new


def test_a_share_of_the_steps_rows_per_rank(tmp_path):
    keeper = RolloutKeeper(tmp_path, rank=0, world_size=2, rows_per_step=4, tokenizer=_Words())
    keeper.add(_batch(), 7, version=0)
    path = keeper.flush()
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 2 and path.name == "steps_0000007-0000007.parquet"
    assert {r["data_source"] for r in rows} <= {"a", "b", "c"} and len({r["data_source"] for r in rows}) == 2
