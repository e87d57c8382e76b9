"""The actor's update on CPU against the cores' own matmul rate (CPU MFU), as users run it.

    python -m benchmarks.training                 # the Qwen2.5-0.5B shape, 8 rows x (64 + 64) tokens (~4 min)
    python -m benchmarks.training --shape 1.5B --rows 4

Each arm is a fresh process (torch reads its allocator settings once, as it starts): one rank,
FSDP2 over it as the actor builds it (fp32 on CPU, sequence packing where it pays), the model
loaded from a checkpoint of random weights, and `ppo_update` with the PPO-clip loss (what
`update_actor` runs) timed over `--updates` updates of a `--rows`-row batch after one warm-up
update. Arms, in micro-batches of `--micro-rows` rows (2, the GPU benchmark's) unless named:
- `system_allocator`: torch's and glibc's own allocator defaults (ASYNCRL_ALLOCATOR=system; what
  the workers ran before `daemons.proc.ALLOCATOR_ENV`);
- `huge_pages_only`: those defaults but torch's huge pages (THP_MEM_ALLOC_ENABLE=1);
- `asyncrl_allocator`: the workers' default environment (huge pages, glibc's heap reused);
  these three arms reduce the gradients after every micro-batch, as the engine did before;
- `accumulate_unsharded`: the workers' default environment and the engine's default, which keeps
  the gathered parameters and unreduced gradients across micro-batches when memory allows
  (`asyncrl.train.fsdp.UNSHARDED_ROOM`);
- `one_micro_batch`: all defaults, `actor.micro_batch_size`'s too (the whole batch at once);
- `filled_budget`: micro-batches by the token budget `actor.max_tokens_per_micro_batch=-1` sizes
  from the memory estimate for a worker alone on this machine (`token_budget` in its result).
Per arm: `step_s`, `tokens_per_s`, `page_faults` (minor faults per update), and `mfu`: the model
FLOPs (6·N per token plus causal attention, the PaLM convention) per second over the fp32 rate of
a [1024, hidden] x [hidden, 8·hidden] matmul measured in the same process. `<arm>_speedup` is an
arm's tokens/s over `system_allocator`'s. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import USER_ENV
from benchmarks.megatron import SHAPES, VOCAB, model_flops, qwen2, rl_batch
from daemons.proc import ALLOCATOR_CHOICE_ENV, ALLOCATOR_ENV

SYSTEM = {ALLOCATOR_CHOICE_ENV: "system"}
ARMS = {  # environment, the actor's default micro-batch size, FSDPEngine(accumulate_unsharded=)
    "system_allocator": (SYSTEM, False, False),
    "huge_pages_only": ({**SYSTEM, "THP_MEM_ALLOC_ENABLE": "1"}, False, False),
    "asyncrl_allocator": (ALLOCATOR_ENV, False, False),
    "accumulate_unsharded": (ALLOCATOR_ENV, False, None),
    "one_micro_batch": (ALLOCATOR_ENV, True, None),
    "filled_budget": (ALLOCATOR_ENV, "fill", None),
}


def rl_rows(rows: int, prompt: int, response: int):
    """`benchmarks.megatron.rl_batch`'s rows with the advantages and old log-probs the update reads."""
    batch = rl_batch(rows, prompt, response, VOCAB, "cpu")
    batch["advantages"] = torch.randn(rows, response, generator=torch.Generator().manual_seed(1))
    batch["old_log_probs"] = torch.zeros(rows, response)
    return batch


