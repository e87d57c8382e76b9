"""RolloutEngine against HF generate / a full forward, on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from asyncrl.rollout import RolloutEngine, SamplingParams, score
from asyncrl.rollout.engine import WeightLoadError, candidate_probs, draw

PAD, EOS = 0, 2
MAX_TOKENS = 10


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        # wider than the 0.02 default so that the next token depends visibly on the prompt
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Absolute position embeddings: catches wrong position ids that RoPE would hide."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts() -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Prompts of different lengths (no pad/eos ids inside), left-padded into one batch."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 32, (length,), generator=g).tolist() for length in (3, 7, 1, 5)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return rows, input_ids, attention_mask


def engine_for(model: torch.nn.Module, eos: int | list[int] = EOS) -> RolloutEngine:
    return RolloutEngine(model, eos_token_id=eos, pad_token_id=PAD)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_greedy_left_padded_matches_hf_generate_per_row(make_model, prompts):
    rows, input_ids, attention_mask = prompts
    model = make_model()
    out = engine_for(model).generate(
        input_ids, attention_mask, SamplingParams(greedy=True, max_tokens=MAX_TOKENS)
    )
    for i, row in enumerate(rows):
        hf = model.generate(
            torch.tensor([row]),
            attention_mask=torch.ones(1, len(row), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )[0, len(row) :]
        length = int(out["response_mask"][i].sum())
        assert length == len(hf)
        assert out["responses"][i, :length].tolist() == hf.tolist()


def test_output_layout(model, prompts):
    _, input_ids, attention_mask = prompts
    out = engine_for(model).generate(
        input_ids, attention_mask, SamplingParams(max_tokens=6, seed=0)
    )
    rows, resp_len = out["responses"].shape
    assert rows == input_ids.shape[0] and resp_len <= 6
    assert torch.equal(out["prompts"], input_ids)
    assert torch.equal(out["input_ids"], torch.cat([input_ids, out["responses"]], dim=1))
    assert torch.equal(
        out["attention_mask"], torch.cat([attention_mask, out["response_mask"]], dim=1)
    )
    expected_pos = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(out["position_ids"], expected_pos)
    for key in ("response_mask", "rollout_log_probs"):
        assert out[key].shape == (rows, resp_len)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_score(model, prompts, temperature):
    _, input_ids, attention_mask = prompts
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, n=2, seed=3)
    out = engine_for(model).generate(input_ids, attention_mask, params)
    mask = out["response_mask"]
    scored = score(
        model,
        out["input_ids"],
        out["attention_mask"],
        out["position_ids"],
        out["responses"].shape[1],
        temperature=temperature,
    )
    assert torch.allclose(scored * mask, out["rollout_log_probs"], atol=1e-4)
    assert (out["rollout_log_probs"][mask == 0] == 0).all()
    assert (out["rollout_log_probs"][mask == 1] < 0).all()


def test_eos_and_stop_ids_end_a_row_and_mask_after_it(model, prompts):
    _, input_ids, attention_mask = prompts
    greedy = SamplingParams(greedy=True, max_tokens=MAX_TOKENS)
    free = engine_for(model, eos=[]).generate(input_ids, attention_mask, greedy)
    assert free["responses"].shape[1] == MAX_TOKENS  # nothing stops without eos
    # make row 0's third token the stop token: each row must end at its first occurrence
    stop_tok = int(free["responses"][0, 2])
    lengths = []
    for row in free["responses"].tolist():
        lengths.append(row.index(stop_tok) + 1 if stop_tok in row else MAX_TOKENS)
    assert lengths[0] <= 3
    for eos, extra in ((stop_tok, []), ([], [stop_tok])):  # as eos, then as a stop id
        params = SamplingParams(greedy=True, max_tokens=MAX_TOKENS, stop_token_ids=extra)
        out = engine_for(model, eos=eos).generate(input_ids, attention_mask, params)
        width = out["responses"].shape[1]
        assert width == max(lengths)
        for i, length in enumerate(lengths):
            assert out["response_mask"][i].tolist() == [1] * length + [0] * (width - length)
            assert torch.equal(out["responses"][i, :length], free["responses"][i, :length])
            assert (out["responses"][i, length:] == PAD).all()


def test_early_exit_when_all_rows_finish(model, prompts):
    _, input_ids, attention_mask = prompts
    greedy = SamplingParams(greedy=True, max_tokens=MAX_TOKENS)
    free = engine_for(model, eos=[]).generate(input_ids, attention_mask, greedy)
    first_tokens = sorted(set(free["responses"][:, 0].tolist()))
    out = engine_for(model, eos=first_tokens).generate(input_ids, attention_mask, greedy)
    assert out["responses"].shape[1] == 1
    assert out["response_mask"].all()


def test_n_samples_interleaved_and_seeded(model, prompts):
    _, input_ids, attention_mask = prompts
    n = 4
    engine = engine_for(model, eos=[])
    params = SamplingParams(temperature=1.0, max_tokens=8, n=n, seed=123)
    out = engine.generate(input_ids, attention_mask, params)
    batch = input_ids.shape[0]
    assert out["responses"].shape == (batch * n, 8)
    assert torch.equal(out["prompts"], input_ids.repeat_interleave(n, dim=0))
    for i in range(batch):
        group = out["responses"][i * n : (i + 1) * n]
        assert len({tuple(r) for r in group.tolist()}) > 1, "samples of one prompt all equal"

    again = engine.generate(input_ids, attention_mask, params)
    for key in out:
        assert torch.equal(out[key], again[key]), key
    via_generator = engine.generate(
        input_ids,
        attention_mask,
        SamplingParams(temperature=1.0, max_tokens=8, n=n),
        generator=torch.Generator().manual_seed(123),
    )
    assert torch.equal(via_generator["responses"], out["responses"])
    other = engine.generate(
        input_ids, attention_mask, SamplingParams(temperature=1.0, max_tokens=8, n=n, seed=124)
    )
    assert not torch.equal(other["responses"], out["responses"])


def test_a_generator_per_row_samples_each_row_alike_whatever_rows_share_the_call(model, prompts):
    """One generator per output row: a row's tokens are those it gets alone, however many
    tokens the call decodes; a list of the wrong length is refused."""
    rows, input_ids, attention_mask = prompts
    engine = engine_for(model, eos=[])
    params = SamplingParams(temperature=1.0, max_tokens=8)

    def gens(seeds: list[int]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(s) for s in seeds]

    together = engine.generate(input_ids, attention_mask, params, generator=gens([5, 6, 7, 8]))["responses"]
    for i, row in enumerate(rows):
        alone = engine.generate(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long),
                                SamplingParams(temperature=1.0, max_tokens=3), generator=gens([5 + i]))
        assert torch.equal(alone["responses"][0], together[i, :3]), i
    assert not torch.equal(together, engine.generate(input_ids, attention_mask, params,
                                                     generator=gens([8, 7, 6, 5]))["responses"])
    with pytest.raises(ValueError, match="one per output row"):
        engine.generate(input_ids, attention_mask, params, generator=gens([1, 2]))


def test_n_samples_match_repeated_prompts(model, prompts):
    """Fanning out the prefilled cache equals prefilling each copy of the prompt."""
    _, input_ids, attention_mask = prompts
    engine = engine_for(model)
    fanned = engine.generate(input_ids, attention_mask, SamplingParams(max_tokens=8, n=3, seed=5))
    repeated = engine.generate(
        input_ids.repeat_interleave(3, dim=0),
        attention_mask.repeat_interleave(3, dim=0),
        SamplingParams(max_tokens=8, n=1, seed=5),
    )
    assert torch.equal(fanned["responses"], repeated["responses"])
    assert torch.allclose(fanned["rollout_log_probs"], repeated["rollout_log_probs"], atol=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, seed=0),
        SamplingParams(temperature=1.3, top_p=1e-6, max_tokens=MAX_TOKENS, seed=0),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    ],
    ids=["top_k=1", "tiny_top_p", "temperature=0"],
)
def test_degenerate_sampling_equals_greedy(model, prompts, params):
    _, input_ids, attention_mask = prompts
    engine = engine_for(model)
    greedy = engine.generate(
        input_ids, attention_mask, SamplingParams(greedy=True, max_tokens=MAX_TOKENS)
    )
    out = engine.generate(input_ids, attention_mask, params)
    assert torch.equal(out["responses"], greedy["responses"])
    assert torch.equal(out["response_mask"], greedy["response_mask"])
    if params.temperature == 1.0:  # log-probs ignore truncation: same as greedy's at T=1
        assert torch.allclose(out["rollout_log_probs"], greedy["rollout_log_probs"], atol=1e-6)


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_max_tokens_respected(model, prompts, max_tokens):
    _, input_ids, attention_mask = prompts
    out = engine_for(model, eos=[]).generate(
        input_ids, attention_mask, SamplingParams(max_tokens=max_tokens, n=2, seed=0)
    )
    assert out["responses"].shape == (2 * input_ids.shape[0], max_tokens)
    assert out["response_mask"].all()


def test_candidate_probs_hand_values():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    kept, ids = candidate_probs(logits, top_k=0, top_p=0.7)  # 0.5 < 0.7, so 0.3 stays too
    assert ids[0, :2].tolist() == [1, 3]
    assert torch.allclose(kept, torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    kept, ids = candidate_probs(logits, top_k=0, top_p=0.5)  # reached by the first alone
    assert ids[0, 0] == 1 and torch.allclose(kept, torch.tensor([[0.5, 0.0, 0.0, 0.0]]))
    kept, ids = candidate_probs(logits, top_k=2, top_p=1.0)  # renormalised over the two kept
    assert ids.tolist() == [[1, 3]] and torch.allclose(kept, torch.tensor([[0.625, 0.375]]))
    kept, ids = candidate_probs(logits, top_k=0, top_p=1.0)
    assert ids is None and torch.allclose(kept, probs)


def test_draw_follows_probs_and_never_picks_zero(monkeypatch):
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8]]).expand(20000, -1)
    picks = draw(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(picks, minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[3].item() / len(picks) - 0.8) < 0.02
    # a uniform whose product with the total rounds up to the total still lands on mass
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw["dtype"]))
    assert draw(torch.tensor([[0.3, 0.7, 0.0]]), None).item() == 1


def test_load_weights_copies_in_place(prompts):
    _, input_ids, attention_mask = prompts
    target, source = tiny_llama(seed=0), tiny_llama(seed=7)
    engine = engine_for(target, eos=[])
    params = SamplingParams(greedy=True, max_tokens=MAX_TOKENS)
    before = engine.generate(input_ids, attention_mask, params)["responses"]
    want = engine_for(source, eos=[]).generate(input_ids, attention_mask, params)["responses"]
    assert not torch.equal(before, want)

    embed = target.model.embed_tokens.weight
    loaded = engine.load_weights(source.state_dict())
    assert loaded == len(source.state_dict())
    assert engine.model.model.embed_tokens.weight is embed  # same storage, new values
    assert torch.equal(engine.generate(input_ids, attention_mask, params)["responses"], want)
    assert engine.load_weights(iter(source.named_parameters())) > 0

    with pytest.raises(WeightLoadError, match="no parameter"):
        engine.load_weights({"nope.weight": torch.zeros(1)})
    with pytest.raises(WeightLoadError, match="shape mismatch"):
        engine.load_weights({"lm_head.weight": torch.zeros(3, 3)})


def test_generate_restores_training_mode(prompts):
    _, input_ids, attention_mask = prompts
    model = tiny_llama().train()
    engine_for(model).generate(input_ids, attention_mask, SamplingParams(max_tokens=2, seed=0))
    assert model.training


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(temperature=0.0).is_greedy


def _peak_gib(fn) -> float:
    """The process's resident high-water mark while `fn` runs, above where it started (Linux)."""
    def hwm() -> float:
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 2**20

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident size
    start = hwm()
    fn()
    return hwm() - start


