"""Mixture-of-experts RL on CPU: Megatron's logits, routing replay, learning against a dense model.

    python -m benchmarks.moe                 # all of it, 3 seeds of learning (~22 minutes)
    python -m benchmarks.moe --seeds 0       # one seed of learning
    python -m benchmarks.moe --skip-learning # Megatron's logits and the routing numbers (~2 minutes)
    python -m benchmarks.moe --skip-megatron --hidden 128 --layers 4   # learning at a larger tiny size

- Routing (in process, a tiny Qwen3-MoE with 8 experts, top-2, random weights): the native engine
  samples 64 responses and records each token's experts; the trainer (fp32) recomputes the
  sampled tokens' log-probs without and with replaying those experts. With an fp32 rollout
  (`*_fp32`: the trainer's own numerics) and a bf16 rollout (`*_bf16`: a copy of the weights in
  bf16, as a rollout engine in bf16 holds them): `routing_agreement_*` (the share of top-k
  selections the trainer's routers make as the rollout's did), `logprob_diff_*` (the largest
  |Δ log-prob| over response tokens). `routing_agreement_replay` is measured on the experts the
  trainer's forward actually used.
- Megatron (gloo CPU ranks): `logits_max_abs_diff`, the largest |Δ logit| against Hugging Face's
  over Qwen3-MoE (with and without `norm_topk_prob`) and Mixtral (4 experts, top-2, left-padded
  rows) at (tp, ep) ∈ {(1, 1), (1, 2), (2, 1), (2, 2)} (`logits_by_layout`).
- Learning: `asyncrl-launch --config-name moe_quickstart` (FSDP2, routing replay on), the same on
  Megatron with expert parallelism 2 (`actor.backend=megatron actor.moe.ep=2
  actor.moe.router_replay=none`), its dense twin `--config-name quickstart
  model.build_tiny.qk_norm=true` (a Qwen3: the same attention, one MLP with the active experts'
  parameters) and the quickstart's Llama (no query-key norms), the same steps and seeds:
  `gain_ratio` = MoE's held-out gain / the twin's (each the mean over seeds),
  `gain_ratio_vs_llama` and `dense_vs_llama` against the Llama, `gain_ratio_megatron_ep2` the
  Megatron arm's against the twin, and
  `step_time_ratio` = the Megatron arm's mean update time / FSDP2's (`timing/update_actor_s`, the
  same 2 ranks).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

from asyncrl.algorithms import core
from asyncrl.roles.forward import response_forward
from asyncrl.rollout.engine import RolloutEngine, SamplingParams
from asyncrl.single_controller.batch import Batch
from asyncrl.train.moe import flat_routes, tap_of


def tiny_moe(vocab: int = 256, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).eval()


def trainer_pass(model: torch.nn.Module, batch: Batch, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of the sampled tokens and the experts its forward used."""
    tap = tap_of(model)
    tap.start(replay=flat_routes(batch["routed_experts"]) if replay else None, record=True)
    with torch.no_grad():
        logp, _ = response_forward(model, batch)
    used = tap.chosen(used=True)
    tap.stop()
    return logp, used


def routing_numbers(rollout_dtype: torch.dtype) -> dict[str, float]:
    trainer = tiny_moe()
    rollout_model = copy.deepcopy(trainer).to(rollout_dtype)
    engine = RolloutEngine(rollout_model, eos_token_id=2, pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 256, (16, 24), generator=gen)
    out = engine.generate(prompts, torch.ones_like(prompts), SamplingParams(temperature=1.0, max_tokens=32, n=4),
                          generator=gen, record_routes=True)
    batch = Batch(out)
    recorded = flat_routes(out["routed_experts"])
    valid = out["attention_mask"].reshape(-1).bool() & (recorded >= 0).all(-1).all(-1)
    mask = out["response_mask"].bool()
    res = {}
    for replay in (False, True):
        logp, used = trainer_pass(trainer, batch, replay)
        tag = "replay" if replay else "no_replay"
        res[f"routing_agreement_{tag}"] = round(core.routing_agreement(used, recorded, valid), 6)
        res[f"logprob_diff_{tag}"] = core.max_abs_diff(logp, out["rollout_log_probs"], mask)
    return res


MEGATRON_EP2 = ["actor.backend=megatron", "actor.moe.ep=2", "actor.moe.router_replay=none"]


def arm(config: str, extra: list[str], workdir: Path, name: str, seeds: list[int]) -> dict:
    """Held-out reward at the start and the end (means over `seeds`) and the mean update time."""
    from benchmarks.async_rl import launch

    runs, update_s = [], []
    for seed in seeds:
        runs.append(launch(f"{name}-s{seed}", ["trainer.loggers=[jsonl]", f"seed={seed}", *extra], workdir,
                           timeout_s=1800, config=config))
        rows = [json.loads(ln) for ln in (workdir / f"{name}-s{seed}" / "metrics.jsonl").read_text().splitlines()]
        update_s += [r["timing/update_actor_s"] for r in rows if r["step"] > 0]
    mean = lambda key: round(sum(r[key] for r in runs) / len(runs), 4)  # noqa: E731
    return {"start": mean("reward_start"), "end": mean("reward_end"), "ends": [r["reward_end"] for r in runs],
            "update_s": sum(update_s) / len(update_s), "wall_s": [r["wall_s"] for r in runs]}


