"""verifiers environments as asyncrl agents (asyncrl/agents/verifiers_env.py): their rollouts run
against the OpenAI endpoint over the tiny model, every call under the trajectory's id, a
multi-turn conversation's calls extend each other token for token (one trajectory, no split),
the rubric's reward comes back, and the environment's dataset becomes a prompt file."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
import torch

vf = pytest.importorskip("verifiers", reason="verifiers environments: pip install verifiers")
openai = pytest.importorskip("openai", reason="the agents' client: pip install openai")
datasets = pytest.importorskip("datasets")

from asyncrl.data.synthetic import make_examples  # noqa: E402
from tests.helpers import forked  # noqa: E402

torch.set_num_threads(1)
KEY = "test-key"
REPLY = "sort 2 1"  # what the multi-turn environment says after each of the model's turns
EXAMPLES = make_examples("sort", 6, seed=0)


def assistant_words(completion) -> float:
    """The model's words over all its turns: checkable against the ids the endpoint recorded."""
    return float(sum(len((m.content or "").split()) for m in completion if m.role == "assistant"))


def row_arrived(answer, info, state) -> float:
    """1.0 when the rubric sees the row's answer, info and example id as the dataset had them."""
    return float(answer == EXAMPLES[info["i"]][1] and state["example_id"] == info["i"])


def sort_dataset():
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}], "answer": a, "info": {"i": i}}
                                       for i, (p, a) in enumerate(EXAMPLES)])


def rubric():
    return vf.Rubric(funcs=[assistant_words, row_arrived], weights=[1.0, 100.0])