def test_prefill_does_not_copy_a_frozen_head_per_row():
    """A bf16 generation-only model (its head needs no gradient) prefilling 32 rows: the LM head
    runs on contiguous hidden states, so torch makes no [rows, hidden, vocab] copy of it (32 x 64
    x 50,000 bf16 = 205 MB here; 8.7 GB for a 0.5B model's held-out wave of 32 rows before)."""
    config = LlamaConfig(vocab_size=50_000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
    engine = RolloutEngine(lm, eos_token_id=1, pad_token_id=0)
    ids = torch.randint(5, 1000, (32, 40))
    params = SamplingParams(n=1, max_tokens=2, greedy=True)
    engine.generate(ids, torch.ones_like(ids), params)  # warm-up: allocator pools, lazy inits
    extra = _peak_gib(lambda: engine.generate(ids, torch.ones_like(ids), params))
    assert extra < 0.1, f"prefill of 32 rows raised the peak by {extra:.2f} GiB"


def test_decode_attention_by_matmuls_is_sdpas():
    """The compiled CPU decode's attention (`asyncrl.rollout.attention`): one query token a row,
    grouped KV heads, a padded boolean mask: SDPA's output within fp32 rounding; a prompt's many
    query tokens go to SDPA itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from asyncrl.rollout.attention import decode_attention

    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, columns, dim = 5, 6, 2, 11, 8
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    key, value = (torch.randn(rows, kv_heads, columns, dim, generator=g) for _ in range(2))
    mask = torch.arange(columns) >= torch.tensor([0, 3, 5, 2, 9])[:, None]  # left padding per row
    for q_len in (1, 4):
        query = torch.randn(rows, heads, q_len, dim, generator=g)
        m = mask[:, None, None, :].expand(rows, 1, q_len, columns)
        ours, _ = decode_attention(module, query, key, value, m, scaling=0.3)
        theirs, _ = sdpa_attention_forward(module, query, key, value, m, scaling=0.3)
        assert ours.shape == theirs.shape == (rows, q_len, heads, dim)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_a_packed_prefill_on_cpu_attends_prompt_by_prompt_as_each_prompt_alone(monkeypatch):
    """On CPU the packed prefill's attention runs each prompt alone (`attention.prompt_by_prompt`,
    not SDPA over the whole block-diagonal mask): each prompt's last logits and its keys and
    values are those of the prompt through the model by itself."""
    import asyncrl.rollout.attention as attention_module
    from asyncrl.rollout.engine import prefill_packed

    model = tiny_llama(seed=0).requires_grad_(False)
    lengths = torch.tensor([3, 7, 1, 5])
    tokens = torch.randint(3, 32, (int(lengths.sum()),), generator=torch.Generator().manual_seed(2))
    bounds, real = [], attention_module.prompt_by_prompt
    monkeypatch.setattr(attention_module, "prompt_by_prompt", lambda *a: bounds.append(a[3]) or real(*a))
    logits, cache = prefill_packed(model, tokens, lengths)
    assert bounds == [[0, 3, 10, 11, 16]] * model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"  # restored
    starts = [0, 3, 10, 11]
    for i, (start, length) in enumerate(zip(starts, lengths.tolist(), strict=True)):
        alone = model(input_ids=tokens[None, start:start + length], use_cache=True)
        torch.testing.assert_close(logits[i], alone.logits[0, -1].float(), atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(cache.layers, alone.past_key_values.layers, strict=True):
            torch.testing.assert_close(ours.keys[0, :, start:start + length], theirs.keys[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours.values[0, :, start:start + length], theirs.values[0], atol=1e-5, rtol=1e-5)


def test_packed_linears_run_on_onednn_packed_weights_and_match_plain_ones():
    """`asyncrl.rollout.packed`: inside `active()` an installed model's linears run the packed op
    (a packed copy per weight, repacked after an in-place change), with F.linear's results."""
    from asyncrl.rollout import packed

    if not packed.available():
        pytest.skip("this torch has no oneDNN")
    model = tiny_llama(seed=0).requires_grad_(False)
    x = torch.randint(3, 32, (4, 6))
    with torch.no_grad():
        plain = model(x).logits
        assert packed.install(model) > 0
        with packed.active():
            out = model(x).logits
            held = {k: v[2] for k, v in packed._packed.items()}
            model.lm_head.weight.mul_(2)  # in place: its version moves, the next call repacks it
            doubled = model(x).logits
            assert len(held) > 0 and any(packed._packed[k][2] is not held[k] for k in held)
        assert not packed._packed  # dropped on leaving
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(doubled, out)


