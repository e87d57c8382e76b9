"""The megatron-core backend (`actor.backend=megatron`) on gloo CPU ranks, against Hugging Face.

The HF <-> Megatron mapping is checked in-process (every rule, tp 1/2/4, bit-exact); one 2-rank
job (tp=2) and one 2-rank job (dp=2) run the real megatron-core code: logits of Llama, Qwen2
(qkv bias, tied embeddings) and Qwen3 (q/k norm) models with GQA against the HF model, training
steps against a single-process AdamW reference, the checkpoint's resume and HF export, and the
reshard into generation TP 1 and 2 (bytes and tensors).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is in the test extra: pip install -e '.[test]'")

from asyncrl.config import OptimConfig  # noqa: E402
from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout  # noqa: E402
from asyncrl.train.megatron.convert import GPTShape, dict_reader, hf_tensors, megatron_shard  # noqa: E402
from tests.helpers.gloo_ranks import run_ranks  # noqa: E402

# name -> (architecture, vocabulary, tied)
MODELS = {"llama": ("llama", 64, False), "llama_odd": ("llama", 63, False), "qwen2": ("qwen2", 64, True),
          "qwen3": ("qwen3", 64, False)}
OPTIM = OptimConfig(lr=1e-2, grad_clip=1.0, warmup_steps=1, total_steps=5)
ROWS, SEQ, STEPS, SAVE_AT = 4, 10, 4, 2
JOB_TIMEOUT_S = 240


def hf_model(name: str):
    import transformers as T

    arch, vocab, tied = MODELS[name]
    config_cls, model_cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                             "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM)}[arch]
    config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # norms and biases away from their init values, so a mix-up shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def probe(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with left padding (as prompts come) and their mask."""
    ids = torch.randint(0, vocab, (3, SEQ), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    return ids, mask


def step_rows(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def lm_loss(model, mb):
    ids, scale = (mb["input_ids"], mb.scale) if isinstance(mb, dict) else (mb, 1.0)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return ce * scale, {"ce": ce.detach()}


# -- the mapping, in-process ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_and_back_is_exact(name: str, tp: int) -> None:
    """Every HF tensor survives HF -> Megatron (tp shards) -> HF bit for bit (tp must divide the 2 query groups), and k consecutive
    shards give the k/tp slice a generation TP rank holds."""
    model = hf_model(name)
    sd = model.state_dict()
    shape = GPTShape.from_hf(model.config)
    read = dict_reader(sd)
    seen = set()
    for rule in shape.rules():
        shards = [megatron_shard(rule, read, shape, tp, r) for r in range(tp)]
        assert len({s.shape for s in shards}) == 1
        for hf_name, t in hf_tensors(rule, shards, shape, tp).items():
            assert torch.equal(t, sd[hf_name]), hf_name
            seen.add(hf_name)
        if tp > 1 and rule.kind not in ("copy", "vocab"):
            half = hf_tensors(rule, shards[tp // 2:], shape, tp)
            for hf_name, t in half.items():
                dim = 1 if rule.kind == "row" else 0
                assert torch.equal(t, sd[hf_name].chunk(2, dim=dim)[1]), hf_name
    assert seen == {k for k in sd if not (model.config.tie_word_embeddings and k == "lm_head.weight")}


def test_models_it_cannot_map_are_refused_with_the_key() -> None:
    from transformers import GPT2Config, LlamaConfig

    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="gpt2.*actor.backend=fsdp2"):
        GPTShape.from_hf(GPT2Config())
    with pytest.raises(ConfigError, match="rope_scaling"):
        GPTShape.from_hf(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ConfigError, match="actor.parallel.tp=3 must divide.*num_attention_heads=4"):
        GPTShape.from_hf(LlamaConfig(num_attention_heads=4, num_key_value_heads=2)).check_tp(3)


# -- the 2-rank jobs -------------------------------------------------------------------------------


def hf_critic():
    """A Qwen2 value model (HF's token classification, one output) with a trained-looking head."""
    from transformers import Qwen2ForTokenClassification

    config = hf_model("qwen2").config
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(1)
    model = Qwen2ForTokenClassification(config)
    with torch.no_grad():
        model.model.load_state_dict(hf_model("qwen2").model.state_dict())
        model.score.bias.fill_(0.25)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_models")
    for name in MODELS:
        hf_model(name).save_pretrained(root / name)
    hf_critic().save_pretrained(root / "critic")
    return root


def _job(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.train import init_distributed

    init_distributed()
    tp, pp = (int(x) for x in (out_dir / "layout").read_text().split())
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp, pp=pp), world_size)
    if pp > 1:
        return _pp_job(rank, layout, out_dir)
    return _tp_job(rank, layout, out_dir) if tp > 1 else _dp_job(rank, layout, out_dir)


def _pp_job(rank: int, layout, out_dir: Path) -> dict:
    """Pipeline stages (megatron's 1F1B): logits, full state dict, reshard, training steps."""
    res = {}
    for name, (_, vocab, _) in MODELS.items():
        engine = _engine(out_dir / "models" / name, layout)
        ids, mask = probe(vocab)
        with torch.no_grad():
            out = engine.forward([{"input_ids": ids, "attention_mask": mask}] * 2,
                                 lambda model, mb: model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits)
        res[f"{name}/logits"] = out[0] if out is not None else None
        res[f"{name}/sd"] = engine.full_state_dict(rank0_only=False)
        res[f"{name}/reshard"] = _reshards(engine, layout, rank)
        res[f"{name}/held"] = sum(t.numel() * 4 for t in engine.local_tensors().values())
        if name == "llama":
            res["llama/greedy"] = _greedy_from_reshard(engine, layout, rank)
        if name in ("qwen2", "llama_odd"):
            res[f"{name}/metrics"] = [engine.train_step(_rows_of(layout, rank, s, vocab, n=2), lm_loss)
                                      for s in range(STEPS)]
        if name == "qwen2":  # the streamed export: each stage writes its own files, rank 0 the index
            engine.save_checkpoint(out_dir / "pp_ckpt", extra={}, export_dtype=torch.float32)
            trained = engine.full_state_dict(rank0_only=True)
            if rank == 0:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(out_dir / "pp_ckpt" / "hf", dtype=torch.float32).state_dict()
                res["qwen2/export_equal"] = all(torch.equal(hf[k], v) for k, v in trained.items())
                res["qwen2/export_files"] = sorted(f.name for f in (out_dir / "pp_ckpt" / "hf").glob("*.safetensors"))
    return {**res, **_resume_elsewhere(rank, layout, out_dir)}


def _resume_elsewhere(rank: int, layout, out_dir: Path) -> dict:
    """The tp=2 job's step-2 checkpoint resumed in this layout, and the steps after it."""
    engine = _engine(out_dir / "models" / "qwen3", layout)
    extra = engine.load_checkpoint(Path((out_dir / "resume").read_text()))
    vocab = MODELS["qwen3"][1]
    return {"qwen3/extra": extra, "qwen3/resumed": [engine.train_step(_rows_of(layout, rank, s, vocab, n=2), lm_loss)
                                                    for s in range(SAVE_AT, STEPS)]}


def _engine(path: Path, layout, optim=OPTIM, value_head: bool = False):
    from asyncrl.train.megatron.engine import MegatronEngine

    return MegatronEngine(str(path), layout, optim=optim, device="cpu", dtype=torch.float32, seed=0,
                          value_head=value_head)


def _rows_of(layout, rank: int, step: int, vocab: int, n: int = 1) -> list:
    """This DP rank's rows of step `step` in `n` micro-batches, each with its share of the mean."""
    rows = step_rows(step, vocab).chunk(layout.dp_size)[layout.dp_rank(rank)]
    return [rows] if n == 1 else [_Scaled(mb, 1 / n) for mb in rows.chunk(n)]


class _Scaled(dict):
    """A micro-batch (input_ids) and the weight of its loss in the step's mean."""

    def __init__(self, ids: torch.Tensor, scale: float) -> None:
        super().__init__(input_ids=ids)
        self.scale = scale


def _tp_job(rank: int, layout, out_dir: Path) -> dict:
    res = {}
    models = out_dir / "models"
    for name, (_, vocab, _) in MODELS.items():
        engine = _engine(models / name, layout)
        ids, mask = probe(vocab)
        with torch.no_grad():
            res[f"{name}/logits"] = engine.model(input_ids=ids, attention_mask=mask).logits
            res[f"{name}/kept"] = engine.model(input_ids=ids, attention_mask=mask,
                                               logits_to_keep=torch.tensor([SEQ - 3, SEQ - 1])).logits
        res[f"{name}/sd"] = engine.full_state_dict(rank0_only=False)
        res[f"{name}/reshard"] = _reshards(engine, layout, rank)
        if name in ("qwen2", "llama_odd"):
            res[f"{name}/metrics"] = [engine.train_step(_rows_of(layout, rank, s, vocab), lm_loss) for s in range(STEPS)]
    # the critic: a value model's checkpoint (its head mapped) and a causal LM's (a fresh head)
    ids, mask = probe(64)
    for name in ("critic", "qwen2"):
        critic = _engine(models / name, layout, value_head=True)
        with torch.no_grad():
            res[f"values/{name}"] = critic.model(input_ids=ids, attention_mask=mask).logits
        res[f"values/{name}/step"] = critic.train_step([ids], lambda m, mb: (m(input_ids=mb).logits.square().mean(), {}))
    # resume: the steps after SAVE_AT equal the uninterrupted run's; the HF export holds the weights
    vocab = MODELS["qwen3"][1]
    engine = _engine(models / "qwen3", layout)
    res["qwen3/metrics"] = [engine.train_step(_rows_of(layout, rank, s, vocab), lm_loss) for s in range(SAVE_AT)]
    engine.save_checkpoint(out_dir / "ckpt", extra={"rank": rank})
    res["ckpt"] = str(out_dir / "ckpt")
    saved = engine.full_state_dict(rank0_only=False)
    res["qwen3/metrics"] += [engine.train_step(_rows_of(layout, rank, s, vocab), lm_loss) for s in range(SAVE_AT, STEPS)]
    fresh = _engine(models / "qwen3", layout)
    res["qwen3/extra"] = fresh.load_checkpoint(out_dir / "ckpt")
    res["qwen3/resumed"] = [fresh.train_step(_rows_of(layout, rank, s, vocab), lm_loss) for s in range(SAVE_AT, STEPS)]
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(out_dir / "ckpt" / "hf", dtype=torch.float32)
        res["qwen3/export_equal"] = all(torch.equal(hf.state_dict()[k], v) for k, v in saved.items())
    return res


def _reshards(engine, layout, rank: int) -> dict:
    """The generation weights at generation TP 1 and 2, with their bytes."""
    from asyncrl.single_controller.parallel import GenerationParallelConfig, generation_layout

    out = {}
    for tg in (1, 2):
        gen = generation_layout(layout, GenerationParallelConfig(tp=tg))
        resharder = engine.resharder(gen, None, torch.float32)
        shards = resharder.reshard()
        out[tg] = {"shards": {k: v.clone() for k, v in shards.items()}, "bytes": resharder.stats.bytes_received,
                   "expected": resharder.expected_bytes_received(), "dims": {p.name: p.tp_dim for p in resharder.plans},
                   "gen_rank": gen.coords(rank)["tp"]}
        resharder.release()
    return out


def _greedy_from_reshard(engine, layout, rank: int) -> dict:
    """Greedy responses of the native engine on the generation model bound to the reshard's
    output, at generation TP 1 and 2 (tensor parallel generation over the TP ranks)."""
    import torch.distributed as dist

    from asyncrl.rollout import RolloutEngine, SamplingParams
    from asyncrl.rollout.tp import GenerationModel
    from asyncrl.single_controller.parallel import GenerationParallelConfig, generation_layout

    ids, mask = probe(MODELS["llama"][1])
    out = {}
    for tg in (1, 2):
        gen = generation_layout(layout, GenerationParallelConfig(tp=tg))
        group = None
        for ranks in gen.groups(("tp",)):
            g = dist.new_group(sorted(ranks)) if len(ranks) > 1 else None
            group = g if rank in ranks else group
        model = GenerationModel(engine.hf_config, engine.generation_buffers(), group)
        model.bind(engine.resharder(gen, model.model, torch.float32).reshard())
        rollout = RolloutEngine(model.model, eos_token_id=-1, pad_token_id=0, device=engine.device)
        out[tg] = rollout.generate(ids, mask, SamplingParams(greedy=True, max_tokens=6))["responses"]
    return out


def _dp_job(rank: int, layout, out_dir: Path) -> dict:
    vocab = MODELS["qwen2"][1]
    engine = _engine(out_dir / "models" / "qwen2", layout)
    res = {"qwen2/metrics": [engine.train_step(_rows_of(layout, rank, s, vocab), lm_loss) for s in range(STEPS)]}
    return {**res, **_resume_elsewhere(rank, layout, out_dir)}


def _run(tmp_path: Path, checkpoints: Path, tp: int, pp: int = 1, resume: str = "") -> list[dict]:
    (tmp_path / "models").symlink_to(checkpoints)
    (tmp_path / "resume").write_text(resume)
    (tmp_path / "layout").write_text(f"{tp} {pp}")
    return run_ranks(_job, tp * pp if tp * pp > 1 else 2, tmp_path, timeout_s=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, checkpoints) -> list[dict]:
    return _run(tmp_path_factory.mktemp("tp2"), checkpoints, 2)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, checkpoints, tp2) -> list[dict]:
    return _run(tmp_path_factory.mktemp("dp2"), checkpoints, 1, resume=tp2[0]["ckpt"])


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory, checkpoints, tp2) -> list[dict]:
    return _run(tmp_path_factory.mktemp("tp2pp2"), checkpoints, 2, 2, resume=tp2[0]["ckpt"])


