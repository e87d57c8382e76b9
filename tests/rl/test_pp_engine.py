"""Pipeline-parallel training (`asyncrl.train.pipeline`) on CPU ranks (gloo) against a plain
single-process model and AdamW.

One 2-rank job runs pp=2 (dp=1), one 4-rank job pp=2 x dp=2 and then pp=2 x tp=2; each writes its results to disk
and the tests compare them with a plain reference computed in-process. The batches are RL-shaped:
left-padded prompts and right-padded responses with `attention_mask` and `position_ids`, split
into micro-batches of unequal rows, with the prompt length (and so the sequence length) changing
from step to step; the loss is a masked token-mean policy-gradient loss through the workers'
own `response_forward`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from asyncrl.roles.forward import response_forward
from asyncrl.train import EngineError, OptimConfig, lr_multiplier, split_stages, untie_embeddings
from tests.helpers.gloo_ranks import run_ranks

VOCAB, ROWS, RESPONSE, N_MICRO, STEPS, SAVE_AT = 64, 8, 4, 3, 4, 2
# a small clip so every step is clipped: the global norm must span all stages
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, warmup_steps=2, total_steps=6)
JOB_TIMEOUT_S = 100


def tiny_lm(seed: int = 0, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def rl_batch(step: int) -> dict[str, torch.Tensor]:
    """ROWS rows of left-padded prompts (length varies with the step) and right-padded responses."""
    g = torch.Generator().manual_seed(100 + step)
    prompt = 5 + step % 3
    ids = torch.randint(0, VOCAB, (ROWS, prompt + RESPONSE), generator=g)
    prompt_len = torch.randint(2, prompt + 1, (ROWS,), generator=g)
    response_len = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    cols = torch.arange(prompt + RESPONSE)
    mask = ((cols >= prompt - prompt_len[:, None]) & (cols < prompt + response_len[:, None])).long()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
            "advantages": torch.randn(ROWS, generator=g)}


def micro_batches(step: int, dp_rank: int = 0, dp_size: int = 1) -> list[dict]:
    """This dp rank's N_MICRO micro-batches (unequal rows), scaled so that the summed losses,
    averaged over dp ranks, are the token mean over the whole step's batch."""
    batch = rl_batch(step)
    tokens = batch["response_mask"].sum().item()
    rows = torch.arange(ROWS).tensor_split(dp_size)[dp_rank]
    return [{**{k: v[idx] for k, v in batch.items()}, "scale": dp_size / tokens}
            for idx in rows.tensor_split(N_MICRO)]


LOSS_CALLS: list[int] = []  # per process: how often pg_loss ran since the last reset


def pg_loss(model, mb):
    LOSS_CALLS.append(1)
    logp, _ = response_forward(model, mb)
    assert torch.isfinite(logp).all()
    mask = mb["response_mask"].float()
    pg = -(mb["advantages"][:, None] * logp * mask).sum()
    return pg * mb["scale"], {"pg_token_mean": pg.detach() / mask.sum()}


def log_probs(model, mb):
    return response_forward(model, mb)[0]


def logits_of(model, mb):
    return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                 position_ids=mb["position_ids"]).logits


# -- the multi-rank jobs ------------------------------------------------------------------------


def build_engine(layout, seed: int = 0, optim: OptimConfig | None = OPTIM):
    from asyncrl.train import PipelineEngine, parallelize

    return PipelineEngine(parallelize(tiny_lm(seed), layout), layout, optim=optim, device="cpu")