def test_calls_inside_keeping_packs_pack_each_linear_once(prompts, monkeypatch):
    """`RolloutEngine.keeping_packs` (the actor's multi-turn rollouts run inside it): compiled CPU
    decodes inside pack each linear once for all their calls, repack one changed in place (with
    its new results), and drop the packs when it ends; outside it every call packs again."""
    from asyncrl.rollout import packed

    if not packed.available():
        pytest.skip("this torch has no oneDNN linear packing")
    _, input_ids, attention_mask = prompts
    made, real = [], packed._reorder
    monkeypatch.setattr(packed, "_reorder", lambda weight, rows: made.append(weight) or real(weight, rows))
    model = tiny_llama(seed=0).requires_grad_(False)
    engine = RolloutEngine(model, eos_token_id=[], pad_token_id=PAD, decode="compiled")
    params = SamplingParams(greedy=True, max_tokens=1)  # the prefill's packed linears, nothing to compile
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    engine.generate(input_ids, attention_mask, params)
    assert len(made) == linears and not packed._packed  # dropped: the next call packs again
    made.clear()
    with engine.keeping_packs():
        engine.generate(input_ids, attention_mask, params)
        engine.generate(input_ids, attention_mask, params)
        assert len(made) == linears and len(packed._packed) == linears
        model.lm_head.weight.mul_(-1)
        flipped = engine.generate(input_ids, attention_mask, params)
        assert [w.data_ptr() for w in made[linears:]] == [model.lm_head.weight.data_ptr()]
    assert not packed._packed
    eager = RolloutEngine(model, eos_token_id=[], pad_token_id=PAD).generate(input_ids, attention_mask, params)
    assert torch.equal(flipped["responses"], eager["responses"])