def ppo_loss(model, mb):
    from asyncrl.algorithms import core
    from asyncrl.roles.forward import packed_view, response_forward

    pk, _ = packed_view(model, mb)
    logp, _ = response_forward(model, mb, packed=pk)
    mask = mb["response_mask"].float()
    loss, _ = core.ppo_policy_loss(mb["old_log_probs"], logp, mb["advantages"], mask, clip_ratio_low=0.2,
                                   clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    return loss, {}


def run_arm(args: argparse.Namespace) -> dict:
    """This process's arm: the update's seconds, page faults and MFU."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config import OptimConfig, PPOUpdateConfig
    from asyncrl.roles.update import ppo_update
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import FSDPEngine, init_distributed, mixed_precision_policy, parallelize
    from asyncrl.train.packing import enable_packing
    from benchmarks.rollout import matmul_rate

    torch.set_num_threads(args.threads)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), 1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, layout, mixed_precision_policy("cpu", dtype="float32"))
    enable_packing(model)
    _, one_batch, accumulate = ARMS[args.arm]
    engine = FSDPEngine(model, layout, optim=OptimConfig(lr=1e-6), device="cpu", accumulate_unsharded=accumulate)
    micro = PPOUpdateConfig().micro_batch_size if one_batch else args.micro_rows
    budget = filled_budget(args) if one_batch == "fill" else 0
    cfg = PPOUpdateConfig(micro_batch_size=micro, max_tokens_per_micro_batch=budget, shuffle=False)
    batch, gen = rl_rows(args.rows, args.prompt, args.response), torch.Generator().manual_seed(0)
    ppo_update(engine, batch, cfg, ppo_loss, gen)  # warm-up
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(args.updates):
        ppo_update(engine, batch, cfg, ppo_loss, gen)
    seconds = (time.perf_counter() - start) / args.updates
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.updates
    seq = args.prompt + args.response
    rate = matmul_rate(1024, SHAPES[args.shape]["hidden_size"], "cpu", torch.float32)
    flops = model_flops(SHAPES[args.shape], params, args.rows, seq) / seconds
    return {"micro_batch_rows": min(micro, args.rows, budget // seq if budget else args.rows),
            **({"token_budget": budget} if budget else {}), "step_s": round(seconds, 3),
            "tokens_per_s": round(args.rows * seq / seconds, 2), "page_faults": int(faults),
            "model_gflops": round(flops / 1e9, 1), "matmul_gflops": round(rate / 1e9, 1),
            "mfu": round(flops / rate, 3)}


def filled_budget(args: argparse.Namespace) -> int:
    """actor.max_tokens_per_micro_batch=-1 as a worker alone on this machine sizes it."""
    from asyncrl.config import rl_config
    from asyncrl.plan.memory import fill_token_budget
    from asyncrl.plan.workload import model_spec
    from objectstore.memory import node_memory_bytes

    cfg = rl_config({"data": {"batch_size": max(1, args.rows // 2), "max_prompt_len": args.prompt},
                     "rollout": {"n": 2, "max_tokens": args.response}, "trainer": {"n_workers": 1},
                     "model": {"dtype": "float32"}, "actor": {"max_tokens_per_micro_batch": -1}})
    return fill_token_budget(cfg, model_spec(str(args.model)), False, node_memory_bytes())[0]


def spawn_arm(arm: str, model: Path, args: argparse.Namespace) -> dict:
    """`arm` in a fresh process with its allocator setting; its JSON result."""
    settings = ARMS[arm][0]
    cmd = [sys.executable, "-m", "benchmarks.training", "--arm", arm, "--model", str(model),
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("arm", "model"))]
    env = {**{k: v for k, v in USER_ENV.items() if k not in (*ALLOCATOR_ENV, ALLOCATOR_CHOICE_ENV)}, **settings,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5B")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--micro-rows", type=int, default=2)
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--arm", choices=sorted(ARMS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.arm is not None:
        print(json.dumps(run_arm(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="asyncrl-training-") as tmp:
        qwen2(SHAPES[args.shape], dtype=torch.float32).save_pretrained(tmp)
        arms = {arm: spawn_arm(arm, Path(tmp), args) for arm in ARMS}
    out = {"shape": args.shape, "rows": args.rows, "tokens_per_row": args.prompt + args.response,
           "threads": args.threads, **arms}
    for arm in list(ARMS)[1:]:
        out[f"{arm}_speedup"] = round(arms[arm]["tokens_per_s"] / arms["system_allocator"]["tokens_per_s"], 3)
    out["mfu"] = max(a["mfu"] for a in arms.values())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
