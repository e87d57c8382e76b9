"""The megatron-core backend against FSDP2 and Hugging Face (issue 44). Prints one JSON object last.

    python -m benchmarks.megatron          # CPU: 2 gloo ranks
    python -m benchmarks.megatron --gpu    # one CUDA GPU: bf16 logits, step time and MFU at 0.5B / 1.5B

CPU: `logits_max_abs_diff` (fp32, Llama / Qwen2 / Qwen3 shapes with GQA at (tp, pp) in (1, 1),
(2, 1), (1, 2), (2, 2), against the HF model), `roundtrip_exact` (HF -> Megatron -> HF), `reshard_bytes_ratio` (bytes each rank received
resharding tp2 into generation tp1, over HybridFlow Table 2's), `step_time_ratio` (a Megatron
training step over an FSDP2 one: same 2 ranks (tp=2), model and micro-batches).
GPU: the training step of a Qwen2.5-0.5B and a 1.5B shape (random weights) with each backend in
bf16, its model FLOP/s (6·N·tokens + attention) over the bf16 matmul rate measured in the same run,
its peak memory over `asyncrl.plan.memory`'s estimate (`peak_vs_estimate`: the Megatron runs' largest).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # Qwen2.5's (tied embeddings, qkv bias)
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}
VOCAB = 151936


def qwen2(shape: dict, vocab: int = VOCAB, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True, **shape)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype)


def rl_batch(rows: int, prompt: int, response: int, vocab: int, device: str):
    """A batch of the shape the RL update trains on: prompt + response columns, all attended."""
    from asyncrl.single_controller.batch import Batch

    ids = torch.randint(0, vocab, (rows, prompt + response), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    ones = torch.ones_like(ids)
    return Batch({"input_ids": ids, "attention_mask": ones, "position_ids": ones.cumsum(-1) - 1,
                  "responses": ids[:, prompt:], "response_mask": ones[:, prompt:]})


def nll(model, mb):
    from asyncrl.roles.forward import response_forward

    logp, _ = response_forward(model, mb)
    loss = -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum()
    return loss, {}


def step_seconds(engine, mbs, steps: int = 4) -> float:
    """Mean seconds of a training step after one warm-up step."""
    engine.train_step(mbs, nll)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.train_step(mbs, nll)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def fsdp_engine(path: Path, layout, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    from asyncrl.config import OptimConfig
    from asyncrl.train import FSDPEngine, mixed_precision_policy, parallelize

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model = parallelize(model, layout, mixed_precision_policy(device, dtype=dtype))
    return FSDPEngine(model, layout, optim=OptimConfig(lr=1e-5), device=device)


def megatron_engine(path: Path, layout, device: str, dtype: torch.dtype):
    from asyncrl.config import OptimConfig
    from asyncrl.train.megatron.engine import MegatronEngine

    return MegatronEngine(str(path), layout, optim=OptimConfig(lr=1e-5), device=device, dtype=dtype)


# -- GPU ------------------------------------------------------------------------------------------

def step_estimate(path: Path, backend: str, rows: int, prompt: int, response: int) -> float:
    """`asyncrl.plan.memory`'s bytes for this benchmark's training step on one bf16 GPU: the
    training state of the backend and one micro-batch's update pass (no reference, no rollout)."""
    from asyncrl.plan.memory import Knobs, megatron_state, training_state, update_pass
    from asyncrl.plan.workload import model_spec

    spec = model_spec(str(path))
    knobs = Knobs(compute_bytes=2.0, megatron=backend == "megatron")
    state = megatron_state(spec, 1, 1, 2.0) if knobs.megatron else training_state(spec, 1)
    return sum(state.values()) + sum(update_pass(spec, rows, prompt + response, response + 1, 1, knobs).values())


def matmul_tflops(device: str = "cuda", n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t0) / 1e12


def model_flops(shape: dict, params: int, rows: int, seq: int) -> float:
    """Training FLOPs of one step: 6·N per token plus causal attention's 6·L·hidden·seq per token."""
    tokens = rows * seq
    return 6 * params * tokens + 6 * shape["num_hidden_layers"] * shape["hidden_size"] * seq * tokens


def gpu_bench(tmp: Path) -> dict:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), 1)
    out: dict = {"device": torch.cuda.get_device_name(), "bf16_matmul_tflops": round(matmul_tflops(), 1)}
    out["logits_bf16"] = bf16_logits(tmp)
    rows, prompt, response = 8, 512, 512
    for name, shape in SHAPES.items():
        path = tmp / name
        hf = qwen2(shape, device="cuda")
        params = sum(p.numel() for p in hf.parameters())
        hf.save_pretrained(path)
        del hf
        torch.cuda.empty_cache()
        mbs = rl_batch(rows, prompt, response, VOCAB, "cuda").split(2)
        row = {"params": params}
        for backend in ("fsdp2", "megatron"):
            torch.cuda.reset_peak_memory_stats()
            engine = (fsdp_engine(path, layout, "cuda", "bfloat16") if backend == "fsdp2"
                      else megatron_engine(path, layout, "cuda", torch.bfloat16))
            seconds = step_seconds(engine, mbs)
            flops = model_flops(shape, params, rows, prompt + response) / seconds / 1e12
            peak = torch.cuda.max_memory_allocated() / 2**30
            estimate = step_estimate(path, backend, 2, prompt, response) / 2**30
            row[backend] = {"step_s": round(seconds, 3), "model_tflops": round(flops, 1),
                            "mfu": round(flops / out["bf16_matmul_tflops"], 3), "peak_gib": round(peak, 2),
                            "estimate_gib": round(estimate, 2), "peak_vs_estimate": round(peak / estimate, 3)}
            del engine
            torch.cuda.empty_cache()
        row["step_time_ratio"] = round(row["megatron"]["step_s"] / row["fsdp2"]["step_s"], 3)
        out[name] = row
    out["step_time_ratio"] = max(out[name]["step_time_ratio"] for name in SHAPES)
    out["peak_vs_estimate"] = max(out[name]["megatron"]["peak_vs_estimate"] for name in SHAPES)
    return out


