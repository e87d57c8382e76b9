"""The endpoint through the official `openai` client, over the native engine: the ids and
log-probs it returns are the model's own (checked against a plain forward), `n`, `max_tokens`,
seeds and stop strings behave, streams carry the same, and the recorder sees every choice."""

from __future__ import annotations

import pytest
import torch

from asyncrl.agents.rollout import BatcherGenerator, WaveGenerator
from asyncrl.rollout.continuous import ContinuousBatcher
from asyncrl.rollout.engine import RolloutEngine, SamplingParams
from asyncrl.serve import OpenAIServer
from asyncrl.serve.choices import kept_tokens
from tests.helpers.serve_http import forward_logprobs

openai = pytest.importorskip("openai", reason="the endpoint's client: pip install openai")


KEY = "test-key"
CHAT = [{"role": "user", "content": "sort 3 1 2"}]


class Weights:
    version, interrupt = 3, False

    def pending(self):
        return False


@pytest.fixture(scope="module")
def batcher(tiny):
    model, tok = tiny
    return ContinuousBatcher(RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                             slots=8, weights=Weights())


@pytest.fixture
async def served(tiny, batcher):
    """(client, server, records) over a BatcherGenerator; the recorder keeps every record."""
    records = []
    backend = BatcherGenerator(batcher, SamplingParams(temperature=1.0), None)
    async with OpenAIServer(backend, tiny[1], model_name="tiny", api_key=KEY, context_length=256,
                            recorder=records.append) as server:
        async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0) as client:
            yield client, server, records


def _check_logprobs(model, prompt, tokens, logprobs):
    assert len(tokens) == len(logprobs)
    if tokens:
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(forward_logprobs(model, prompt, tokens)), atol=1e-4)


async def test_chat_returns_the_models_own_ids_and_logprobs(served, tiny):
    client, server, _ = served
    model, tok = tiny
    resp = await client.chat.completions.create(model="tiny", messages=CHAT, n=3, max_tokens=10, logprobs=True)
    data = resp.to_dict()
    prompt = data["prompt_token_ids"]
    assert server.host == "127.0.0.1"
    assert prompt == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for choice, parsed in zip(data["choices"], resp.choices, strict=True):
        ids = choice["token_ids"]
        assert 1 <= len(ids) <= 10 and choice["policy_versions"] == [3] * len(ids)
        assert parsed.message.content == tok.decode(ids, skip_special_tokens=True)
        assert [c.token for c in parsed.logprobs.content] == [tok.decode([t]) for t in ids]
        _check_logprobs(model, prompt, ids, [c.logprob for c in parsed.logprobs.content])
        ended = ids[-1] == tok.eos_token_id
        assert parsed.finish_reason == ("stop" if ended or len(ids) < 10 else "length")
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == sum(len(c["token_ids"]) for c in data["choices"])


async def test_text_completions_take_strings_and_token_ids(served, tiny):
    client, _, _ = served
    model, tok = tiny
    ids = tok.encode("sort 5 4", add_special_tokens=False)
    resp = await client.completions.create(model="tiny", prompt=["sort 9 8 7", ids], n=2, max_tokens=6, logprobs=1)
    data = resp.to_dict()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in data["choices"]] == [tok.encode("sort 9 8 7")] * 2 + [ids] * 2
    for choice in data["choices"]:
        assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert choice["logprobs"]["top_logprobs"] is None  # no alternatives computed, as documented
        _check_logprobs(model, choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"])


async def test_max_tokens_bounds_every_choice(served, tiny):
    client, _, _ = served
    eos = tiny[1].eos_token_id
    resp = await client.completions.create(model="tiny", prompt="sort 1 2", n=6, max_tokens=2)
    for choice in resp.to_dict()["choices"]:
        ids = choice["token_ids"]
        assert 1 <= len(ids) <= 2
        assert choice["finish_reason"] == ("stop" if ids[-1] == eos else "length")


async def test_a_seed_makes_a_request_repeatable(served):
    client, _, _ = served
    asked = {"model": "tiny", "prompt": "sort 7 1", "max_tokens": 12, "n": 2, "seed": 11}
    first, again = [(await client.completions.create(**asked)).to_dict()["choices"] for _ in range(2)]
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in again]
    assert first[0]["token_ids"] != first[1]["token_ids"]  # choice i samples with seed + i