def _job(rank: int, world_size: int, out_dir: Path, tp: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import FSDPEngine, init_distributed

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(pp=2, tp=tp), world_size)
    dp_rank, dp_size = layout.dp_rank(rank), layout.dp_size
    res: dict = {"layout": layout.describe(), "pp_rank": layout.coord(rank, "pp"),
                 "tp_rank": layout.coord(rank, "tp")}
    with pytest.raises(EngineError, match="PipelineEngine"):
        FSDPEngine(tiny_lm(), layout, optim=OPTIM, device="cpu")

    engine = build_engine(layout)
    res["names"] = sorted(n for n, _ in engine.model.named_parameters())
    probe = micro_batches(STEPS, dp_rank, dp_size)
    res["logp"] = engine.forward(probe, log_probs)
    res["logp_one_micro"] = engine.forward([rl_batch(STEPS)], log_probs)  # 1 micro-batch: GPipe
    metrics, calls = [], []
    for s in range(SAVE_AT):
        LOSS_CALLS.clear()
        metrics.append(engine.train_step(micro_batches(s, dp_rank, dp_size), pg_loss))
        calls.append(len(LOSS_CALLS))
    engine.save_checkpoint(out_dir / "ckpt", extra={"rank": rank})
    res["saved_logits"] = engine.forward([rl_batch(STEPS)], logits_of)
    for s in range(SAVE_AT, STEPS):
        LOSS_CALLS.clear()
        metrics.append(engine.train_step(micro_batches(s, dp_rank, dp_size), pg_loss))
        calls.append(len(LOSS_CALLS))
    res["metrics"], res["loss_calls"] = metrics, calls
    res["sd"] = engine.full_state_dict()
    res["sd_everywhere"] = engine.full_state_dict(rank0_only=False)
    del engine

    resumed = build_engine(layout, seed=99)
    res["extra"] = resumed.load_checkpoint(out_dir / "ckpt")
    res["resumed_metrics"] = [resumed.train_step(micro_batches(s, dp_rank, dp_size), pg_loss)
                              for s in range(SAVE_AT, STEPS)]
    res["resumed_sd"] = resumed.full_state_dict()
    # an inference engine (the reference policy) loading a full state dict from rank 0
    reference = build_engine(layout, seed=99, optim=None)
    reference.load_full_state_dict(res["sd"] if rank == 0 else {}, broadcast_from_rank0=True)
    res["broadcast_logp"] = reference.forward(probe, log_probs)
    del resumed, reference
    if world_size == 2 and tp == 1:  # the pp=2 checkpoint resumes without a pipeline, at dp=2
        from asyncrl.train import parallelize

        dp2 = ParallelLayout.from_config(ParallelConfig(), world_size)
        plain = FSDPEngine(parallelize(tiny_lm(seed=99), dp2), dp2, optim=OPTIM, device="cpu")
        plain.load_checkpoint(out_dir / "ckpt")
        res["dp2_metrics"] = [plain.train_step(micro_batches(s, dp2.dp_rank(rank), 2), pg_loss)
                              for s in range(SAVE_AT, STEPS)]
        res["dp2_sd"] = plain.full_state_dict()
        del plain

    if rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(out_dir / "ckpt" / "hf")
        with torch.no_grad():
            res["hf_logits"] = logits_of(hf, rl_batch(STEPS))
    return res


def _four_ranks(rank: int, world_size: int, out_dir: Path) -> dict:
    return {tp: _job(rank, world_size, out_dir / f"tp{tp}", tp=tp) for tp in (1, 2)}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    return run_ranks(_job, 2, tmp_path_factory.mktemp("pp2"), timeout_s=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def jobs4(tmp_path_factory) -> list[dict]:
    return run_ranks(_four_ranks, 4, tmp_path_factory.mktemp("pp2x2"), timeout_s=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def job4(jobs4) -> list[dict]:
    return [r[1] for r in jobs4]


@pytest.fixture(scope="module")
def job_tp(jobs4) -> list[dict]:
    return [r[2] for r in jobs4]


@pytest.fixture(params=["pp2", "pp2dp2", "pp2tp2"])
def results(request) -> list[dict]:
    """One layout's per-rank results."""
    return request.getfixturevalue({"pp2": "job", "pp2dp2": "job4", "pp2tp2": "job_tp"}[request.param])


# -- the plain reference ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict:
    """Plain AdamW, clipping and lr schedule over the same STEPS batches on one process."""
    torch.set_num_threads(1)
    model = tiny_lm()
    with torch.no_grad():
        out = {"logp": log_probs(model, rl_batch(STEPS))}
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, OPTIM))
    out.update(losses=[], norms=[], lrs=[])
    for s in range(STEPS):
        total = 0.0
        for mb in micro_batches(s):
            loss, _ = pg_loss(model, mb)
            loss.backward()
            total += loss.item()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)))
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["losses"].append(total)
        opt.step()
        sched.step()
        opt.zero_grad()
        if s == SAVE_AT - 1:
            with torch.no_grad():
                out["saved_logits"] = logits_of(model, rl_batch(STEPS))
    out["sd"] = model.state_dict()
    return out


def assert_sd_close(got: dict, want: dict, atol: float = 2e-5) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def param_atol(results: list[dict]) -> float:
    """How far trained weights (and their logits) may be from the plain model's: TP's split
    matmuls sum in another order, and after AdamW (which divides tiny gradients by their own
    scale) a few elements move by ~3e-5."""
    return 6e-5 if results[0]["layout"].endswith("tp=2") else 2e-5