def test_packed_prefill_groups_rows_within_the_token_budget():
    from asyncrl.rollout.engine import token_groups

    assert token_groups([3, 7, 1, 5], 10) == [range(0, 2), range(2, 4)]
    assert token_groups([12, 3], 10) == [range(0, 1), range(1, 2)]  # a longer row alone
    assert token_groups([3, 7, 1, 5], 100) == [range(0, 4)]


def test_compiled_decode_matches_eager_across_stops_sampling_and_weight_updates(prompts, monkeypatch):
    """decode=compiled (a static KV cache, the decode step compiled once, the prompts prefilled
    without padding) gives eager's tokens and log-probs: greedy with rows stopping at different
    steps, sampled with a generator per row, the prefill in several packed groups, after weights
    copied in place and after parameters rebound (as the hybrid engine's reshard does) — without
    compiling again."""
    from torch._dynamo.utils import counters

    import asyncrl.rollout.engine as engine_module

    _, input_ids, attention_mask = prompts
    model, other = tiny_llama(seed=0).requires_grad_(False), tiny_llama(seed=7)  # a generation model's weights
    free = engine_for(model, eos=[]).generate(input_ids, attention_mask, SamplingParams(greedy=True, max_tokens=12))
    stop = int(free["responses"][0, 2])  # row 0 stops by its third token, others later or never
    eager = RolloutEngine(model, eos_token_id=stop, pad_token_id=PAD)
    compiled = RolloutEngine(model, eos_token_id=stop, pad_token_id=PAD, decode="compiled")

    def same(params: SamplingParams, generators=None) -> None:
        gens = (lambda: [torch.Generator().manual_seed(i) for i in range(generators)]) if generators else lambda: None
        a = eager.generate(input_ids, attention_mask, params, gens())
        b = compiled.generate(input_ids, attention_mask, params, gens())
        assert a.keys() == b.keys()
        for key in a:
            if key == "rollout_log_probs":
                torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)
            else:
                assert torch.equal(a[key], b[key]), key

    greedy = SamplingParams(greedy=True, max_tokens=12, n=2)
    same(greedy)
    assert 1 < int(free["response_mask"].sum(-1).min()) and stop in free["responses"][0].tolist()
    graphs = counters["stats"]["unique_graphs"]
    with monkeypatch.context() as m:
        m.setattr(engine_module, "PACKED_PREFILL_TOKENS", 8)  # prompts of 3, 7, 1, 5 tokens: 3 groups
        same(greedy)
    same(SamplingParams(temperature=1.0, max_tokens=12, n=2), generators=8)
    # one generator for the call, every row ended between two stop checks: the compiled decode ran
    # a few steps more, and gives their random numbers back (the generator goes on as after eager)
    many_stops = SamplingParams(temperature=1.0, max_tokens=12, n=2, stop_token_ids=list(range(3, 11)))
    shared = [torch.Generator().manual_seed(5) for _ in range(2)]
    a, b = (e.generate(input_ids, attention_mask, many_stops, g) for e, g in zip((eager, compiled), shared, strict=True))
    assert a["responses"].shape[1] % 8 and torch.equal(a["responses"], b["responses"])
    assert torch.equal(shared[0].get_state(), shared[1].get_state())
    eager.load_weights(other.state_dict())  # in place: the compiled graph reads the new values
    same(greedy)
    for name, param in list(model.named_parameters()):  # rebound, as GenerationModel.bind does
        owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        owner._parameters[leaf] = torch.nn.Parameter(param.detach().clone() * 1.01, requires_grad=False)
    same(greedy)
    assert counters["stats"]["unique_graphs"] == graphs  # one graph for every call above
    with pytest.raises(ValueError, match="decode must be"):
        RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, decode="fast")