async def test_a_stop_string_cuts_the_text_and_exactly_the_tokens_before_it(served, tiny):
    client, _, records = served
    tok = tiny[1]
    asked = {"model": "tiny", "prompt": "sort 4 4 2", "max_tokens": 16, "seed": 5, "temperature": 1.0}
    whole = (await client.completions.create(**asked)).to_dict()["choices"][0]
    words = whole["text"].split()
    assert len(words) >= 4, whole
    stop = words[2]
    cut = (await client.completions.create(**asked, stop=["never there", stop])).to_dict()["choices"][0]
    text = whole["text"][:whole["text"].find(stop)]
    k = len(cut["token_ids"])
    assert cut["text"] == text and cut["finish_reason"] == "stop"
    assert cut["token_ids"] == whole["token_ids"][:k]  # the same sample, cut
    assert text.startswith(tok.decode(cut["token_ids"], skip_special_tokens=True))
    assert not text.startswith(tok.decode(whole["token_ids"][:k + 1], skip_special_tokens=True))  # no more fit
    assert records[-1].token_ids == cut["token_ids"] and len(records[-1].logprobs) == k


def test_kept_tokens_drops_the_token_that_reaches_into_the_stop_string():
    words = {1: "ab", 2: "cd", 3: "ef"}
    spaced = lambda ids: " ".join(words[i] for i in ids)  # noqa: E731 - a word-level decoder
    assert kept_tokens([1, 2, 3], "ab cd ", spaced) == 2
    assert kept_tokens([1, 2, 3], "ab c", spaced) == 1  # "cd" straddles the cut
    assert kept_tokens([1, 2, 3], "", spaced) == 0
    pieces = {1: "a", 2: " b", 3: "\ufffd", 4: "é"}  # BPE: spaces lead; 3 then 4 decode to one character
    bpe = lambda ids: "".join(pieces[i] for i in ids).replace("\ufffdé", "é")  # noqa: E731
    assert kept_tokens([1, 2, 2], "a b ", bpe) == 2
    assert kept_tokens([1, 3, 4, 2], "aé", bpe) == 3


async def test_a_stream_carries_the_same_ids_text_and_usage(served, tiny):
    client, _, records = served
    tok = tiny[1]
    stream = await client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=8, stream=True,
                                                  logprobs=True, stream_options={"include_usage": True})
    text, ids, finish, usage = {}, {}, {}, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            ids[c.index] = ids.get(c.index, []) + (c.model_extra or {}).get("token_ids", [])
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(text) == [0, 1] and all(finish.values())
    assert all(text[i] == tok.decode(ids[i], skip_special_tokens=True) for i in ids)
    assert usage.completion_tokens == sum(map(len, ids.values()))
    assert sorted(r.token_ids for r in records[-2:]) == sorted(ids.values())


async def test_the_recorder_sees_every_choice_with_its_trajectory(served):
    client, _, records = served
    resp = await client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=4,
                                                extra_headers={"X-Trajectory-Id": "traj-7"}, user="ignored")
    data = resp.to_dict()
    mine = [r for r in records if r.request_id == data["id"]]
    assert sorted(r.index for r in mine) == [0, 1]
    for r in mine:
        choice = data["choices"][r.index]
        assert (r.trajectory_id, r.model, r.temperature) == ("traj-7", "tiny", 1.0)
        assert r.prompt_ids == data["prompt_token_ids"] and r.token_ids == choice["token_ids"]
        assert r.versions == choice["policy_versions"] and r.finish_reason == choice["finish_reason"]
    await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, user="agent-1")
    await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0.5)
    assert [r.trajectory_id for r in records[-2:]] == ["agent-1", None]
    assert records[-1].temperature == 0.5  # the log-probs are under the request's temperature


async def test_a_wave_generator_backs_the_endpoint_with_per_request_sampling(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    records = []

    async def record(r):  # an async recorder is awaited
        records.append(r)

    backend = WaveGenerator(engine, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0),
                            version=lambda: 9)
    async with OpenAIServer(backend, tok, model_name="tiny", api_key=KEY, recorder=record) as server:
        async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0) as client:
            seeded = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "seed": 2, "logprobs": True}
            a, b = [(await client.chat.completions.create(**seeded)).to_dict() for _ in range(2)]
            greedy = (await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                           temperature=0, logprobs=True)).to_dict()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    prompt = a["prompt_token_ids"]
    for data in (a, greedy):
        choice = data["choices"][0]
        assert choice["policy_versions"] == [9] * len(choice["token_ids"])
        _check_logprobs(model, prompt, choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]])
    with torch.no_grad():  # greedy: each token the argmax after the ones before it
        ids = greedy["choices"][0]["token_ids"]
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == ids
    assert [r.temperature for r in records] == [1.0, 1.0, 1.0]  # greedy reports at temperature 1
