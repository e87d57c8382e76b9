"""LoRA against full fine-tuning: optimizer state and weight-sync bytes on a real model's shape,
held-out gain on the tool task, and trainer-vs-rollout log-probs.

    python -m benchmarks.lora                  # about 8 minutes on 2 cores
    python -m benchmarks.lora --seeds 0 1 2    # the gains as means over three seeds (~25 minutes)
    python -m benchmarks.lora --skip-training  # the 0.5B shape's numbers only
    python -m benchmarks.lora --skip-gain      # the 0.5B shape's numbers and the log-prob agreement

- On Qwen2.5-0.5B's shape (built here, random fp32 weights): one AdamW step of full fine-tuning and
  one of LoRA (rank 32, all-linear) after a backward on a small batch; the optimizer state's bytes
  as torch holds them (`optim_state_ratio` = LoRA / full), and the bytes one split-placement
  weight sync carries, from the sync's own tensor lists (`sync_bytes_ratio`).
- `asyncrl-launch --config-name tool_quickstart` (a warm-started tiny model learning to call a
  tool) with full fine-tuning (its lr) and with LoRA (rank 8, alpha 16, 5x the lr), the same steps and
  seeds (`--seeds`; each arm's gain is the mean over them): `gain_ratio` = LoRA's held-out gain /
  full fine-tuning's. The same on `quickstart`, whose tiny model is random-initialised
  (`gain_ratio_quickstart`: LoRA-FA, A frozen, at rank 64 = the hidden size, alpha 128, the tied
  embedding adapted too, full fine-tuning's lr; `gain_ratio_quickstart_trained_a`: the same with
  A trained, as PEFT trains it). The settings: `LORA_SETTINGS`.
- Two FSDP ranks of the actor with LoRA, colocated: after four updates, the largest difference
  between the rollout's log-probs and the trainer's on the same tokens, for the native engine
  (merged weights), vLLM serving the adapter and vLLM with merged weights (`logprob_max_diff_*`);
  and whether a reference model was allocated (`ref_model_allocated`). Split placement (one
  training and one rollout worker, only A and B synced) with the native engine and vLLM: the
  largest `rollout/logprob_diff_max` of four GRPO steps (`logprob_max_diff_split_*`).
  `logprob_max_diff` is the largest of them all. vLLM cases need vLLM (`make vllm`).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

QWEN05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 512, "tie_word_embeddings": True}
RANK = 32


def optimizer_state_bytes(model: torch.nn.Module) -> int:
    """One AdamW step after a backward on 2 x 8 tokens; the state's bytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, QWEN05["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    total = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
                if torch.is_tensor(t) and t.dim() > 0)
    del opt
    return total


def shape_numbers() -> dict[str, float]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.train.lora import adapter_shapes, apply_lora
    from asyncrl.train.weight_sync import specs_of

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN05))
    full_sync = sum(s.nbytes for s in specs_of(model)) // 2  # the sync sends the compute dtype: bf16 here
    lora_sync = sum(torch.Size(shape).numel() * 2 for _, shape in adapter_shapes(model, RANK, ["all-linear"]))
    full_state = optimizer_state_bytes(model)
    model.zero_grad(set_to_none=True)
    apply_lora(model, RANK, 2.0 * RANK)
    lora_state = optimizer_state_bytes(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": sum(p.numel() for p in model.parameters()) - trainable, "lora_params": trainable,
            "optim_state_gib_full": round(full_state / 2**30, 3), "optim_state_gib_lora": round(lora_state / 2**30, 4),
            "optim_state_ratio": round(lora_state / full_state, 4),
            "sync_mib_full": round(full_sync / 2**20, 1), "sync_mib_lora": round(lora_sync / 2**20, 2),
            "sync_bytes_ratio": round(lora_sync / full_sync, 4)}


def gain(config: str, extra: list[str], workdir: Path, name: str, seeds: list[int]) -> dict[str, float]:
    """Held-out reward at the start and the end of `config`'s run, the mean over `seeds`."""
    from benchmarks.async_rl import launch

    runs = [launch(f"{name}-s{seed}", ["trainer.loggers=[jsonl]", f"seed={seed}", *extra], workdir,
                   timeout_s=1800, config=config) for seed in seeds]

    def mean(key: str) -> float:
        return round(sum(r[key] for r in runs) / len(runs), 4)

    return {"start": mean("reward_start"), "end": mean("reward_end"), "loop_s": mean("loop_s"),
            "ends": [r["reward_end"] for r in runs]}


# each task's best LoRA setting found (docs/results/2026-11-26-lora.md), by the key its gain ratio
# is reported under: the tool task adapts a warm-started model; sort is learned from a random init,
# where the embedding carries much of full fine-tuning's gain, so its (tied) matrix is adapted too,
# at full rank, with A frozen (LoRA-FA: the update linear in B; with A trained, the product's
# growth sharpens the policy early and it settles lower, reported beside it)
_SORT = ["actor.lora.rank=64", "actor.lora.alpha=128", "actor.optim.lr=1e-3",
         "actor.lora.target_modules=[all-linear,embed_tokens]"]