def reference_metrics(name: str, steps: int = STEPS) -> list[dict]:
    """Single-process HF + torch AdamW with the same clip and schedule: the losses and grad norms."""
    from asyncrl.train import lr_multiplier

    model = hf_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.0)
    out = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = OPTIM.lr * lr_multiplier(step, OPTIM)
        opt.zero_grad()
        loss, _ = lm_loss(model, step_rows(step, MODELS[name][1]))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        opt.step()
        out.append({"loss": loss.item(), "grad_norm": norm.item()})
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_equal_the_hf_model_at_tp2(tp2, name: str) -> None:
    """fp32 logits of the Megatron model (TP shards over 2 ranks, left-padded rows) equal HF's on
    every attended position, also when only some positions' logits are asked for."""
    vocab = MODELS[name][1]
    ids, mask = probe(vocab)
    with torch.no_grad():
        ref = hf_model(name)(input_ids=ids, attention_mask=mask).logits
    for res in tp2:
        got = res[f"{name}/logits"]
        assert got.shape == ref.shape
        assert float((got - ref)[mask.bool()].abs().max()) <= 1e-4
        assert torch.allclose(res[f"{name}/kept"], got[:, [SEQ - 3, SEQ - 1]], atol=1e-6)
        sd = hf_model(name).state_dict()
        assert all(torch.equal(res[f"{name}/sd"][k], sd[k]) for k in res[f"{name}/sd"])


