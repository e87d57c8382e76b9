"""Multi-turn rollouts with a slow environment: per-trajectory asyncio vs lock-step turns.

    python -m benchmarks.agentic_rl                      # medians 0 / 25 / 100 / 400 ms + a CPU-bound control
    python -m benchmarks.agentic_rl --latencies 100 --repeats 1

The tiny quickstart-shaped model (hidden 64, 2 layers, built locally) rolls out 16 prompts x 4
samples, three turns each (8 tokens a turn), through `asyncrl.agents.MultiTurnRollout` and the
native engine, as a colocated rollout worker runs it. Every environment step waits a seeded
log-normal latency (median m, sigma 1: long-tailed, like tool calls and sandboxes); the same
trajectory gets the same latencies under both schedules. `lockstep` decodes turn t of every live
trajectory together before any turn t + 1 (TRL's GRPOTrainer); `per_trajectory` decodes whatever
turns are waiting whenever the engine is free. The control burns the latency as CPU in the
environment (a Python loop holding the GIL) instead of waiting: there overlap buys little.

Per setting: rollout seconds (median of repeats), the share of trajectory time spent waiting on
the environment, model tokens/s and decode waves. The last line is one JSON object with
`speedup_per_traj_<m>ms` (lock-step seconds / per-trajectory seconds) for every median.

    python -m benchmarks.agentic_rl --trainer 100     # asynchronous vs synchronous RL, 100 ms tool calls

`--trainer MS` instead trains `--config-name tool_quickstart` (the tiny model learns to call a
lookup tool) with each tool call waiting a log-normal MS median, as `benchmarks.async_rl` runs its
placements: `sync` (colocated on 2 workers), `sync_reseeded` (seed + 1: the noise), `split_k0`
(1 training + 1 rollout worker, synchronous), `async_k1`, `async_k2` (the same pools with
generation up to k versions ahead, interruptible, decoupled PPO), the same samples each. Its JSON:
`speedup_async_<MS>ms` (the best synchronous loop seconds / the best asynchronous), `success_sync`,
`success_async` (held-out success at the end) and `success_noise` (|sync - sync_reseeded|).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from asyncrl.agents.config import MultiTurnConfig
from asyncrl.agents.env import Action, Environment, StepResult
from asyncrl.agents.rollout import MultiTurnRollout, WaveGenerator

OUT = Path("outputs/bench-agentic")
PROMPTS, SAMPLES, TURNS, TURN_TOKENS = 16, 4, 3, 8
RUNS = itertools.count()


class SlowTool(Environment):
    """Three turns; each step waits (or, `cpu=True`, computes for) a log-normal latency drawn
    from the trajectory's own seeded stream, then answers with a short observation."""

    instances: dict[tuple[int, int], itertools.count] = {}  # (run, row) -> samples started

    def __init__(self, median_ms: float = 100.0, cpu: bool = False, seed: int = 0, run: int = 0) -> None:
        self.median_s, self.cpu, self.seed, self.run = median_ms / 1000, cpu, seed, run
        self.turn = 0

    def reset(self, row: dict) -> None:  # the k-th sample of row i: the same stream in every run
        index = int(row["i"])
        sample = next(SlowTool.instances.setdefault((self.run, index), itertools.count()))
        self.rng = random.Random(f"{self.seed}:{index}:{sample}")

    async def step(self, action: Action) -> StepResult:
        delay = self.median_s * self.rng.lognormvariate(0.0, 1.0) if self.median_s else 0.0
        if self.cpu:
            end = time.perf_counter() + delay
            while time.perf_counter() < end:  # holds the GIL, as a CPU-bound tool would
                pass
        else:
            await asyncio.sleep(delay)
        self.turn += 1
        if self.turn >= TURNS:
            return StepResult(reward=0.0, done=True)
        return StepResult("sort 1 2", role="user")


def build_model() -> Path:
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(OUT / "model", task="sort", hidden=64, layers=2, heads=4, sft_steps=0)


def run_once(model: object, tok: object, median_ms: float, schedule: str, cpu: bool) -> dict:
    from asyncrl.rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = MultiTurnConfig(enable=True, env=f"{Path(__file__).resolve()}:SlowTool",
                          env_kwargs={"median_ms": median_ms, "cpu": cpu, "run": next(RUNS)}, max_turns=TURNS,
                          max_turn_tokens=TURN_TOKENS, schedule=schedule)
    agent = MultiTurnRollout(cfg, tok)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"sort {i % 10} 3 1"}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for i in range(PROMPTS)]
    turns = WaveGenerator(engine, SamplingParams(temperature=1.0, max_tokens=TURN_TOKENS),
                          torch.Generator().manual_seed(0), lockstep=schedule == "lockstep")
    t0 = time.perf_counter()
    trajs = agent.rollout(prompts, [{"i": i} for i in range(PROMPTS)], SAMPLES, turns, budget=64)
    seconds = time.perf_counter() - t0
    agent.close()
    tokens = sum(sum(t.mask) for t in trajs)
    return {"seconds": seconds, "env_share": sum(t.counts["env_s"] for t in trajs) / (len(trajs) * seconds),
            "tokens_per_s": tokens / seconds, "waves": turns.waves,
            "turns_mean": statistics.mean(t.counts["num_turns"] for t in trajs)}