LORA_SETTINGS = {
    "gain_ratio": ("tool_quickstart", ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=5e-3"]),
    "gain_ratio_quickstart": ("quickstart", [*_SORT, "actor.lora.freeze_a=true"]),
    "gain_ratio_quickstart_trained_a": ("quickstart", _SORT),
}


def training_numbers(workdir: Path, seeds: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, (config, lora) in LORA_SETTINGS.items():
        if f"{config}_full" not in out:
            out[f"{config}_full"] = gain(config, [], workdir, f"{config}-full", seeds)
        full = out[f"{config}_full"]
        adapted = gain(config, lora, workdir, f"{key}-lora", seeds)
        print(json.dumps({"config": config, "key": key, "full": full, "lora": adapted}), flush=True)
        out[key] = round((adapted["end"] - adapted["start"]) / max(1e-9, full["end"] - full["start"]), 3)
        out[f"{key}_lora"] = adapted
    return out


ROLLOUTS = {"native": {}, "vllm_adapter": {"engine": "vllm"}, "vllm_merged": {"engine": "vllm", "vllm": {"lora": "merged"}}}


def rollouts() -> list[str]:
    return [r for r in ROLLOUTS if r == "native" or importlib.util.find_spec("vllm") is not None]


async def agreement(model: Path, logs: Path, rollout: str) -> dict[str, float]:
    from asyncrl.roles.actor import ActorRolloutRefWorker
    from asyncrl.single_controller.batch import Batch
    from asyncrl.single_controller.context import local_cluster

    cfg = {"model": {"path": str(model)}, "seed": 0, "trainer": {"torch_threads": 1},
           "rollout": {"n": 4, "max_tokens": 8, **ROLLOUTS[rollout]},
           "actor": {"optim": {"lr": 5e-2}, "pretrain_coef": 1.0, "use_kl_loss": True, "lora": {"rank": 8}}}
    ids = torch.tensor([[0, 5, 6, 7], [7, 8, 9, 4], [4, 5, 6, 9], [0, 0, 4, 5]])
    async with local_cluster(cpu_devices=2, log_dir=logs, insecure=True) as ctx:
        actor = await ctx.spawn_group(ctx.create_pool("a", world_size=2), ActorRolloutRefWorker, cfg,
                                      ("actor", "rollout", "ref"))
        held = await actor.held_models()

        async def sample(seed: int):
            prompts = ctx.put(Batch({"input_ids": ids, "attention_mask": (ids != 0).long()}, {"uid": list("abcd")},
                                    {"seed": seed}))
            return await actor.generate_sequences(prompts)

        gen = await sample(1)
        for _ in range(4):
            await actor.update_pretrain(gen)
        after = await sample(2)
        old, ref = await actor.compute_log_prob(after), await actor.compute_ref_log_prob(after)
        batch, old, ref = await after.fetch(), (await old.fetch())["old_log_probs"], (await ref.fetch())["ref_log_prob"]
        mask = batch["response_mask"].bool()
        return {f"logprob_max_diff_{rollout}": float((batch["rollout_log_probs"][mask] - old[mask]).abs().max()),
                f"logprob_diff_to_base_{rollout}": float((ref[mask] - old[mask]).abs().max()),
                "ref_model_allocated": any(h["ref"] for h in held),
                "trainable_share": round(held[0]["trainable_params"] / held[0]["params"], 4)}


def split_agreement(workdir: Path, engine: str) -> dict[str, float]:
    from benchmarks.async_rl import launch

    r = launch(f"split-{engine}", ["trainer.loggers=[jsonl]", "seed=0", "trainer.placement=split", "trainer.n_workers=1",
                                   "rollout.n_workers=1", "cluster.cpu_devices=2", f"rollout.engine={engine}",
                                   "model.build_tiny.heads=2", f"model.path={workdir / 'tiny-h2'}",
                                   "actor.lora.rank=8", "actor.optim.lr=5e-2", "actor.recompute_log_prob=always",
                                   "trainer.total_steps=4", "trainer.eval_every=4"], workdir, timeout_s=900)
    return {f"logprob_max_diff_split_{engine}": r["logprob_diff_max"]}


def agreements(tmp: Path) -> dict[str, float]:
    from asyncrl.models.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp / "tiny", task="sort", hidden=64, layers=2, heads=2, sft_steps=0)  # head_dim 32: vLLM
    out: dict[str, float] = {}
    for rollout in rollouts():
        out.update(asyncio.run(agreement(model, tmp / "logs", rollout)))
    for engine in ("native", "vllm") if "vllm_adapter" in rollouts() else ("native",):
        out.update(split_agreement(tmp, engine))
    out["logprob_max_diff"] = max(v for k, v in out.items() if k.startswith("logprob_max_diff_"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.splitlines()[0])
    p.add_argument("--skip-training", action="store_true", help="only the 0.5B shape's optimizer and sync bytes")
    p.add_argument("--skip-gain", action="store_true", help="no full-vs-LoRA training runs (the agreement checks only)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="seeds of the gain runs; the gains are the means over them (0 1 2: three times as long)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    out: dict = {"rank": RANK, **shape_numbers()}
    print(json.dumps(out), flush=True)
    if not args.skip_training:
        with tempfile.TemporaryDirectory(prefix="asyncrl-lora-") as tmp:
            if not args.skip_gain:
                out.update(training_numbers(Path(tmp), args.seeds))
            out.update(agreements(Path(tmp)))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