def last_stage_logp(results: list[dict], key: str) -> torch.Tensor:
    """The log-probs of the whole probe batch, from each dp rank's last stage, in row order (the
    ranks are in dp order); the ranks of a TP group agree."""
    for r in results:
        if r["pp_rank"] == 0:
            assert r[key] is None
        else:
            lead = next(q for q in results if q["pp_rank"] == 1 and q["tp_rank"] == 0)
            if lead["layout"].endswith("tp=2"):
                torch.testing.assert_close(torch.cat(r[key]), torch.cat(lead[key]))
    return torch.cat([torch.cat(r[key]) for r in results if r["pp_rank"] == 1 and r["tp_rank"] == 0])


# -- tests --------------------------------------------------------------------------------------


def test_stages_keep_the_full_model_names(job):
    full = sorted(n for n, _ in tiny_lm().named_parameters())
    first, last = job[0]["names"], job[1]["names"]
    assert not set(first) & set(last) and sorted(first + last) == full
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    assert "model.layers.1.mlp.up_proj.weight" in first and "model.layers.2.mlp.up_proj.weight" in last


def test_log_probs_with_padding_match_the_plain_model(results, reference):
    torch.testing.assert_close(last_stage_logp(results, "logp"), reference["logp"], atol=1e-5, rtol=1e-5)
    one = [r for r in results if r["pp_rank"] == 1][0]["logp_one_micro"][0]
    torch.testing.assert_close(one, reference["logp"], atol=1e-5, rtol=1e-5)


def test_training_matches_plain_adamw(results, reference):
    assert results[0]["layout"] in ("pp=2 x dp=1 x tp=1", "pp=2 x dp=2 x tp=1", "pp=2 x dp=1 x tp=2")
    for r in results:  # every rank reports the same metrics
        assert r["metrics"] == results[0]["metrics"]
    metrics = results[0]["metrics"]
    assert [m["loss"] for m in metrics] == pytest.approx(reference["losses"], abs=1e-6)
    assert [m["grad_norm"] for m in metrics] == pytest.approx(reference["norms"], rel=1e-5)
    assert [m["lr"] for m in metrics] == pytest.approx(reference["lrs"])
    assert all(m["skipped"] == 0.0 and "pg_token_mean" in m for m in metrics)
    atol = param_atol(results)
    assert_sd_close(results[0]["sd"], reference["sd"], atol)
    for r in results[1:]:
        assert r["sd"] == {}
    for r in results:
        assert_sd_close(r["sd_everywhere"], reference["sd"], atol)


def test_checkpoint_resumes_identically(results):
    for rank, r in enumerate(results):
        assert r["extra"] == {"rank": rank}
        assert r["resumed_metrics"] == r["metrics"][SAVE_AT:]
    assert_sd_close(results[0]["resumed_sd"], results[0]["sd"], atol=0)


def test_hf_export_loads_in_transformers(results, reference):
    hf = results[0]["hf_logits"]
    torch.testing.assert_close(hf, reference["saved_logits"], atol=param_atol(results), rtol=1e-5)
    for r in results:
        if r["pp_rank"] == 1:  # the engine's own logits when it saved
            torch.testing.assert_close(r["saved_logits"][0], hf, atol=1e-5, rtol=1e-5)


def test_full_state_dict_loads_into_every_stage(results, reference):
    model = tiny_lm(seed=99)
    model.load_state_dict(reference["sd"])
    with torch.no_grad():
        want = log_probs(model, rl_batch(STEPS))
    torch.testing.assert_close(last_stage_logp(results, "broadcast_logp"), want, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_are_refused_until_untied():
    with pytest.raises(EngineError, match="untie_embeddings"):
        split_stages(tiny_lm(tied=True), 0, 2)
    model = untie_embeddings(tiny_lm(tied=True))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight)
    stages = [split_stages(copy.deepcopy(model), r, 2) for r in range(2)]
    mb = rl_batch(0)
    with torch.no_grad():
        hidden = stages[0](mb["input_ids"], mb["attention_mask"], mb["position_ids"])
        torch.testing.assert_close(stages[1](hidden, mb["attention_mask"], mb["position_ids"]),
                                   logits_of(model, mb), atol=1e-6, rtol=1e-6)
    with pytest.raises(EngineError, match="decoder layers"):
        split_stages(tiny_lm(), 0, 5)


def test_the_loss_sees_only_real_logits(results):
    for r in results:
        if r["pp_rank"] == 1:
            assert r["loss_calls"] == [N_MICRO] * STEPS


def test_pipeline_checkpoint_resumes_without_a_pipeline(job, reference):
    metrics = job[0]["dp2_metrics"]
    assert [m["loss"] for m in metrics] == pytest.approx(reference["losses"][SAVE_AT:], abs=1e-6)
    assert [m["grad_norm"] for m in metrics] == pytest.approx(reference["norms"][SAVE_AT:], rel=1e-5)
    assert_sd_close(job[0]["dp2_sd"], reference["sd"])
