"""FSDP2 FSDPEngine on 2 CPU ranks (gloo) against plain single-process AdamW.

One 2-rank job (spawned once per module) runs every distributed scenario and writes its
results to disk; the tests below compare them with a plain reference computed in-process.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asyncrl.train import OptimConfig, lr_multiplier
from tests.helpers.gloo_ranks import run_ranks

VOCAB, ROWS, SEQ, STEPS = 64, 8, 9, 3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0, warmup_steps=2, total_steps=6)
JOB_TIMEOUT_S = 100


def tiny_model(seed: int, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def step_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def split(rows: torch.Tensor, n_micro: int) -> list[tuple[torch.Tensor, float]]:
    """Micro-batches with the scale that makes their summed losses the mean over `rows`."""
    return [(mb, len(mb) / len(rows)) for mb in rows.chunk(n_micro)]


def rank_rows(rows: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return rows.chunk(world_size)[rank]


def loss_fn(model, micro_batch):
    ids, scale = micro_batch
    logits = model(input_ids=ids).logits.float()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return ce * scale, {"ce": ce.detach()}


def build_engine(model, optim, layout, unit: str = "auto", accumulate: bool | None = None):
    """apply_fsdp over the layout's dp sub-mesh, then the engine (as an RL worker does)."""
    from asyncrl.train import FSDPEngine, apply_fsdp

    return FSDPEngine(apply_fsdp(model, layout.submesh("dp"), unit=unit), layout, optim=optim, device="cpu",
                      accumulate_unsharded=accumulate)


def nan_loss_fn(model, micro_batch):
    loss, metrics = loss_fn(model, micro_batch)
    return loss * float("nan"), metrics


# -- the 2-rank job ---------------------------------------------------------------------------


def _job(rank: int, world_size: int, out_dir: Path) -> dict:
    return (_scenarios if world_size > 1 else _single_process)(rank, world_size, out_dir)


