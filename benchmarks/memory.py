"""Peak memory per rank of a colocated GRPO run on a real model's shape, against the estimate
(`asyncrl.plan.memory`) and the analytic floor, on 4 and on 2 gloo CPU ranks.

    python -m benchmarks.memory                    # 4 ranks, then 2 (about 15 minutes on 2 cores)
    python -m benchmarks.memory --worlds 2 --steps 1
    python -m benchmarks.memory --worlds 1 --steps 1 --engine vllm   # on one GPU (tests/rl/test_memory_gpu.py)
    python -m benchmarks.memory --model moe --worlds 2 --steps 1      # a mixture of experts (~0.5B, 32 experts)
    python -m benchmarks.memory --model moe --worlds 2 --steps 1 --rollout-ep 2   # its experts split in generation

The model is built here with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings) and random bf16 weights, saved as a
Hugging Face directory (`outputs/bench-memory/model`, reused), with the quickstart's small
word-level tokenizer (the embedding rows are still all allocated). Each run is the real trainer
as `asyncrl-launch --config-name grpo` runs it: generation of 128-token responses by the native
engine, old and reference log-probs, the update, the final checkpoint and HF export, a held-out
set of 256 prompts evaluated at the first and the last step (`rollout.decode_slots=16` of its rows
decoded at once; a batch has 2 a rank), with what a
real model trains with: `model.dtype=bfloat16` and `actor.gradient_checkpointing=true` (flags
turn them off; in fp32 without checkpointing 4 ranks need more than this 24 GiB machine has).

Per rank: `peak` = the worker process's peak resident memory (VmHWM), `estimate` = the
preflight's estimate of its peak (rank 0 also writes the export), `floor` = what the rank must
hold at the generation phase with nothing else: fp32 master + Adam + gradient shards, the
reference shard and the full generation weights in the compute dtype (the process's own ~0.75 GiB
aside). The training state's share (master, grads, Adam) halves from 2 ranks to 4. Each phase's
peak (the largest rank's, `Worker.memory_stats()["phases"]`, `evaluate` among them) is printed
beside the estimate's phase. `--model moe` runs the same on a Qwen3-MoE-shaped model of the same
size class (`MOE_SHAPE`: hidden 1024, 8 layers, 32 experts 384 wide, 4 per token, the same
vocabulary: 0.48B parameters, 0.21B active) in `outputs/bench-memory/moe-model`, with
`actor.moe.router_replay=rollout` (the routes column travels with the batch). The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

GIB = float(1 << 30)
OUT = Path("outputs/bench-memory")
QWEN05_SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                "tie_word_embeddings": True}

MOE_SHAPE = {"hidden_size": 1024, "intermediate_size": 3072, "moe_intermediate_size": 384, "num_experts": 32,
             "num_experts_per_tok": 4, "norm_topk_prob": True, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 151936, "max_position_embeddings": 32768,
             "tie_word_embeddings": True}


def build_model(out: Path, moe: bool = False) -> Path:
    """A Qwen2.5-0.5B-shaped model (or `MOE_SHAPE`'s Qwen3-MoE) with random bf16 weights and a small
    tokenizer at `out`."""
    if (out / "config.json").is_file():
        return out
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from asyncrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    kind, shape = (Qwen3MoeConfig, MOE_SHAPE) if moe else (Qwen2Config, QWEN05_SHAPE)
    config = kind(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM if moe else Qwen2ForCausalLM)(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def overrides(model: Path, world: int, steps: int, run_dir: Path, dtype: str = "bfloat16",
              checkpointing: bool = True, engine: str = "native", val: int = 256, decode_slots: int = 16,
              moe: bool = False, rollout_ep: int = 1) -> list[str]:
    return [f"model.path={model}", *(["actor.moe.router_replay=rollout"] if moe else []),
            *([f"rollout.parallel.ep={rollout_ep}"] if rollout_ep > 1 else []), f"model.dtype={dtype}", f"actor.gradient_checkpointing={str(checkpointing).lower()}",
            f"rollout.engine={engine}",
            f"trainer.n_workers={world}", f"cluster.cpu_devices={world}",
            f"trainer.output_dir={run_dir}", f"trainer.total_steps={steps}", f"trainer.eval_every={steps}",
            f"trainer.save_every={steps}", "trainer.loggers=[jsonl]", "trainer.resume=none",
            "data.batch_size=4", "rollout.n=2", "rollout.max_tokens=128", "data.max_prompt_len=32",
            f"data.synthetic.n_val={val}", f"rollout.decode_slots={decode_slots}",
            "actor.ppo_mini_batches=1", "trainer.torch_threads=1"]


async def run(model: Path, world: int, steps: int, dtype: str, checkpointing: bool, engine: str = "native",
              val: int = 256, decode_slots: int = 16, moe: bool = False, rollout_ep: int = 1) -> dict:
    """One run of the trainer on `world` ranks (GPUs where this machine has them, else gloo CPU
    ranks); on a GPU also torch's peak allocation per phase (`cuda_phase_peak_gib`)."""
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.memory import worker_memory
    from asyncrl.plan.workload import model_spec
    from asyncrl.single_controller.context import local_cluster
    from asyncrl.trainer import Trainer
    from asyncrl.trainer import main as trainer_main

    run_dir = OUT / f"run-{'moe-' if moe else ''}dp{world}{f'-ep{rollout_ep}' if rollout_ep > 1 else ''}"
    cfg = load_config("grpo", overrides(model, world, steps, run_dir, dtype, checkpointing, engine, val, decode_slots,
                                        moe, rollout_ep))
    typed = rl_config(cfg)
    on_gpu = torch.cuda.is_available()
    device_bytes = torch.cuda.get_device_properties(0).total_memory if on_gpu else None
    estimate = worker_memory(typed, model_spec(str(model)), on_gpu=on_gpu, device_bytes=device_bytes)
    trainers: list[Trainer] = []
    t0 = time.monotonic()
    async with local_cluster(cpu_devices=world, log_dir=run_dir / "logs", cfg=cfg) as ctx:
        summary = await trainer_main(ctx, on_setup=trainers.append)
        stats = await trainers[0].roles.actor.memory_stats()
    wall = time.monotonic() - t0
    spec = model_spec(str(model))
    dp = world
    state = 16 * spec.params / dp  # fp32 master + gradients + Adam's two moments
    cb = 2 if dtype == "bfloat16" else 4
    from asyncrl.plan.memory import generation_params

    # + reference shard + the generation weights (a mixture's experts / rollout ep)
    floor = state + cb * spec.params / dp + cb * generation_params(spec, rollout_ep)
    phases = sorted({name for s in stats for name in s["phases"]})
    phase_peaks = {name: round(max(s["phases"].get(name, {}).get("peak_rss", 0.0) for s in stats) / GIB, 3)
                   for name in phases}
    steps_s = [h["timing/step_s"] for h in trainers[0].history]
    cuda = {name: round(max(s["phases"].get(name, {}).get("cuda_peak_allocated", 0.0) for s in stats) / GIB, 3)
            for name in phases} if on_gpu else {}
    return {"world": world, "device": "cuda" if on_gpu else "cpu", "cuda_phase_peak_gib": cuda,
            "estimate_phase_gib": {k: round(v / GIB, 3) for k, v in estimate.phases.items()},
            "hf": summary.get("checkpoint"), "peak_gib": [round(s["peak_rss"] / GIB, 3) for s in stats],
            "estimate_gib": round(estimate.total / GIB, 3), "estimate_phase": estimate.peak_phase,
            "estimate": estimate.to_json(), "phase_peak_gib": phase_peaks,
            "floor_gib": round(floor / GIB, 3), "state_gib": round(state / GIB, 3),
            "step_s": round(statistics.median(steps_s), 1), "wall_s": round(wall, 1), "steps": summary.get("steps")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 2], help="gloo CPU ranks of each run")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"],
                   help="model.dtype (bfloat16: what a real model trains in)")
    p.add_argument("--no-checkpointing", action="store_true", help="actor.gradient_checkpointing=false")
    p.add_argument("--engine", default="native", choices=["native", "vllm"], help="rollout.engine")
    p.add_argument("--val", type=int, default=256, help="held-out prompts (data.synthetic.n_val), evaluated at "
                                                         "the first and the last step")
    p.add_argument("--decode-slots", type=int, default=16, help="rollout.decode_slots: held-out rows decoded at once "
                                                                "(a training batch's rows are fewer)")
    p.add_argument("--model", default="dense", choices=["dense", "moe"], help="Qwen2.5-0.5B's shape or MOE_SHAPE")
    p.add_argument("--rollout-ep", type=int, default=1, help="rollout.parallel.ep (moe: each rank generates with "
                   "the experts it trains; must equal the world)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncrl.plan.workload import model_spec

    moe = args.model == "moe"
    model = build_model(OUT / ("moe-model" if moe else "model"), moe)
    spec = model_spec(str(model))
    out: dict = {"model": "Qwen3-MoE shape (MOE_SHAPE)" if moe else "Qwen2.5-0.5B shape", "params": spec.params,
                 "active_params": spec.active_params, "dtype": args.dtype,
                 "gradient_checkpointing": not args.no_checkpointing, "held_out": args.val,
                 "decode_slots": args.decode_slots, "rollout_ep": args.rollout_ep}
    for world in args.worlds:
        r = asyncio.run(run(model, world, args.steps, args.dtype, not args.no_checkpointing, args.engine, args.val,
                            args.decode_slots, moe, args.rollout_ep))
        print(json.dumps(r), flush=True)
        tag = f"dp{world}"
        out.update({f"peak_gib_{tag}": max(r["peak_gib"]), f"peak_gib_per_rank_{tag}": r["peak_gib"],
                    f"estimate_gib_{tag}": r["estimate_gib"], f"floor_gib_{tag}": r["floor_gib"],
                    f"state_gib_{tag}": r["state_gib"], f"step_s_{tag}": r["step_s"],
                    f"phase_peak_gib_{tag}": r["phase_peak_gib"], f"estimate_phase_gib_{tag}": r["estimate_phase_gib"],
                    f"estimate_ratio_{tag}": round(max(r["peak_gib"]) / r["estimate_gib"], 3)})
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
