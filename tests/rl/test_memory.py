"""Memory knobs of the training passes, checked for exactness: logits only at response positions
and in fp32 chunks (recomputed in the backward), token-budget micro-batches whose loss and
gradients equal one pass over the mini-batch, activation checkpointing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.algorithms import core
from asyncrl.algorithms.core import LOSS_AGG_MODES
from asyncrl.config import PPOUpdateConfig
from asyncrl.data.dataset import positions_from_mask
from asyncrl.roles.forward import response_forward, response_logprobs
from asyncrl.roles.update import ppo_update, token_micro_batches, unpermute
from asyncrl.single_controller.batch import Batch


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def _batch(rows: int = 7, prompt: int = 6, width: int = 5, seed: int = 1) -> Batch:
    """Left-padded prompts of 2..prompt tokens, right-padded responses of 1..width tokens."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(1, width + 1, (rows,), generator=g)
    ids = torch.randint(1, 97, (rows, prompt + width), generator=g)
    mask = torch.zeros(rows, prompt + width, dtype=torch.long)
    for i in range(rows):
        mask[i, prompt - int(p_len[i]):prompt + int(r_len[i])] = 1
    ids = ids * mask
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
                  "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
                  "advantages": torch.randn(rows, width, generator=g)})


def _full_logits_reference(model, mb, temperature, with_entropy):
    """What the forward computed before: every position's logits, then one fp32 pass."""
    r = mb["responses"].shape[1]
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                position_ids=mb["position_ids"], use_cache=False)
    logits = out.logits[:, -r - 1:-1].float() / temperature
    return core.logprobs_from_logits(logits, mb["responses"]), core.entropy_from_logits(logits) if with_entropy else None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_forward_equals_the_full_logits_pass_with_gradients(temperature):
    batch = _batch()
    model = _model()
    logp, ent = response_forward(model, batch, temperature, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_logp, ref_ent = _full_logits_reference(model, batch, temperature, True)
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    for a, p in zip(grads, model.parameters(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-5)


def test_chunked_logprobs_recompute_in_backward_and_match():
    """Chunks of 3 positions (checkpointed under autograd) give the one-chunk values and grads."""
    logits = torch.randn(4, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (4, 5))
    lp, ent = response_logprobs(logits, labels, 0.9, with_entropy=True, chunk_tokens=3)
    (lp.sum() + 0.5 * ent.sum()).backward()
    chunked = logits.grad.clone()
    logits.grad = None
    lp1, ent1 = response_logprobs(logits, labels, 0.9, with_entropy=True, chunk_tokens=1000)
    (lp1.sum() + 0.5 * ent1.sum()).backward()
    assert torch.allclose(lp, lp1) and torch.allclose(ent, ent1) and torch.allclose(chunked, logits.grad)
    with torch.no_grad():
        lp2, none = response_logprobs(logits, labels, 0.9, with_entropy=False, chunk_tokens=2)
    assert none is None and torch.allclose(lp2, lp1)


def test_token_micro_batches_respect_the_budget_and_cover_every_row_once():
    batch = _batch(rows=13, prompt=8, width=6, seed=3)
    mbs, order = token_micro_batches(batch, max_tokens=30, max_rows=4)
    assert sorted(order.tolist()) == list(range(13))
    assert len(mbs) > 1
    for mb in mbs:
        shape = mb["input_ids"].shape  # trimmed: rows x (longest prompt + longest response)
        assert len(mb) <= 4 and (len(mb) == 1 or shape[0] * shape[1] <= 30), shape
    # per-row outputs come back in the batch's order and width
    parts = [mb["responses"].float() for mb in mbs]
    back = unpermute(parts, order, batch["responses"].shape[1])
    masked = batch["responses"].float() * batch["response_mask"]
    assert torch.equal(back * batch["response_mask"], masked)


class _RecordingEngine:
    """A training engine that sums the weighted micro-batch losses and keeps the gradients."""

    pipelined = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def train_step(self, micro_batches, loss_fn):
        self.model.zero_grad()
        total = torch.zeros(())
        for mb in micro_batches:
            loss, _ = loss_fn(self.model, mb)
            loss.backward()
            total += loss.detach()
        self.loss, self.grads = total, [p.grad.clone() for p in self.model.parameters()]
        self.micro_batches = len(micro_batches)
        return {"loss": float(total)}


def _update(mode: str, **knobs) -> _RecordingEngine:
    engine = _RecordingEngine(_model())
    cfg = PPOUpdateConfig(ppo_mini_batches=1, shuffle=False, loss_agg_mode=mode, **knobs)

    def loss(model, mb):
        logp, _ = response_forward(model, mb)
        # norm_len constant, as the actor passes it (rollout.max_tokens): trimmed widths differ
        return core.agg_loss(-logp * mb["advantages"], mb["response_mask"].float(), mode, norm_len=6), {}

    ppo_update(engine, _batch(rows=9, prompt=7, width=6, seed=5), cfg, loss, torch.Generator())
    return engine


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_token_budget_micro_batches_give_the_loss_and_gradients_of_one_pass(mode):
    whole = _update(mode, micro_batch_size=64)  # one micro-batch: the mini-batch's own loss
    by_tokens = _update(mode, micro_batch_size=64, max_tokens_per_micro_batch=24)
    assert by_tokens.micro_batches > 2
    assert torch.allclose(by_tokens.loss, whole.loss, atol=1e-6)
    for a, b in zip(by_tokens.grads, whole.grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    if mode != "token-mean":  # a mean over rows: the fixed-row micro-batches agree too
        rows = _update(mode, micro_batch_size=2)
        assert torch.allclose(rows.loss, whole.loss, atol=1e-6)


def test_gradient_checkpointing_keeps_the_gradients():
    batch = _batch()
    grads = []
    for checkpointed in (False, True):
        model = _model()
        model.train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logp, _ = response_forward(model, batch)
        (logp * batch["response_mask"]).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_token_budget_knobs_are_checked():
    from asyncrl.config import rl_config
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch"):
        rl_config({"actor": {"max_tokens_per_micro_batch": -2}})  # -1: sized from the memory estimate
    for budget in (512, -1):
        with pytest.raises(ConfigError, match="parallel.pp=1"):
            rl_config({"trainer": {"n_workers": 2}, "actor": {"max_tokens_per_micro_batch": budget, "parallel": {"pp": 2}}})


def test_model_dtype_picks_the_compute_dtype_and_keeps_fp32_masters():
    from asyncrl.config import rl_config
    from asyncrl.train import compute_dtype, mixed_precision_policy
    from transport.checks import ConfigError

    assert compute_dtype("cpu") is torch.float32 and compute_dtype("cuda") is torch.bfloat16  # "auto"
    assert compute_dtype("cpu", "bfloat16") is torch.bfloat16 and compute_dtype("cuda", "float32") is torch.float32
    mp = mixed_precision_policy("cpu", dtype="bfloat16")
    assert mp.param_dtype is torch.bfloat16 and mp.reduce_dtype is torch.float32  # fp32 grads and masters
    assert mixed_precision_policy("cuda", dtype="float32").param_dtype is None
    with pytest.raises(ConfigError, match="model.dtype"):
        rl_config({"model": {"dtype": "fp8"}})


def test_a_big_export_is_sharded_with_an_index_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.train.export import write_safetensors

    model = _model()
    model.config.torch_dtype = torch.bfloat16
    model.config.save_pretrained(tmp_path)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    files = write_safetensors(sd, tmp_path, max_shard_bytes=20_000)
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())
    assert next(loaded.parameters()).dtype is torch.bfloat16


# one copy of the weights per node ------------------------------------------------------------
def _save_checkpoints(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Two small checkpoints as save_pretrained writes them: untied, and tied (no lm_head.weight)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    saved = {}
    for tied in (False, True):
        torch.manual_seed(3)
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=tied)
        model = LlamaForCausalLM(cfg)
        model.save_pretrained(out / f"tied{tied}")
        saved[f"tied{tied}"] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _load_job(rank: int, world_size: int, out: Path) -> dict:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import (
        FSDPEngine,
        OptimConfig,
        init_distributed,
        mixed_precision_policy,
        parallelize,
    )
    from asyncrl.train.load import copy_shards, load_sharded, materialize, skeleton

    init_distributed()
    results = {}
    for name in ("tiedFalse", "tiedTrue"):
        for tp in (1, 2):
            path = str(out / name)
            layout = ParallelLayout.from_config(ParallelConfig(tp=tp), world_size)
            model = parallelize(skeleton(path, torch.float32), layout, mixed_precision_policy("cpu"))
            materialize(model, "cpu")
            engine = FSDPEngine(model, layout, optim=OptimConfig(), device="cpu")
            load_sharded(engine, path)
            ref = parallelize(skeleton(path, torch.bfloat16), layout, mixed_precision_policy("cpu"))
            materialize(ref, "cpu")
            copy_shards(engine.model, ref)
            ref_engine = FSDPEngine(ref, layout, optim=None, device="cpu")
            results[(name, tp)] = (engine.full_state_dict(rank0_only=False), ref_engine.full_state_dict(rank0_only=False),
                                   {n: b.clone() for n, b in engine.model.named_buffers()})
    return results


def test_sharded_load_reads_one_copy_and_matches_the_checkpoint(tmp_path):
    """Every rank's model built on the meta device, sharded (dp2, and tp2), filled from rank 0's
    read of the files: the same tensors as the checkpoint (tied too), the bf16 reference copied
    from the actor's shards, the rotary buffers intact."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.gloo_ranks import run_ranks

    saved = _save_checkpoints(tmp_path)
    per_rank = run_ranks(_load_job, 2, tmp_path, 120)
    for (name, tp), (full, ref, buffers) in per_rank[0].items():
        want = saved[name]
        assert set(full) >= set(want) - {"lm_head.weight"}, (name, tp)
        for k, v in want.items():
            if k in full:
                assert torch.equal(full[k], v), (name, tp, k)
                assert ref[k].dtype is torch.bfloat16 and torch.equal(ref[k], v.to(torch.bfloat16)), (name, tp, k)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        for n, b in plain.named_buffers():
            assert torch.equal(buffers[n], b), (name, tp, n)


def _critic_job(rank: int, world_size: int, out: Path) -> dict:
    from asyncrl.roles.critic import VALUE_HEAD
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import (
        FSDPEngine,
        OptimConfig,
        init_distributed,
        mixed_precision_policy,
        parallelize,
    )
    from asyncrl.train.load import load_sharded, materialize, new_head, skeleton

    init_distributed()
    results = {}
    for tp in (1, 2):
        torch.manual_seed(100 + rank)  # a head drawn on any rank but 0 would differ between ranks
        layout = ParallelLayout.from_config(ParallelConfig(tp=tp), world_size)
        model = parallelize(skeleton(str(out / "tiedTrue"), torch.float32, value_head=True), layout,
                            mixed_precision_policy("cpu"))
        materialize(model, "cpu")
        engine = FSDPEngine(model, layout, optim=OptimConfig(), device="cpu")
        load_sharded(engine, str(out / "tiedTrue"), fresh=new_head(VALUE_HEAD, 0.02))
        results[tp] = engine.full_state_dict(rank0_only=False)
    return results


def test_the_critic_loads_one_copy_with_a_fresh_value_head(tmp_path):
    """The critic (a causal LM's body with a one-output token head) built on the meta device and
    filled from rank 0's read of a causal LM checkpoint: the body as saved, the new head drawn
    once (the same on every rank, weights ~ N(0, initializer_range), bias 0), at dp2 and tp2."""
    from tests.helpers.gloo_ranks import run_ranks

    saved = _save_checkpoints(tmp_path)["tiedTrue"]
    per_rank = run_ranks(_critic_job, 2, tmp_path, 120)
    for tp in (1, 2):
        full = per_rank[0][tp]
        body = {k: v for k, v in saved.items() if k.startswith("model.")}
        assert body and all(torch.equal(full[k], v) for k, v in body.items()), tp
        head = full["score.weight"]
        assert head.shape == (1, 32) and 0.005 < float(head.std()) < 0.05, tp
        assert "score.bias" not in full or torch.equal(full["score.bias"], torch.zeros(1)), tp
        assert all(torch.equal(per_rank[1][tp][k], v) for k, v in full.items()), tp


def _stage_job(rank: int, world_size: int, out: Path) -> dict:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import OptimConfig, init_distributed, mixed_precision_policy, parallelize
    from asyncrl.train.load import load_streamed, materialize, skeleton
    from asyncrl.train.pipeline import PipelineEngine, untie_embeddings

    init_distributed()
    results = {}
    for name in ("tiedFalse", "tiedTrue"):
        layout = ParallelLayout.from_config(ParallelConfig(pp=2), world_size)
        model = untie_embeddings(skeleton(str(out / name), torch.float32))
        model = parallelize(model, layout, mixed_precision_policy("cpu"))
        materialize(model, "cpu")
        engine = PipelineEngine(model, layout, optim=OptimConfig(), device="cpu")
        load_streamed(engine, str(out / name))
        results[name] = engine.full_state_dict(rank0_only=False)
    return results


def test_pipeline_stages_load_streamed_from_one_reader(tmp_path):
    """Pipeline stages (pp2) built on the meta device, each rank filled with its own stage's
    tensors as rank 0 streams the checkpoint one tensor at a time: the whole model as saved, the
    untied LM head of a tied checkpoint equal to its embedding."""
    from tests.helpers.gloo_ranks import run_ranks

    saved = _save_checkpoints(tmp_path)
    per_rank = run_ranks(_stage_job, 2, tmp_path, 120)
    for name, want in saved.items():
        full = per_rank[0][name]
        for k, v in want.items():
            assert torch.equal(full[k], v), (name, k)
        assert torch.equal(full["lm_head.weight"], want.get("lm_head.weight", want["model.embed_tokens.weight"]))


def test_host_memory_is_trimmed_only_once_the_process_grew(monkeypatch):
    """A trim (a walk of the whole C heap) runs when the process holds TRIM_MIN_GROWTH more
    resident bytes than after its last trim, and not on every call."""
    import ctypes

    from asyncrl.single_controller import memory as fsdp

    rss = [500 << 20]
    trims: list[int] = []

    class Libc:
        def malloc_trim(self, pad: int) -> int:
            trims.append(pad)
            rss[0] -= 100 << 20  # what the trim gave back
            return 1

    monkeypatch.setattr(fsdp, "resident_bytes", lambda: rss[0])
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setattr(fsdp, "_trimmed_at", 0)
    fsdp.release_host_memory()
    assert len(trims) == 1 and fsdp._trimmed_at == 400 << 20
    rss[0] += fsdp.TRIM_MIN_GROWTH - 1  # freed pages below the threshold stay mapped
    fsdp.release_host_memory()
    assert len(trims) == 1
    rss[0] += 1
    fsdp.release_host_memory()
    assert len(trims) == 2


def test_resident_bytes_reads_this_process():
    import ctypes

    from asyncrl.single_controller.memory import resident_bytes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap's free pages back (kept for reuse): the block below is new
    before = resident_bytes()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched
    assert before is not None and resident_bytes() - before > 48 << 20
    del block