def test_compiled_continuous_batch_matches_eager_calls_alone_across_moves_growth_and_weight_updates(monkeypatch):
    """`rollout.decode=compiled` in a continuous batch (`CompiledBatcher`: a preallocated KV cache
    stepped by the compiled step, prompts prefilled without padding) gives each call's tokens
    (greedy) and log-probs (<= 1e-5) as the eager engine decoding that call alone: a longer prompt
    joining running rows (every row's columns move right), a full cache (the columns in use move
    left), a row needing more columns than the cache has (it grows, live rows copied), weights
    copied in place between calls, and two calls joining at once in two packed prefills."""
    import threading

    import asyncrl.rollout.continuous as continuous_module
    from asyncrl.rollout.continuous import CompiledBatcher, continuous_batcher

    class Fixed:
        version, interrupt = 0, False

        def pending(self) -> bool:
            return False

    gen = torch.Generator().manual_seed(0)
    short, longer = torch.randint(5, 30, (1, 4), generator=gen), torch.randint(5, 30, (1, 30), generator=gen)
    ones = torch.ones_like

    def greedy(tokens: int) -> SamplingParams:
        return SamplingParams(greedy=True, max_tokens=tokens, n=2)

    # 4 slots: the first call's 2 rows run, the second's 2 join them, the third waits for free slots
    rounds = [[(short, ones(short), greedy(40)), (longer, ones(longer), greedy(40)), (short, ones(short), greedy(60))],
              [(short, ones(short), greedy(40)), (longer, ones(longer), greedy(40)), (short, ones(short), greedy(100))]]
    weights = [tiny_llama(seed=0).requires_grad_(False), tiny_llama(seed=7).requires_grad_(False)]
    alone = [[RolloutEngine(w, eos_token_id=[], pad_token_id=PAD).generate(*call) for call in calls]
             for w, calls in zip(weights, rounds, strict=True)]

    model = tiny_llama(seed=0).requires_grad_(False)
    batcher = continuous_batcher(RolloutEngine(model, eos_token_id=[], pad_token_id=PAD, decode="compiled"),
                                 slots=4, weights=Fixed())
    assert isinstance(batcher, CompiledBatcher)
    moves: list[tuple[int, int]] = []
    shift = batcher._shift
    batcher._shift = lambda by: (moves.append((by, batcher.cursor)), shift(by))[1]
    widths = []
    for version, (calls, refs) in enumerate(zip(rounds, alone, strict=True)):
        model.load_state_dict(weights[version].state_dict())  # in place, between calls
        got: list[dict] = [{} for _ in calls]
        threads = [threading.Thread(target=lambda out=out, call=call: out.update(batcher.generate(*call)))
                   for out, call in zip(got, calls, strict=True)]
        before = batcher.steps
        threads[0].start()
        while batcher.steps == before and threads[0].is_alive():  # the first call runs: the others join it
            threading.Event().wait(0.001)
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(300)
        for ref, out in zip(refs, got, strict=True):
            width = ref["responses"].shape[1]
            assert torch.equal(out["responses"][:, :width], ref["responses"]), version
            torch.testing.assert_close(out["rollout_log_probs"][:, :width], ref["rollout_log_probs"], atol=1e-5, rtol=0)
        widths.append(batcher.width)
    monkeypatch.setattr(continuous_module, "PACKED_PREFILL_TOKENS", 8)  # 4 and 30 tokens: a prefill each
    with batcher._cv:  # both queued before the loop admits either: they join in one admit
        requests = [batcher.submit(row.tolist(), call[2]) for row, call in zip((short[0], longer[0]), rounds[1][:2], strict=True)]
    for r, ref in zip(requests, alone[1][:2], strict=True):
        r.future.result(timeout=300)
        assert r.tokens == ref["responses"].tolist()
        torch.testing.assert_close(torch.tensor(r.logprobs), ref["rollout_log_probs"], atol=1e-5, rtol=0)
    assert any(by > 0 and cursor > 0 for by, cursor in moves), moves  # right, past live columns
    assert any(by < 0 for by, _ in moves), moves  # left: round 1's third call ran past 96 columns
    assert widths == [96, 224], widths  # 2 x 44 and 2 x 104 columns, rounded up to 32s