def trainer_comparison(latency_ms: float, steps: int | None, ks: list[int], seed: int = 0) -> dict:
    """`asyncrl-launch --config-name tool_quickstart` with `latency_ms` per tool call: synchronous
    (colocated; split k=0) against asynchronous (split, k = 1, 2, interruptible, decoupled PPO),
    the same samples each; and a reseeded synchronous run for how much success differs by chance."""
    import tempfile

    from omegaconf import OmegaConf

    from asyncrl.launch import load_config
    from asyncrl.models.tiny import ensure_tiny_model
    from benchmarks.async_rl import launch, runs

    defaults = load_config("tool_quickstart", [])
    model = ensure_tiny_model(OUT / "lookup-model", **OmegaConf.to_container(defaults.model.build_tiny))
    steps = steps or defaults.trainer.total_steps  # as `asyncrl-launch --config-name tool_quickstart` trains
    common = [f"model.path={model}", "model.build_tiny=null", f"seed={seed}", f"trainer.total_steps={steps}",
              f"trainer.eval_every={steps}", f"trainer.save_every={steps}", "trainer.loggers=[console,jsonl]",
              f"+rollout.multi_turn.env_kwargs.latency_ms={latency_ms}"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-agentic-") as tmp:
        for name, extra in runs(2, ks, seed).items():
            results[name] = launch(name, [*common, *extra], Path(tmp), timeout_s=1200, config="tool_quickstart")
            print(json.dumps({"run": name, "latency_ms": latency_ms, **results[name]}), flush=True)
    sync_best = min(results["sync"]["loop_s"], results["split_k0"]["loop_s"])
    best = min((f"async_k{k}" for k in ks), key=lambda n: results[n]["loop_s"])
    tag = f"{int(latency_ms)}ms"
    return {f"speedup_async_{tag}": round(sync_best / results[best]["loop_s"], 3), f"best_async_{tag}": best,
            "success_sync": results["sync"]["reward_end"], "success_async": results[best]["reward_end"],
            "success_noise": round(abs(results["sync"]["reward_end"] - results["sync_reseeded"]["reward_end"]), 4),
            f"loop_s_{tag}": {n: r["loop_s"] for n, r in results.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agentic_rl", description=__doc__.splitlines()[0])
    p.add_argument("--latencies", type=float, nargs="+", default=[0, 25, 100, 400], help="median ms per step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-control", action="store_true", help="skip the CPU-bound control (100 ms)")
    p.add_argument("--trainer", type=float, default=None, metavar="MS",
                   help="instead: synchronous vs asynchronous RL on tool_quickstart at this median tool latency")
    p.add_argument("--steps", type=int, default=None,
                   help="--trainer: training steps of every run (default: tool_quickstart's trainer.total_steps)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2], help="--trainer: staleness bounds to try")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.trainer is not None:
        print(json.dumps(trainer_comparison(args.trainer, args.steps, args.ks)), flush=True)
        return 0
    path = build_model()
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    settings = [(m, False) for m in args.latencies] + ([] if args.no_control else [(100.0, True)])
    out: dict = {"trajectories": PROMPTS * SAMPLES, "turns": TURNS, "turn_tokens": TURN_TOKENS}
    for median_ms, cpu in settings:
        row = {}
        for schedule in ("lockstep", "per_trajectory"):
            runs = [run_once(model, tok, median_ms, schedule, cpu) for _ in range(args.repeats)]
            best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
            row[schedule] = {k: round(v, 3) for k, v in best.items()}
        tag = f"{int(median_ms)}ms" + ("_cpu" if cpu else "")
        speedup = row["lockstep"]["seconds"] / row["per_trajectory"]["seconds"]
        print(json.dumps({"median_ms": median_ms, "cpu_bound": cpu, **row, "speedup": round(speedup, 3)}), flush=True)
        out[f"speedup_per_traj_{tag}"] = round(speedup, 3)
        out[f"seconds_lockstep_{tag}"] = row["lockstep"]["seconds"]
        out[f"seconds_per_traj_{tag}"] = row["per_trajectory"]["seconds"]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