@pytest.mark.parametrize("name", ["llama_odd", "qwen2"])
def test_training_steps_match_adamw_on_one_process(tp2, dp2, name: str) -> None:
    """STEPS optimizer steps (megatron's distributed optimizer, its grad clipping, asyncrl's LR
    schedule) give the losses and grad norms of HF + torch AdamW on one process: at tp=2 (a
    padded vocabulary for llama_odd, tied embeddings for qwen2) and, for qwen2, at dp=2."""
    ref = reference_metrics(name)
    runs = [tp2] + ([dp2] if name == "qwen2" else [])
    for run in runs:
        for res in run:
            got = res[f"{name}/metrics"]
            for g, r in zip(got, ref, strict=True):
                assert g["loss"] == pytest.approx(r["loss"], abs=2e-5)
                assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
            assert [g["lr"] for g in got] == pytest.approx([OPTIM.lr * m for m in (1.0, 1.0, 0.8535534, 0.5)], rel=1e-5)


def test_the_critic_is_the_body_with_a_replicated_value_head(tp2) -> None:
    """critic.backend=megatron at tp=2: a value model's checkpoint gives HF's values (its `score`
    head mapped); a causal LM's gets a fresh head, the same on both ranks; both train."""
    ids, mask = probe(64)
    with torch.no_grad():
        ref = hf_critic()(input_ids=ids, attention_mask=mask).logits
    for res in tp2:
        got = res["values/critic"]
        assert got.shape == ref.shape == (3, SEQ, 1)
        assert float((got - ref)[mask.bool()].abs().max()) <= 1e-4
        assert res["values/qwen2/step"]["grad_norm"] > 0 and res["values/critic/step"]["grad_norm"] > 0
    assert torch.equal(tp2[0]["values/qwen2"], tp2[1]["values/qwen2"])