class Nudge(vf.MultiTurnEnv):
    """Answers each of the model's first two turns with REPLY; its third turn ends the rollout."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=3, **kwargs)

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=REPLY)]


def load_environment(kind: str = "single", **kwargs):
    """The test's environments, as `rollout.multi_turn.env=verifiers:<this file>:load_environment` loads them."""
    make = vf.SingleTurnEnv if kind == "single" else Nudge
    return make(dataset=sort_dataset(), rubric=rubric(), **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The sort model after a short format warm start: it answers in the task's words and ends its
    turn, as a served policy does (a random init emits special tokens mid-text; see
    `test_a_special_token_mid_reply_splits_the_trajectory`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.tiny import ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=64, layers=2, heads=4,
                             sft_steps=100)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def rows(tiny, tmp_path_factory):
    """The environment's dataset as the agent receives it: written by `write_verifiers_data`, read
    by asyncrl's loader and tokenised (`messages`, as the prompt batch carries them)."""
    from asyncrl.agents.verifiers_env import write_verifiers_data
    from asyncrl.data.dataset import PromptDataset, load_rows

    path = write_verifiers_data(load_environment(), tmp_path_factory.mktemp("data") / "train.jsonl")
    loaded = load_rows(path)
    items = PromptDataset(loaded, tiny[1], max_prompt_len=64).items
    return [{"messages": it.messages, "ground_truth": it.ground_truth, "data_source": it.data_source,
             "extra_info": it.extra_info, "uid": it.uid} for r, it in zip(loaded, items, strict=True)]


def serve(tiny, records, backend=None):
    """The endpoint over the tiny model's engine (or `backend`), every choice into `records`."""
    from asyncrl.agents.rollout import WaveGenerator
    from asyncrl.rollout.engine import RolloutEngine, SamplingParams
    from asyncrl.serve import OpenAIServer

    model, tok = tiny
    if backend is None:
        engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        backend = WaveGenerator(engine, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    return OpenAIServer(backend, tok, model_name="tiny", api_key=KEY, context_length=256, recorder=records.append)


class Scripted:
    """A backend that answers each call with the next of `replies` (token ids)."""

    def __init__(self, replies):
        from asyncrl.rollout.engine import SamplingParams

        self.replies, self.params = list(replies), SamplingParams()

    async def __call__(self, ids, max_tokens, sampling=None):
        reply = self.replies.pop(0)
        return reply, [-1.0] * len(reply), [0] * len(reply)

    def begin(self, trajectories):
        pass

    def retire(self):
        pass


async def run_agent(tiny, agent, rows, model="tiny", backend=None):
    """The agent on each row as `ApiRollout` drives it (trajectory i: "t{i}"): (rewards, records)."""
    records = []
    async with serve(tiny, records, backend) as server:
        async def one(i, row):
            server.backend.begin(1)
            async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0,
                                          default_headers={"X-Trajectory-Id": f"t{i}"}) as client:
                try:
                    return await agent(client, model, row)
                finally:
                    server.backend.retire()

        rewards = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    return rewards, records


def calls_of(records, tid):
    return [r for r in records if r.trajectory_id == tid]


def rendered(tok, messages) -> list[int]:
    """The ids of `messages` as the endpoint renders them (the chat template, a generation prompt)."""
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def words(tok, recs) -> float:
    return float(sum(len(tok.decode(r.token_ids, skip_special_tokens=True).split()) for r in recs))


async def test_a_single_turn_rollout_returns_its_rubrics_reward(tiny, rows):
    from asyncrl.agents.verifiers_env import verifiers_agent

    tok = tiny[1]
    rewards, records = await run_agent(tiny, verifiers_agent(load_environment()), rows)
    assert sorted({r.trajectory_id for r in records}) == [f"t{i}" for i in range(len(rows))]
    for i, row in enumerate(rows):
        (call,) = calls_of(records, f"t{i}")
        assert call.prompt_ids == rendered(tok, row["messages"])
        assert call.temperature == 1.0  # the trainer's sampling, not one the environment asked for
        assert rewards[i] == words(tok, [call]) + 100.0


async def test_a_multi_turn_rollouts_calls_extend_each_other_token_for_token(tiny, rows):
    """Each call's prompt is the last one's, the reply as verifiers sends it back and the
    environment's message: the reply's own ids exactly when it holds no special token but its
    final <eos> (then `assemble` trains every reply, no split); a reply with one mid-text comes
    back without it and is left out of the row, counted (see the next test)."""
    from asyncrl.agents.api import assemble
    from asyncrl.agents.verifiers_env import verifiers_agent

    tok = tiny[1]
    observation = tok.encode(f"<|user|> {REPLY} <eos> <|assistant|>", add_special_tokens=False)
    rewards, records = await run_agent(tiny, verifiers_agent(load_environment("multi")), rows)
    assert {r.trajectory_id for r in records} == {f"t{i}" for i in range(len(rows))}
    whole = 0  # trajectories of three clean replies: the case this test is about
    for i in range(len(rows)):
        recs = calls_of(records, f"t{i}")
        for before, call in zip(recs, recs[1:], strict=False):
            assert call.prompt_ids == before.prompt_ids + sent_back(tok, before.token_ids) + observation
        # fewer than 3 calls only when the model ended a turn without a word (verifiers stops there)
        assert len(recs) == 3 or tok.decode(recs[-1].token_ids, skip_special_tokens=True).strip() == ""
        kept = [r for r in recs[:-1] if clean(tok, r.token_ids)] + recs[-1:]
        traj = assemble(recs, budget=10_000)
        assert traj.prompt == recs[0].prompt_ids or kept[0] is not recs[0]
        trained = [(t, lp) for t, lp, m in zip(traj.tokens, traj.logprobs, traj.mask, strict=True) if m]
        assert trained == [(t, lp) for r in kept for t, lp in zip(r.token_ids, r.logprobs, strict=True)]
        assert traj.counts["api_dropped_tokens"] == sum(len(r.token_ids) for r in recs if r not in kept)
        if len(kept) == len(recs):
            assert traj.counts["api_splits"] == 0 and traj.prompt == recs[0].prompt_ids
            whole += len(recs) == 3
        assert rewards[i] == words(tok, recs) + 100.0
    assert whole >= 1


def clean(tok, reply) -> bool:
    """Whether `reply` holds no special token but a final <eos>."""
    return not any(t in tok.all_special_ids for t in reply[:-1]) and (
        reply[-1] == tok.eos_token_id or reply[-1] not in tok.all_special_ids)


def sent_back(tok, reply) -> list[int]:
    """A reply's ids in the next prompt: its text (decoded without special tokens) re-encoded,
    its turn closed by the template's <eos>."""
    return [t for t in reply if t not in tok.all_special_ids] + [tok.eos_token_id]


async def test_a_special_token_mid_reply_splits_the_trajectory(tiny, rows):
    """Why the fixture's model is warmed up. The endpoint returns a reply's text without its special
    tokens (`skip_special_tokens`) and verifiers sends that text back as the assistant's message,
    so a special token sampled mid-reply (a random init's `<|user|>`, `<unk>`, `<pad>`...) is not
    in the next prompt: it no longer extends the reply, and `assemble` splits (counted) rather
    than train on a context the model never saw."""
    from asyncrl.agents.api import assemble
    from asyncrl.agents.verifiers_env import verifiers_agent

    tok = tiny[1]
    replies = [tok.convert_tokens_to_ids(t) for t in (["5", "<|user|>", "7", "<eos>"], ["1", "<eos>"], ["2", "<eos>"])]
    _, records = await run_agent(tiny, verifiers_agent(load_environment("multi")), rows[:1], backend=Scripted(replies))
    first, second, third = records
    n = len(first.prompt_ids)
    assert second.prompt_ids[:n] == first.prompt_ids
    assert tok.convert_ids_to_tokens(second.prompt_ids[n:n + 3]) == ["5", "7", "<eos>"]  # <|user|> is gone
    traj = assemble(records, budget=10_000)
    assert traj.counts["api_splits"] == 1 and traj.counts["api_dropped_tokens"] == len(first.token_ids)
    assert traj.prompt == second.prompt_ids and third.prompt_ids[:len(traj.prompt)] == traj.prompt


def test_an_api_rollout_runs_the_environment_that_load_agent_names(tiny, rows, monkeypatch):
    import asyncrl.agents.api as api
    from asyncrl.agents.rollout import WaveGenerator
    from asyncrl.rollout.engine import RolloutEngine, SamplingParams

    model, tok = tiny
    calls = {}  # trajectory (row i, sample k: i * 2 + k) -> its calls, as the rollout assembles them
    assemble = api.assemble

    def spy(recs, budget, max_prompt=None):
        _, i, k = recs[0].trajectory_id.rsplit("-", 2)
        calls[int(i) * 2 + int(k)] = recs
        return assemble(recs, budget, max_prompt)

    monkeypatch.setattr(api, "assemble", spy)
    rollout = api.ApiRollout(f"verifiers:{__file__}:load_environment", {"kind": "multi"}, tok, "tiny", concurrency=4,
                             timeout_s=60)
    prompts = [rendered(tok, r["messages"]) for r in rows[:3]]
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    wave = WaveGenerator(engine, SamplingParams(temperature=1.0, max_tokens=8), torch.Generator().manual_seed(1))
    trajs = rollout.rollout(prompts, rows[:3], 2, wave, 200)
    assert len(trajs) == 6 and all(t.error is None for t in trajs) and len(calls) == 6
    for t, recs in zip(trajs, (calls[j] for j in range(6)), strict=True):
        assert len({r.trajectory_id for r in recs}) == 1 and t.counts["api_calls"] == len(recs) >= 1
        assert t.env_reward == words(tok, recs) + 100.0


async def test_the_environments_sampling_settings_give_way_to_the_trainers_but_its_length_bound(tiny, rows, caplog):
    from asyncrl.agents.verifiers_env import verifiers_agent

    env = load_environment(sampling_args={"temperature": 0.1, "top_p": 0.5, "max_tokens": 2})
    agent = verifiers_agent(env)
    assert "['temperature', 'top_p']" in caplog.text
    _, records = await run_agent(tiny, agent, rows[:3])
    assert len(records) == 3
    assert all(r.temperature == 1.0 and len(r.token_ids) <= 2 for r in records)


async def test_a_request_the_endpoint_refuses_fails_the_trajectory_with_its_reason(tiny, rows):
    from asyncrl.agents.verifiers_env import VerifiersRolloutError, verifiers_agent

    with pytest.raises(VerifiersRolloutError, match="does not exist: this server serves 'tiny'"):
        await run_agent(tiny, verifiers_agent(load_environment()), rows[:1], model="other")


def test_the_dataset_becomes_a_prompt_file_the_loader_reads(tmp_path):
    from asyncrl.agents.verifiers_env import COLUMNS, rollout_input, write_verifiers_data
    from asyncrl.data.dataset import check_data_file, load_rows

    path = write_verifiers_data(load_environment(), tmp_path / "eval.jsonl", split="eval", n=4)
    check_data_file(path)
    loaded = load_rows(path)
    assert len(loaded) == 4
    for i, row in enumerate(loaded):
        prompt, answer = EXAMPLES[i]
        assert row["prompt"] == [{"role": "user", "content": prompt}] and row["reward_model"]["ground_truth"] == answer
        assert row["data_source"] == "verifiers/SingleTurnEnv" and row["extra_info"]["i"] == i
        assert row["extra_info"][COLUMNS] == {"example_id": i}
        made = rollout_input({"messages": row["prompt"], "ground_truth": answer, "extra_info": row["extra_info"]})
        assert made == {"prompt": row["prompt"], "answer": answer, "info": {"i": i}, "example_id": i}
    with pytest.raises(ValueError, match="jsonl"):
        write_verifiers_data(load_environment(), tmp_path / "x.parquet")


def test_a_row_written_elsewhere_gets_one_example_id_per_prompt():
    from asyncrl.agents.verifiers_env import rollout_input

    one = [{"role": "user", "content": "sort 1 2"}]
    made = [rollout_input({"messages": p, "ground_truth": 3, "extra_info": None})
            for p in (one, list(one), [{"role": "user", "content": "sort 2 1"}])]
    assert made[0]["example_id"] == made[1]["example_id"] != made[2]["example_id"]
    assert made[0]["answer"] == "3" and made[0]["info"] == {}
    with pytest.raises(TypeError, match="chat messages"):
        rollout_input({"messages": "<|user|> sort 1 2", "ground_truth": "1 2"})


def test_environments_asyncrl_cannot_score_are_refused_with_what_to_fix():
    from asyncrl.agents.verifiers_env import verifiers_agent
    from transport.checks import ConfigError

    def best_of_group(completions) -> list[float]:
        return [1.0] * len(completions)

    with pytest.raises(ConfigError, match="group reward functions \\(best_of_group\\)"):
        verifiers_agent(vf.SingleTurnEnv(dataset=sort_dataset(), rubric=vf.Rubric(funcs=[best_of_group])))
    with pytest.raises(ConfigError, match="no reward function"):
        verifiers_agent(vf.SingleTurnEnv(dataset=sort_dataset()))
    with pytest.raises(ConfigError, match="score_rollouts=True"):
        verifiers_agent(load_environment(score_rollouts=False))
    with pytest.raises(ConfigError, match="not a verifiers Environment"):
        verifiers_agent(object())


def test_without_verifiers_the_error_says_to_install_it(monkeypatch):
    from asyncrl.agents.verifiers_env import verifiers_agent
    from transport.checks import ConfigError

    monkeypatch.setitem(__import__("sys").modules, "verifiers", None)
    with pytest.raises(ConfigError, match="pip install verifiers"):
        verifiers_agent(object())


def test_an_environment_builds_off_the_main_thread_and_leaves_the_signal_handlers_alone():
    from asyncrl.agents.verifiers_env import environment_agent

    with pytest.raises(ValueError, match="main thread"):  # why `environment_agent` exists
        _in_thread(lambda: load_environment())
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    assert callable(_in_thread(lambda: environment_agent(load_environment, {"kind": "multi"})))
    assert callable(environment_agent(load_environment, {}))
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers


def _in_thread(fn):
    """fn() on a thread of its own, as a worker builds its actor (`asyncio.to_thread`)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.timeout(300)
def test_a_multi_turn_environment_trains_through_the_endpoint(tiny, tmp_path):
    """`rollout.multi_turn.env=verifiers:...` in a GRPO job on two ranks: every step's trajectories
    are the environment's three-turn conversations (no split), their rollout log-probs equal the
    trainer's within 1e-4 (`rollout/logprob_diff_max`, recomputed on the same tokens), and the
    rubric's reward is the score. A small learning rate: the test is about the plumbing, and three
    Adam steps at the quickstart's 1e-3 have (once in CI) taught the warm-started model to end its
    turns empty, which ends a verifiers conversation early."""
    import json
    import os
    import sys
    from pathlib import Path

    from asyncrl.agents.verifiers_env import write_verifiers_data

    model_dir = Path(tiny[0].name_or_path)
    data = write_verifiers_data(load_environment("multi"), tmp_path / "train.jsonl")
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart", f"trainer.output_dir={tmp_path / 'out'}",
           f"model.path={model_dir}", "model.build_tiny=null", f"data.train_files={data}", f"data.val_files={data}", "data.batch_size=4",
           "data.max_prompt_len=64", "rollout.n=2", "rollout.max_tokens=48", "trainer.total_steps=3",
           "trainer.loggers=[jsonl]", "actor.recompute_log_prob=always", "rollout.multi_turn.enable=true",
           "actor.optim.lr=1e-4",  # the quickstart's 1e-3 can move this 64-wide model off its format in 3 steps
           f"rollout.multi_turn.env=verifiers:{Path(__file__).resolve()}:load_environment",
           "+rollout.multi_turn.env_kwargs.kind=multi"]
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(repo)}
    res = forked.run(cmd, timeout=280, cwd=repo, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 3
    print({k: [round(m[k], 7) for m in steps] for k in ("agent/api_calls_mean", "agent/api_splits_mean",
                                                          "rollout/logprob_diff_max", "critic/score_mean")})
    # the first batch meets the warm-started policy: three-turn conversations; later batches (other
    # prompts, sampled) may hold some turns the model ended without a word, which end a conversation
    assert steps[0]["agent/api_calls_mean"] >= 2.5, steps[0]
    for m in steps:
        assert m["agent/api_calls_mean"] > 1.5 and m["agent/api_splits_mean"] <= 0.5, m
        assert m["rollout/logprob_diff_max"] <= 1e-4, m["rollout/logprob_diff_max"]
        assert m["critic/score_mean"] > 0  # the rubric's reward (words the model wrote)
