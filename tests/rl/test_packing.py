"""Packed sequences (`asyncrl.train.packing`), token-balanced partitions
(`asyncrl.single_controller.balance`) and micro-batches by tokens: packed passes equal padded ones."""

from __future__ import annotations

import pytest
import torch

from asyncrl.roles.forward import packed_view, response_forward, sequence_scores, values_forward
from asyncrl.roles.update import agreed_count, token_micro_batches, unpermute
from asyncrl.single_controller.balance import balanced_shards, imbalance, karmarkar_karp
from asyncrl.single_controller.batch import Batch
from asyncrl.train.packing import enable_packing, is_packing, pack
from tests.helpers.gloo_ranks import run_ranks

TOL = 1e-5  # fp32: packed and padded differ by summation order only


def lengths_batch(prompt_lens: list[int], response_lens: list[int], vocab: int = 64, prompt: int | None = None,
                  response: int | None = None, seed: int = 0) -> Batch:
    """A rollout-shaped batch: prompts left-padded to `prompt`, responses right-padded to `response`."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    p, r = prompt or max(prompt_lens), response or max(response_lens)
    mask = torch.zeros(rows, p + r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        mask[i, p - pl:p] = 1
        mask[i, p:p + rl] = 1
    ids = torch.randint(1, vocab, (rows, p + r), generator=g) * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, p:],
                  "response_mask": mask[:, p:]})


def qwen2(cls_name: str = "Qwen2ForCausalLM", seed: int = 0, **extra):
    import transformers

    torch.manual_seed(seed)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0) | extra
    config = transformers.Qwen2Config(**shape)
    return getattr(transformers, cls_name)(config)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


BATCH = dict(prompt_lens=[6, 3, 1, 4, 2], response_lens=[9, 2, 0, 5, 11])


def test_packed_log_probs_entropy_and_gradients_equal_padded():
    model, mb = qwen2(), lengths_batch(**BATCH)
    mask = mb["response_mask"].float()
    inputs = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids")}
    attended = mb["attention_mask"].bool()
    with torch.no_grad():
        logits = model(**inputs).logits
    lp, ent = response_forward(model, mb, temperature=0.7, with_entropy=True)
    (lp * mask).sum().backward()
    padded = grads(model)
    enable_packing(model)
    assert is_packing(model)
    lp2, ent2 = response_forward(model, mb, temperature=0.7, with_entropy=True)
    (lp2 * mask).sum().backward()
    lp, ent, lp2, ent2 = (t.detach() for t in (lp, ent, lp2, ent2))
    assert float(((lp - lp2) * mask).abs().max()) < TOL
    assert float(((ent - ent2) * mask).abs().max()) < TOL
    assert max_diff(padded, grads(model)) < TOL
    with torch.no_grad():  # a padded batch through a packing model: sdpa, unchanged
        assert float((model(**inputs).logits - logits)[attended].abs().max()) == 0


def test_packing_holds_under_activation_checkpointing():
    """The recompute in the backward sees the row bounds (they travel in the forward's kwargs)."""
    model, mb = qwen2(), lengths_batch(**BATCH)
    mask = mb["response_mask"].float()
    (response_forward(model, mb)[0] * mask).sum().backward()
    padded = grads(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    enable_packing(model)
    (response_forward(model, mb)[0] * mask).sum().backward()
    assert max_diff(padded, grads(model)) < TOL


def test_packed_values_and_reward_scores_equal_padded():
    mb = lengths_batch(**BATCH)
    critic = qwen2("Qwen2ForTokenClassification", num_labels=1, classifier_dropout=0.0)
    v = values_forward(critic, mb)
    enable_packing(critic)
    mask = mb["response_mask"].float()
    assert float(((values_forward(critic, mb) - v) * mask).detach().abs().max()) < TOL
    reward = qwen2("Qwen2ForSequenceClassification", num_labels=1).eval()
    mb["input_ids"][4, -1] = 0  # a response ending in the pad id: transformers reads the token before it
    s = sequence_scores(reward, mb)
    enable_packing(reward)
    assert float((sequence_scores(reward, mb) - s).abs().max()) < TOL


def test_a_mixture_of_experts_replays_and_records_the_same_routes_packed():
    from asyncrl.config import MoEConfig
    from asyncrl.roles import routing
    from asyncrl.train.moe import NOT_RECORDED
    from tests.rl.test_moe import tiny_qwen3_moe

    model, mb = tiny_qwen3_moe(), lengths_batch(**BATCH)
    mask = mb["attention_mask"].bool()
    moe = MoEConfig(router_replay="old_policy")

    def run(replay: str | None):
        pk, view = packed_view(model, mb)
        tap = routing.start(model, view, moe, replay=replay)
        lp, _ = response_forward(model, mb, packed=pk)
        chosen = tap.chosen(used=True)
        routes = (pk.unpack(chosen, fill=NOT_RECORDED) if pk is not None
                  else chosen.reshape(*mb["input_ids"].shape, tap.layers, tap.top_k))
        tap.stop()
        return lp, routes

    lp, routes = run(None)
    enable_packing(model)
    lp2, routes2 = run(None)
    rm = mb["response_mask"].bool()
    assert float((lp - lp2)[rm].abs().max()) < TOL
    assert torch.equal(routes[mask], routes2[mask]) and bool((routes2[~mask] == NOT_RECORDED).all())
    mb["old_routed_experts"] = torch.randint(0, 4, routes.shape, generator=torch.Generator().manual_seed(1))
    replayed, _ = run("old_routed_experts")  # packed, random routes replayed
    model.set_attn_implementation("sdpa")
    padded, _ = run("old_routed_experts")
    assert float((replayed - padded)[rm].abs().max()) < TOL and float((replayed - lp)[rm].abs().max()) > 1e-3


def test_packed_micro_batches_fit_the_budget_balance_tokens_and_cover_every_row_once():
    lens = [3, 50, 7, 7, 20, 33, 1, 12, 40, 5, 9, 26]
    mb = lengths_batch([2] * len(lens), lens, seed=3)
    total = sum(lens) + 2 * len(lens)
    mbs, order = token_micro_batches(mb, max_tokens=60, max_rows=8, packed=True)
    tokens = [int(m["attention_mask"].sum()) for m in mbs]
    assert max(tokens) <= 60 and sum(tokens) == total and len(mbs) == -(-total // 60) + 1
    assert imbalance(tokens) < 1.15
    assert sorted(order.tolist()) == list(range(len(lens)))
    back = unpermute([m["response_mask"] for m in mbs], order, mb["responses"].shape[1])
    assert torch.equal(back, mb["response_mask"])
    more, _ = token_micro_batches(mb, max_tokens=60, max_rows=8, packed=True, agree=lambda k: k + 2)
    assert len(more) == len(mbs) + 2  # another rank needs more forwards: everyone runs as many
    padded, _ = token_micro_batches(mb, max_tokens=60, max_rows=8, agree=lambda k: k + 1)
    assert len(padded) == len(token_micro_batches(mb, 60, 8)[0]) + 1


def test_karmarkar_karp_balances_rows_into_equal_sized_shards():
    weights = [100, 3, 3, 3, 3, 50, 50, 1, 2, 90, 10, 10]
    sets = karmarkar_karp(weights, 3)
    assert sorted(i for s in sets for i in s) == list(range(len(weights)))
    loads = [sum(weights[i] for i in s) for s in sets]
    assert imbalance(loads) < 1.05
    equal = karmarkar_karp(weights, 4, equal_size=True)
    assert {len(s) for s in equal} == {3}
    tokens = [900, 880, 800, 820, 10, 12, 20, 30]  # the long rows first: the arrival order's split is skewed
    order = balanced_shards(tokens, 2)
    shards = [order[:4], order[4:]]
    naive = imbalance([sum(tokens[:4]), sum(tokens[4:])])
    balanced = imbalance([sum(tokens[i] for i in s) for s in shards])
    assert sorted(order) == list(range(8)) and balanced < 1.02 < 1.9 < naive
    with pytest.raises(ValueError, match="equal sets"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def _tp_ranks(rank: int, world: int, out_dir):
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed, parallelize

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(tp=2), world)
    mb = lengths_batch(**BATCH)
    mask = mb["response_mask"].float()
    out = {}
    for packed in (False, True):
        model = parallelize(qwen2(), layout)
        if packed:
            enable_packing(model)
        lp, ent = response_forward(model, mb, with_entropy=True)
        (lp * mask).sum().backward()
        out[packed] = (lp.detach(), ent.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return out


def _dp_ranks(rank: int, world: int, out_dir):
    """Rank 0 holds long rows, rank 1 short ones: the token micro-batch counts must agree."""
    from asyncrl.train import init_distributed

    init_distributed()
    mb = lengths_batch([2] * 4, [30, 28, 31, 29] if rank == 0 else [2, 3, 1, 2], seed=rank)
    mine = len(token_micro_batches(mb, max_tokens=40, max_rows=4, packed=True)[0])
    agreed = len(token_micro_batches(mb, max_tokens=40, max_rows=4, packed=True, agree=agreed_count)[0])
    return mine, agreed


def test_packing_under_tensor_parallelism_equals_padded(tmp_path):
    for rank_out in run_ranks(_tp_ranks, 2, tmp_path):
        (lp, ent, g), (lp2, ent2, g2) = rank_out[False], rank_out[True]
        mask = BATCH_MASK()
        assert float(((lp - lp2) * mask).abs().max()) < TOL and float(((ent - ent2) * mask).abs().max()) < TOL
        assert max_diff(g, g2) < TOL


def test_data_parallel_ranks_agree_on_their_micro_batch_count(tmp_path):
    (mine0, agreed0), (mine1, agreed1) = run_ranks(_dp_ranks, 2, tmp_path)
    assert mine0 == 4 and mine1 == 1 and agreed0 == agreed1 == 4


def BATCH_MASK() -> torch.Tensor:  # noqa: N802 - the module's batch's response mask
    return lengths_batch(**BATCH)["response_mask"].float()


def test_pack_keeps_each_rows_tokens_in_order():
    mb = lengths_batch([2, 1], [1, 3])
    pk = pack(mb)
    assert pk.cu.tolist() == [0, 3, 7] and pk.max_len == 4
    packed = pk.pack(mb["input_ids"])[0]
    assert packed.tolist() == mb["input_ids"][mb["attention_mask"].bool()].tolist()
    assert pk.pack(mb["position_ids"])[0].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert torch.equal(pk.unpack(pk.pack(mb["input_ids"])), mb["input_ids"])


def test_a_bidirectional_attention_in_a_packed_forward_ignores_the_rows_bounds():
    """A vision tower's attention (is_causal False) inside a packed language-model forward runs
    over all of its own tokens, whatever row bounds the forward carries."""
    from torch import nn

    from asyncrl.train.packing import packed_attention

    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    tower = nn.Module()
    tower.is_causal = False
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out, _ = packed_attention(tower, q, k, v, None, is_causal=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                              max_length_q=3, max_length_k=3)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert torch.allclose(out, full, atol=1e-6)


def _sp_ranks(rank: int, world: int, out_dir):
    """Each rank its own rows (one long); sp=1 (plain data parallel) against sp=2 (Ulysses)."""
    import torch.distributed as dist

    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.ulysses import run_turns, sequence_parallel, turn_loss

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), world)
    mb = lengths_batch([3, 2, 4], [25, 3, 7] if rank == 0 else [1, 9, 2], seed=rank)
    mask = mb["response_mask"].float()
    out = {}
    for kv in (2, 1):  # kv heads that divide sp, and one that is repeated up to the query heads
        for sp in (1, 2):
            model = qwen2(num_key_value_heads=kv)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            enable_packing(model)
            if sp > 1:
                sequence_parallel(layout, sp, [model], "actor.")
            def log_probs(b, model=model):
                return response_forward(model, b, 0.9, with_entropy=True)

            with torch.no_grad():
                (lp, ent), = run_turns(model, [mb], log_probs)
            halves = [mb.slice(0, 2), mb.slice(2, 3)]  # two micro-batches: turns interleave with the other rank's
            steps, loss_fn = turn_loss(model, halves, lambda m, b: ((response_forward(m, b, 0.9)[0]
                                                                     * b["response_mask"]).sum(), {"n": 1.0}))
            logged = []
            for step in steps:
                loss, metrics = loss_fn(model, step)
                loss.backward()
                logged.append(metrics)
            g = {n: p.grad for n, p in model.named_parameters()}
            for t in g.values():
                dist.all_reduce(t)
            out[kv, sp] = ((lp * mask).detach(), (ent * mask).detach(), g, len(steps), sum(bool(m) for m in logged))
    return out


def test_ulysses_sequence_parallel_equals_data_parallel(tmp_path):
    """sp=2 over two ranks: the same log-probs, entropies and summed gradients as sp=1, with a
    row longer than all the other rows together, activation checkpointing on, GQA kv heads of 2 and 1."""
    for out in run_ranks(_sp_ranks, 2, tmp_path):
        for kv in (2, 1):
            (lp, ent, g, n, owned), (lp2, ent2, g2, n2, owned2) = out[kv, 1], out[kv, 2]
            assert float((lp - lp2).abs().max()) < TOL and float((ent - ent2).abs().max()) < TOL
            assert max_diff(g, g2) < TOL
            assert (n, owned, n2, owned2) == (2, 2, 4, 2)  # two turns each: one owned, one shared


def test_long_sequence_settings_that_cannot_work_exit_2(tmp_path, capsys):
    """sp not dividing the heads, sp on a mixture of experts or without packing, a token budget
    below the longest row, packing on pipeline stages or megatron: one paragraph each, exit 2,
    before a worker starts."""
    from asyncrl.launch import main
    from tests.rl.test_moe import tiny_qwen3_moe

    moe = tmp_path / "moe"
    tiny_qwen3_moe().save_pretrained(moe)
    from asyncrl.models.tiny import build_tokenizer

    build_tokenizer().save_pretrained(moe)
    from asyncrl.models.tiny import ensure_tiny_model

    dense = ensure_tiny_model(tmp_path / "dense", task="sort", hidden=32, layers=1, heads=2, sft_steps=0)
    two = ["trainer.n_workers=2"]
    cases = [(["actor.parallel.sp=3", "trainer.n_workers=3"], "actor.parallel.sp=3: sequence parallel size 3 must divide"),
             (["actor.parallel.sp=2", "actor.pack_sequences=false", *two], "Ulysses shards packed micro-batches"),
             (["actor.parallel.sp=2", "trainer.n_workers=3"], "parallel.sp=2 must be >= 1 and divide"),
             (["actor.max_tokens_per_micro_batch=16"], "raise actor.max_tokens_per_micro_batch to at least"),
             (["critic.max_tokens_per_micro_batch=16", "algorithm.name=ppo"], "critic.max_tokens_per_micro_batch"),
             (["actor.pack_sequences=true", "actor.parallel.pp=2", *two], "pipeline stages exchange"),
             (["actor.pack_sequences=true", "actor.backend=megatron"], "packed sequences do not run on actor.backend=megatron"),
             (["actor.parallel.sp=2", f"model.path={moe}", *two], "mixture-of-experts model")]
    for extra, hint in cases:
        out = tmp_path / "out"
        model = [] if any(e.startswith("model.path=") for e in extra) else [f"model.path={dense}"]
        assert main(["--config-name", "grpo", f"trainer.output_dir={out}", *model, *extra]) == 2, extra
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("asyncrl-launch: ") and hint in last, (extra, last)
        assert not list(out.glob("logs/*/*worker*")), extra


def _sp_tp_ranks(rank: int, world: int, out_dir):
    """dp=2 x tp=2 under FSDP2 and DTensor TP: sp=1 against sp=2 (the sp groups are the dp pairs
    of one TP coordinate; each attends its TP heads, split again over sp)."""
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed, parallelize
    from asyncrl.train.ulysses import sequence_parallel, turn_loss

    init_distributed()
    out = {}
    for sp in (1, 2):
        layout = ParallelLayout.from_config(ParallelConfig(tp=2, sp=sp), world)
        dp = layout.dp_rank(rank)
        mb = lengths_batch([3, 2], [17, 4] if dp == 0 else [1, 6], seed=dp)
        model = parallelize(qwen2(), layout)
        enable_packing(model)
        if sp > 1:
            sequence_parallel(layout, sp, [model], "actor.")
        steps, loss_fn = turn_loss(model, [mb], lambda m, b: ((response_forward(m, b)[0] * b["response_mask"]).sum(), {}))
        kept = []
        for step in steps:
            loss, _ = loss_fn(model, step)
            loss.backward()
            kept.append(loss.detach())
        out[sp] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}, sum(kept)
    return out


def test_ulysses_composes_with_tensor_parallelism_and_fsdp(tmp_path):
    for out in run_ranks(_sp_tp_ranks, 4, tmp_path):
        (g1, loss1), (g2, loss2) = out[1], out[2]
        assert max_diff(g1, g2) < TOL and abs(float(loss1 - loss2)) < TOL


def test_the_cuda_varlen_wrapper_repeats_kv_heads_where_torch_has_no_enable_gqa(monkeypatch):
    """torch 2.11 (the GPU hosts') has `varlen_attn` without `enable_gqa`: the wrapper repeats the
    grouped kv heads itself. Checked on CPU with a stand-in of that signature (the real kernel is
    CUDA-only) against the CPU path of `varlen_causal`."""
    import torch.nn.attention.varlen as varlen_mod
    import torch.nn.functional as F

    from asyncrl.train import packing

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1] and window_size == (-1, 0), "no gqa in this signature"
        out = torch.empty_like(query)
        for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
            out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (query, key, value)),
                                                      is_causal=True, scale=scale).transpose(0, 1)
        return out

    monkeypatch.setattr(varlen_mod, "varlen_attn", old_varlen_attn)
    packing._cuda_varlen.cache_clear()
    try:
        torch.manual_seed(0)
        q, k, v = torch.randn(4, 9, 8), torch.randn(2, 9, 8), torch.randn(2, 9, 8)
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        got = packing._cuda_varlen()(q, k, v, cu, 5, None)
        want = packing.varlen_causal(q, k, v, cu, 5, None)
    finally:
        packing._cuda_varlen.cache_clear()
    torch.testing.assert_close(got, want)


def test_position_ids_alone_do_not_isolate_packed_rows():
    """Why packing registers its own attention: two rows concatenated with restarting
    position_ids, through transformers' own `sdpa` attention, leak into each other (the second
    row's logits move); test_packed_log_probs_entropy_and_gradients_equal_padded checks that the
    packed path of `enable_packing` keeps them apart."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).eval()
    a, b = torch.randint(0, 100, (1, 7)), torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        alone = model(b).logits[0]
        packed = model(torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None]).logits[0, 7:]
    assert (packed - alone).abs().max() > 0.05