def test_resume_continues_exactly_and_the_export_loads_in_transformers(tp2) -> None:
    for rank, res in enumerate(tp2):
        assert res["qwen3/extra"] == {"rank": rank}
        assert res["qwen3/resumed"] == res["qwen3/metrics"][SAVE_AT:]
    assert tp2[0]["qwen3/export_equal"]


def test_resume_in_another_layout_continues_the_run(tp2, dp2, tp2pp2) -> None:
    """The tp=2 checkpoint (masters and Adam moments in HF space) resumed at dp=2 and at tp=2 x pp=2:
    the steps after it give the uninterrupted run's losses and grad norms (to float rounding: the
    reductions differ), and every rank gets rank 0's `extra`."""
    want = tp2[0]["qwen3/metrics"][SAVE_AT:]
    for res in [*dp2, *tp2pp2]:
        assert res["qwen3/extra"] == {"rank": 0}
        for g, w in zip(res["qwen3/resumed"], want, strict=True):
            assert g["loss"] == pytest.approx(w["loss"], abs=2e-5)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
            assert g["lr"] == pytest.approx(w["lr"])


@pytest.mark.parametrize("name", ["llama", "llama_odd", "qwen2"])
def test_reshard_into_generation_tp_moves_table_2_bytes(tp2, name: str) -> None:
    """Generation TP 1: every rank gets the whole HF model; TP 2: each rank its HF slice (the
    split GenerationModel binds). Bytes received equal Table 2's (t - tg)/t of the TP-split
    weights, computed here from the HF tensors; a vocabulary padded for tp (llama_odd: 63 rows,
    64 over two ranks) is gathered whole, so each rank also gets its peer's 32 padded rows of
    the embedding and of the head, at either tg. The resharder's own count agrees."""
    sd = hf_model(name).state_dict()
    tied = MODELS[name][2]
    split_bytes = sum(v.numel() * 4 for k, v in sd.items() if "norm" not in k and not (tied and k == "lm_head.weight"))
    whole = 0  # bytes of the vocabulary tensors gathered whole (from the peer's padded shard)
    if name == "llama_odd":
        vocab = ("model.embed_tokens.weight", "lm_head.weight")
        rows = -(-sd[vocab[0]].shape[0] // 2)  # each rank's slice of the vocabulary padded to a multiple of 2
        whole = sum(rows * sd[k].shape[1] * 4 for k in vocab)
        split_bytes -= sum(sd[k].numel() * 4 for k in vocab)
    for res in tp2:
        one, two = res[f"{name}/reshard"][1], res[f"{name}/reshard"][2]
        assert all(torch.equal(one["shards"][k], sd[k]) for k in one["shards"])
        assert one["bytes"] == split_bytes // 2 + whole == one["expected"]
        assert two["bytes"] == whole == two["expected"]
        for k, t in two["shards"].items():
            dim = two["dims"][k]
            want = sd[k] if dim is None else sd[k].chunk(2, dim=dim)[two["gen_rank"]]
            assert torch.equal(t, want), k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_pipeline_stages_give_the_hf_logits_and_weights(tp2pp2, name: str) -> None:
    """tp=2 × pp=2 on 4 ranks (megatron's schedule over gloo): the last stage's logits equal HF's,
    and every rank's full state dict is the HF model's (stages gathered, a tied head once)."""
    vocab = MODELS[name][1]
    ids, mask = probe(vocab)
    sd = hf_model(name).state_dict()
    with torch.no_grad():
        ref = hf_model(name)(input_ids=ids, attention_mask=mask).logits
    lasts = [res[f"{name}/logits"] for res in tp2pp2 if res[f"{name}/logits"] is not None]
    assert len(lasts) == 2  # the two TP ranks of the last stage
    for got in lasts:
        assert float((got - ref)[mask.bool()].abs().max()) <= 1e-4
    for res in tp2pp2:
        assert set(res[f"{name}/sd"]) == {k for k in sd if not (MODELS[name][2] and k == "lm_head.weight")}
        assert all(torch.equal(v, sd[k]) for k, v in res[f"{name}/sd"].items())


@pytest.mark.parametrize("name", ["llama_odd", "qwen2"])
def test_pipeline_training_steps_match_adamw_on_one_process(tp2pp2, name: str) -> None:
    """The 1F1B schedule over 2 micro-batches at tp=2 × pp=2 (qwen2: the tied embedding and head on
    different stages, their gradients summed) trains as one process does."""
    ref = reference_metrics(name)
    for res in tp2pp2:
        for g, r in zip(res[f"{name}/metrics"], ref, strict=True):
            assert g["loss"] == pytest.approx(r["loss"], abs=2e-5)
            assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_reshard_from_pipeline_stages_moves_table_2_bytes(tp2pp2, name: str) -> None:
    """tp2 × pp2 into generation tp1: each rank receives the whole model less what it holds
    (Table 2: M - M/(t·p) with replicated norms counted where they are held); into tp2: its HF
    slice. Tensors equal the HF model's."""
    sd = hf_model(name).state_dict()
    total = sum(v.numel() * 4 for v in sd.values())
    for res in tp2pp2:
        one, two = res[f"{name}/reshard"][1], res[f"{name}/reshard"][2]
        assert set(one["shards"]) == set(sd)
        assert all(torch.equal(one["shards"][k], sd[k]) for k in sd)
        assert one["bytes"] == one["expected"] == total - res[f"{name}/held"]
        assert two["bytes"] == two["expected"]
        for k, t in two["shards"].items():
            dim = two["dims"][k]
            assert torch.equal(t, sd[k] if dim is None else sd[k].chunk(2, dim=dim)[two["gen_rank"]]), k


def test_a_megatron_actor_and_critic_must_share_a_layout() -> None:
    from asyncrl.config import rl_config
    from transport.checks import ConfigError

    base = {"algorithm": {"name": "ppo"}, "actor": {"backend": "megatron", "parallel": {"tp": 2}},
            "critic": {"backend": "megatron"}}
    with pytest.raises(ConfigError, match=r"critic.parallel.*must equal.*actor.parallel \(tp=2 pp=1\)"):
        rl_config(base).check("")
    rl_config({**base, "critic": {"backend": "fsdp2"}}).check("")


def test_megatron_missing_is_one_paragraph_with_the_install_line(monkeypatch) -> None:
    import sys

    from asyncrl.train.megatron import require_megatron
    from transport.checks import ConfigError

    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ConfigError, match=r"pip install 'asyncrl\[megatron\]'"):
        require_megatron()