def _logits_job(rank: int, world: int, out_dir: Path) -> dict:
    """fp32 logits of each MoE architecture at this (tp, ep) against HF's."""
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.megatron.engine import MegatronEngine
    from tests.rl.test_megatron_moe import ARCHS, hf_moe, probe

    init_distributed()
    tp, ep = (int(x) for x in (out_dir / "layout").read_text().split())
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp), world)
    res = {}
    for arch in ARCHS:
        engine = MegatronEngine(str(out_dir / arch), layout, optim=None, device="cpu", dtype=torch.float32, ep=ep)
        ids, mask = probe()
        with torch.no_grad():
            got = engine.model(input_ids=ids, attention_mask=mask).logits
            want = hf_moe(arch)(input_ids=ids, attention_mask=mask).logits
        res[f"{arch}/tp{tp}ep{ep}"] = float((got - want).abs()[mask.bool()].max())
    return res


def megatron_logits(workdir: Path) -> dict:
    from tests.helpers.gloo_ranks import run_ranks
    from tests.rl.test_megatron_moe import ARCHS, hf_moe

    for arch in ARCHS:
        hf_moe(arch).save_pretrained(workdir / arch)
    diffs: dict[str, float] = {}
    for tp, ep in ((1, 1), (1, 2), (2, 1), (2, 2)):
        (workdir / "layout").write_text(f"{tp} {ep}")
        for r in run_ranks(_logits_job, tp * ep, workdir, timeout_s=600):
            diffs.update({k: max(diffs.get(k, 0.0), v) for k, v in r.items()})
    return {"logits_max_abs_diff": max(diffs.values()), "logits_by_layout": diffs}


def learning(seeds: list[int], workdir: Path, size: list[str], megatron_arm: bool = True) -> dict[str, float]:
    """`size`: overrides of both tiny models' shape (model.build_tiny.*), the same for each arm."""
    moe = arm("moe_quickstart", [f"model.path={workdir}/tiny-moe", *size], workdir, "moe", seeds)
    megatron = (arm("moe_quickstart", [f"model.path={workdir}/tiny-moe", *size, *MEGATRON_EP2], workdir, "moe-megatron",
                    seeds) if megatron_arm else None)
    # the twin: a dense Qwen3, the MoE's attention (queries and keys normalised) with one MLP as
    # wide as the active experts; the quickstart's Llama (no such norms) beside it
    dense = arm("quickstart", [f"model.path={workdir}/tiny-qwen3", "model.build_tiny.qk_norm=true", *size], workdir,
                "dense", seeds)
    llama = arm("quickstart", [f"model.path={workdir}/tiny-llama", *size], workdir, "llama", seeds)
    print(json.dumps({"moe": moe, "moe_megatron_ep2": megatron, "dense": dense, "llama": llama}), flush=True)
    gain = lambda r: r["end"] - r["start"]  # noqa: E731
    out = {"gain_ratio": round(gain(moe) / max(1e-9, gain(dense)), 3), "moe_ends": moe["ends"],
           "dense_ends": dense["ends"], "gain_ratio_vs_llama": round(gain(moe) / max(1e-9, gain(llama)), 3),
           "dense_vs_llama": round(gain(dense) / max(1e-9, gain(llama)), 3), "llama_ends": llama["ends"],
           "wall_s": {"moe": moe["wall_s"], "dense": dense["wall_s"], "llama": llama["wall_s"]}, "size": size}
    if megatron is not None:
        out.update(gain_ratio_megatron_ep2=round(gain(megatron) / max(1e-9, gain(dense)), 3),
                   step_time_ratio=round(megatron["update_s"] / moe["update_s"], 3), moe_megatron_ep2_ends=megatron["ends"])
        out["wall_s"]["moe_megatron_ep2"] = megatron["wall_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--skip-learning", action="store_true")
    p.add_argument("--skip-megatron", action="store_true", help="no megatron-core logits or learning arm")
    p.add_argument("--hidden", type=int, default=0, help="both tiny models' hidden size (0: the quickstarts')")
    p.add_argument("--layers", type=int, default=0, help="both tiny models' layers (0: the quickstarts')")
    a = p.parse_args(argv)
    size = [*([f"model.build_tiny.hidden={a.hidden}", f"model.build_tiny.heads={a.hidden // 32}"] if a.hidden else []),
            *([f"model.build_tiny.layers={a.layers}"] if a.layers else [])]
    out: dict = {"benchmark": "moe"}
    if not a.skip_megatron:
        with tempfile.TemporaryDirectory(prefix="asyncrl-moe-logits-") as tmp:
            out.update(megatron_logits(Path(tmp)))
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out.update({f"{k}_{name}": v for k, v in routing_numbers(dtype).items()})
    out["routing_agreement_replay"] = min(out["routing_agreement_replay_fp32"], out["routing_agreement_replay_bf16"])
    out["logprob_diff_replay"] = out["logprob_diff_replay_fp32"]
    out["logprob_diff_no_replay"] = out["logprob_diff_no_replay_fp32"]
    out["routing_agreement_no_replay"] = out["routing_agreement_no_replay_bf16"]
    if not a.skip_learning:
        with tempfile.TemporaryDirectory(prefix="asyncrl-moe-") as tmp:
            out.update(learning(a.seeds, Path(tmp), size, megatron_arm=not a.skip_megatron))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