def _scenarios(rank: int, world_size: int, out_dir: Path) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed, rng_state, set_rng_state
    from asyncrl.train.fsdp import one_unit

    init_distributed()
    init_distributed()  # idempotent
    assert dist.get_backend() == "gloo" and dist.get_world_size() == world_size
    layout = ParallelLayout.from_config(ParallelConfig(), world_size)
    res: dict = {"dp_mesh": (layout.submesh("dp").mesh_dim_names, layout.submesh("dp").size())}

    def rank_micro(step: int, n_micro: int):
        return split(rank_rows(step_batch(step), rank, world_size), n_micro)

    # (a) 2 micro-batches per rank; (b) 1 micro-batch per rank.
    a = build_engine(tiny_model(0), OPTIM, layout)
    res["a_metrics"] = [a.train_step(rank_micro(s, 2), loss_fn) for s in range(STEPS)]
    res["a_sd"] = a.full_state_dict()
    # (a') the same with a unit per decoder block (what models above ONE_UNIT_MAX_BYTES get):
    # accumulated unsharded (memory allows it here), and reduced after every micro-batch
    blocks = build_engine(tiny_model(0), OPTIM, layout, unit="block")
    res["block_accumulates"] = blocks._accumulates_unsharded()
    res["block_metrics"] = [blocks.train_step(rank_micro(s, 2), loss_fn) for s in range(STEPS)]
    res["block_sd"] = blocks.full_state_dict()
    res["one_unit"] = [one_unit(e.model) for e in (a, blocks)]
    del blocks
    reduced = build_engine(tiny_model(0), OPTIM, layout, unit="block", accumulate=False)
    res["reduced_metrics"] = [reduced.train_step(rank_micro(s, 2), loss_fn) for s in range(STEPS)]
    res["reduced_sd"] = reduced.full_state_dict()
    del reduced
    b = build_engine(tiny_model(0), OPTIM, layout)
    for s in range(STEPS):
        b.train_step(rank_micro(s, 1), loss_fn)
    res["b_sd"] = b.full_state_dict()
    everywhere = b.full_state_dict(rank0_only=False)
    res["all_ranks_sd_keys"] = len(everywhere)
    del b, everywhere

    # (d) checkpoint, then continue vs a fresh engine that resumes. The next batch is drawn
    # from the global torch RNG, so matching also proves the RNG state round-trips.
    def noisy_step():
        return [(torch.randint(0, VOCAB, (ROWS // world_size, SEQ)), 1.0)]

    ckpt = out_dir / "ckpt"
    torch.manual_seed(1234 + rank)
    tok = tiny_tokenizer() if rank == 0 else None
    # asynchronous: the sharded state is written in the background while the next step trains
    # (and changes it); the checkpoint must hold the state as it was at the save
    a.save_checkpoint(ckpt, extra={"step": STEPS, "rng": rng_state()}, tokenizer=tok, asynchronous=True)
    probe = step_batch(99)
    with torch.no_grad():
        res["fsdp_logits"] = a.model(input_ids=probe).logits
    res["cont_metrics"] = a.train_step(noisy_step(), loss_fn)
    res["cont_sd"] = a.full_state_dict()
    res["async_waited"] = a.finish_checkpoint() >= 0 and a.finish_checkpoint() == 0.0  # a second wait is free
    del a
    d = build_engine(tiny_model(99), OPTIM, layout)
    extra = d.load_checkpoint(ckpt)
    set_rng_state(extra["rng"])
    res["resumed_extra_step"] = extra["step"]
    res["resumed_metrics"] = d.train_step(noisy_step(), loss_fn)
    res["resumed_sd"] = d.full_state_dict()
    del d

    # (c) clipping: after one AdamW step exp_avg = (1 - beta1) * clipped grad.
    max_norm = 1e-3
    c = build_engine(tiny_model(0), OptimConfig(lr=1e-2, grad_clip=max_norm), layout)
    res["clip_metrics"] = c.train_step(rank_micro(0, 2), loss_fn)
    exp_avg = [st["exp_avg"].full_tensor() for st in c.optimizer.state.values()]
    res["clipped_grad_norm"] = float(torch.stack([t.norm() for t in exp_avg]).norm()) / 0.1
    before = c.full_state_dict()
    res["skip_metrics"] = c.train_step(rank_micro(1, 2), nan_loss_fn)
    after = c.full_state_dict()
    res["skip_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    res["skip_sched_steps"] = c.scheduler.last_epoch
    del c

    # Tied embeddings train and export too.
    t = build_engine(tiny_model(0, tied=True), OPTIM, layout)
    t.train_step(rank_micro(0, 1), loss_fn)
    t.save_checkpoint(out_dir / "tied")
    with torch.no_grad():
        res["tied_fsdp_logits"] = t.model(input_ids=probe).logits
    del t

    # Inference-only engine (reference model) loads a full state dict broadcast from rank 0.
    ref = build_engine(tiny_model(7), None, layout)
    ref.load_full_state_dict(res["a_sd"] if rank == 0 else {}, broadcast_from_rank0=True)
    with torch.no_grad():
        res["ref_logits"] = ref.model(input_ids=probe).logits
    res["ref_requires_grad"] = any(p.requires_grad for p in ref.model.parameters())
    del ref

    if rank == 0:  # from_pretrained may consume RNG: keep it after the resume check
        hf = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
        tied = AutoModelForCausalLM.from_pretrained(out_dir / "tied" / "hf")
        with torch.no_grad():
            res["hf_logits"] = hf(input_ids=probe).logits
            res["tied_hf_logits"] = tied(input_ids=probe).logits
        res["tied_shares"] = tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
        res["tok_ids"] = AutoTokenizer.from_pretrained(ckpt / "hf")("t1 t5")["input_ids"]
    return res


def _single_process(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), world_size)
    engine = build_engine(tiny_model(0), OPTIM, layout)
    metrics = [engine.train_step(split(step_batch(s), 2), loss_fn) for s in range(STEPS)]
    tied = build_engine(tiny_model(0, tied=True), OPTIM, layout, unit="block")
    for s in range(STEPS):
        tied.train_step(split(step_batch(s), 2), loss_fn)
    return {"metrics": metrics, "sd": engine.full_state_dict(), "tied_sd": tied.full_state_dict(),
            "tied_sparse": tied.model.get_input_embeddings().sparse}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    return run_ranks(_job, 2, tmp_path_factory.mktemp("fsdp"), JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference() -> dict:
    return plain_adamw(tied=False)


def plain_adamw(tied: bool) -> dict:
    """Plain AdamW on the full batch, 2 micro-batches of half the rows each."""
    torch.set_num_threads(1)
    model = tiny_model(0, tied=tied)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, OPTIM))
    losses, norms, lrs = [], [], []
    for s in range(STEPS):
        total = 0.0
        for mb in split(step_batch(s), 2):
            loss, _ = loss_fn(model, mb)
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "lrs": lrs, "sd": model.state_dict()}


def assert_sd_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=k)


# -- tests ------------------------------------------------------------------------------------


def test_two_rank_fsdp_matches_plain_adamw(job, reference):
    r0, r1 = job
    for rank_metrics in (r0["a_metrics"], r1["a_metrics"]):
        assert [m["loss"] for m in rank_metrics] == pytest.approx(reference["losses"], abs=1e-5)
        assert [m["grad_norm"] for m in rank_metrics] == pytest.approx(reference["norms"], rel=1e-4)
        assert [m["lr"] for m in rank_metrics] == pytest.approx(reference["lrs"])
    assert reference["norms"][0] > OPTIM.grad_clip  # clipping was active in this comparison
    assert_sd_close(r0["a_sd"], reference["sd"])
    assert r1["a_sd"] == {}  # rank0_only by default
    assert r1["all_ranks_sd_keys"] == len(reference["sd"])


def test_fsdp_per_block_units_match_plain_adamw(job, reference):
    """The tiny model is one FSDP unit by default (accumulated unsharded); per block it gives
    the same training, accumulated unsharded (the spare memory allows it, both ranks agree) or
    reduced after every micro-batch."""
    r0, r1 = job
    assert r0["one_unit"] == r1["one_unit"] == [True, False]
    assert r0["block_accumulates"] is r1["block_accumulates"] is True
    for rank_metrics in (r0["block_metrics"], r1["block_metrics"], r0["reduced_metrics"], r1["reduced_metrics"]):
        assert [m["loss"] for m in rank_metrics] == pytest.approx(reference["losses"], abs=1e-5)
        assert [m["grad_norm"] for m in rank_metrics] == pytest.approx(reference["norms"], rel=1e-4)
    assert_sd_close(r0["block_sd"], reference["sd"])
    assert_sd_close(r0["reduced_sd"], reference["sd"])


def test_single_process_engine_matches_plain_adamw(tmp_path, reference):
    """One rank; also a tied model in per-block units, whose input embedding hands autograd a
    sparse gradient on CPU (`sparse_tied_embedding`): it trains as plain AdamW's dense one."""
    (r0,) = run_ranks(_job, 1, tmp_path, JOB_TIMEOUT_S)
    assert r0["tied_sparse"] is True
    want = plain_adamw(tied=True)["sd"]
    assert_sd_close(r0["tied_sd"], {k: v for k, v in want.items() if k in r0["tied_sd"]})
    assert "model.embed_tokens.weight" in r0["tied_sd"]
    assert [m["loss"] for m in r0["metrics"]] == pytest.approx(reference["losses"], abs=1e-6)
    assert_sd_close(r0["sd"], reference["sd"])


def test_engine_runs_on_the_layouts_dp_mesh(job):
    for r in job:
        assert r["dp_mesh"] == (("dp",), 2)


def test_metrics_averaged_over_micro_batches_and_ranks(job):
    r0, r1 = job
    for m0, m1 in zip(r0["a_metrics"], r1["a_metrics"], strict=True):
        assert m0 == m1
        # Every micro-batch has the same row count, so the mean ce equals the scaled loss sum.
        assert m0["ce"] == pytest.approx(m0["loss"], rel=1e-5)
        assert m0["skipped"] == 0.0


def test_grad_accumulation_equals_one_big_batch(job):
    assert_sd_close(job[0]["a_sd"], job[0]["b_sd"])


def test_grad_clipping_limits_norm(job):
    r0 = job[0]
    assert r0["clip_metrics"]["grad_norm"] > 100 * 1e-3
    assert r0["clipped_grad_norm"] == pytest.approx(1e-3, rel=1e-3)


def test_non_finite_grad_norm_skips_step(job):
    for r in job:
        assert r["skip_metrics"]["skipped"] == 1.0
        assert not math.isfinite(r["skip_metrics"]["grad_norm"])
        assert r["skip_sched_steps"] == 1  # the lr schedule did not advance either
    assert job[0]["skip_unchanged"]


def test_checkpoint_resume_matches_continuing(job):
    """Saved asynchronously, training on while the state is written: resuming matches continuing."""
    for r in job:
        assert r["async_waited"]
        assert r["resumed_extra_step"] == STEPS
        assert r["resumed_metrics"] == r["cont_metrics"]
    assert_sd_close(job[0]["resumed_sd"], job[0]["cont_sd"], atol=0)


def test_hf_export_loads_with_same_logits(job):
    r0 = job[0]
    torch.testing.assert_close(r0["hf_logits"], r0["fsdp_logits"], atol=1e-5, rtol=1e-5)
    assert r0["tok_ids"] == [1, 5]


def test_tied_embeddings_export(job):
    r0 = job[0]
    assert r0["tied_shares"]
    torch.testing.assert_close(r0["tied_hf_logits"], r0["tied_fsdp_logits"], atol=1e-5, rtol=1e-5)


def test_inference_engine_loads_broadcast_state_dict(job):
    for r in job:
        assert not r["ref_requires_grad"]
        torch.testing.assert_close(r["ref_logits"], job[0]["fsdp_logits"], atol=1e-5, rtol=1e-5)


def test_the_fsdp_engines_implement_the_train_engine_interface():
    """The roles hold a `TrainEngine`; both FSDP2 engines have every member it names, with the
    same parameters (a second backend is held to the same)."""
    import inspect

    from asyncrl.train import FSDPEngine, PipelineEngine, TrainEngine

    members = [n for n in vars(TrainEngine) if not n.startswith("_") and callable(getattr(TrainEngine, n))]
    assert len(members) >= 8
    for cls in (FSDPEngine, PipelineEngine):
        for name in members:
            want = list(inspect.signature(getattr(TrainEngine, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