def test_an_unknown_megatron_version_on_cpu_is_refused(monkeypatch) -> None:
    import megatron.core

    from asyncrl.train.megatron import cpu

    monkeypatch.setattr(cpu, "_adapted", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    monkeypatch.delenv(cpu.ANY_VERSION_ENV, raising=False)
    with pytest.raises(cpu.MegatronVersionError, match="0.99.0 on CPU ranks.*megatron-core==0.16.1"):
        cpu.adapt_for_cpu()


def test_greedy_generations_from_the_pipeline_reshard_equal_hf(tp2pp2) -> None:
    """The native engine on the generation weights resharded from tp2 × pp2 (generation TP 1 and 2)
    decodes greedily the tokens HF's `generate` does."""
    ids, mask = probe(MODELS["llama"][1])
    model = hf_model("llama")
    model.generation_config.eos_token_id = None  # the native engine above stops at no token either
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          pad_token_id=0)[:, ids.shape[1]:]
    for res in tp2pp2:
        for tg in (1, 2):
            assert torch.equal(res["llama/greedy"][tg], want), (tg, res["llama/greedy"][tg], want)


def test_the_export_from_pipeline_stages_loads_in_transformers(tp2pp2) -> None:
    """Each stage writes its own safetensors file and rank 0 the index: transformers loads the
    trained tied Qwen2 (embedding on stage 0, its copy on stage 1 not written twice)."""
    assert tp2pp2[0]["qwen2/export_equal"]
    assert tp2pp2[0]["qwen2/export_files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