def bf16_logits(tmp: Path) -> dict:
    """bf16 logits of the Megatron model against the HF model's, tiny Llama / Qwen2 / Qwen3 (max abs
    diff, and the same for HF's own bf16 against its fp32, the scale bf16 allows)."""
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train.megatron.engine import MegatronEngine
    from tests.rl.test_megatron import MODELS, hf_model, probe

    layout = ParallelLayout.from_config(ParallelConfig(), 1)
    out = {}
    for name in ("llama", "qwen2", "qwen3"):
        model = hf_model(name)
        model.save_pretrained(tmp / name)
        ids, mask = (t.cuda() for t in probe(MODELS[name][1]))
        engine = MegatronEngine(str(tmp / name), layout, optim=None, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ref = model.cuda()(input_ids=ids, attention_mask=mask).logits
            hf16 = model.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits.float()
            got = engine.model(input_ids=ids, attention_mask=mask).logits.float()
        keep = mask.bool()
        out[name] = {"megatron_vs_fp32": float((got - ref)[keep].abs().max()),
                     "hf_bf16_vs_fp32": float((hf16 - ref)[keep].abs().max())}
    return out


# -- CPU ------------------------------------------------------------------------------------------

def _logits_job(rank: int, world: int, out_dir: Path) -> dict:
    """fp32 logits of each architecture at this layout against HF's, and the weights' round trip."""
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from tests.rl.test_megatron import MODELS, hf_model, probe

    init_distributed()
    tp, pp = (int(x) for x in (out_dir / "layout").read_text().split())
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp, pp=pp), world)
    res: dict = {}
    for name in ("llama", "qwen2", "qwen3"):
        engine = megatron_engine(out_dir / name, layout, "cpu", torch.float32)
        ids, mask = probe(MODELS[name][1])
        with torch.no_grad():
            got = engine.forward([{"input_ids": ids, "attention_mask": mask}],
                                 lambda model, mb: model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits)
            ref = hf_model(name)(input_ids=ids, attention_mask=mask).logits
        if got is not None:
            res[f"{name}/tp{tp}pp{pp}"] = float((got[0] - ref)[mask.bool()].abs().max())
        sd = hf_model(name).state_dict()
        res[f"{name}/roundtrip"] = all(torch.equal(v, sd[k]) for k, v in engine.full_state_dict(False).items())
    return res


def _cpu_job(rank: int, world: int, out_dir: Path) -> dict:
    """At tp = 2 on 2 ranks: the reshard's bytes into generation tp 1, and step times of both backends."""
    from asyncrl.single_controller.parallel import (
        GenerationParallelConfig,
        ParallelConfig,
        ParallelLayout,
        generation_layout,
    )
    from asyncrl.train import init_distributed

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(tp=2), world)
    path, res = out_dir / "step", {}
    engine = megatron_engine(path, layout, "cpu", torch.float32)
    resharder = engine.resharder(generation_layout(layout, GenerationParallelConfig(tp=1)), None, torch.float32)
    resharder.reshard()
    split = sum(t.numel() for n, t in engine.local_tensors().items() if "norm" not in n) * 4  # this rank's shards
    res["reshard_bytes"], res["table2_bytes"] = resharder.stats.bytes_received, split * (2 - 1)  # (t - tg)/tg · M/t
    mbs = rl_batch(8, 64, 64, 2048, "cpu").split(2)
    res["megatron_step_s"] = step_seconds(engine, mbs, steps=3)
    res["fsdp2_step_s"] = step_seconds(fsdp_engine(path, layout, "cpu", "float32"), mbs, steps=3)
    return res


def cpu_bench(tmp: Path) -> dict:
    from tests.helpers.gloo_ranks import run_ranks
    from tests.rl.test_megatron import hf_model

    for name in ("llama", "qwen2", "qwen3"):
        hf_model(name).save_pretrained(tmp / name)
    qwen2({"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2}, vocab=2048, dtype=torch.float32).save_pretrained(tmp / "step")
    diffs, roundtrip = {}, True
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        (tmp / "layout").write_text(f"{tp} {pp}")
        for r in run_ranks(_logits_job, tp * pp, tmp, timeout_s=600):
            roundtrip &= all(v for k, v in r.items() if k.endswith("/roundtrip"))
            for k, v in r.items():
                if not k.endswith("/roundtrip"):
                    diffs[k] = max(diffs.get(k, 0.0), v)
    ranks = run_ranks(_cpu_job, 2, tmp, timeout_s=600)
    r0 = ranks[0]
    return {"logits_max_abs_diff": max(diffs.values()), "logits_by_layout": diffs, "roundtrip_exact": roundtrip,
            "reshard_bytes_ratio": round(r0["reshard_bytes"] / r0["table2_bytes"], 4),
            "step_time_ratio": round(max(r["megatron_step_s"] for r in ranks) / max(r["fsdp2_step_s"] for r in ranks), 3),
            "megatron_step_s": round(r0["megatron_step_s"], 3), "fsdp2_step_s": round(r0["fsdp2_step_s"], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="one CUDA GPU: bf16 logits, step time and MFU")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asyncrl-megatron-") as tmp:
        out = gpu_bench(Path(tmp)) if args.gpu else cpu_bench(Path(tmp))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
