"""The planner against measurement here and against brute force and the papers at scale.

    python -m benchmarks.planner [--steps 12] [--skip-measure]

1. Profiles this machine (`asyncrl-plan profile`, layer by layer) into a temporary file.
2. CPU validation: the feasible plans of a small GRPO config on the 2 CPU workers (colocated
   with dp / tp / pp and both generation TP sizes, a small micro-batch, and split placement) are
   each launched as users launch them (`asyncrl-launch` with the plan's overrides) for `--steps`
   steps; the median step time after two warm-up steps is compared with the estimate: Spearman
   rank correlation, relative errors, and whether the measured best is the predicted best (or
   within 10 % of it).
3. At scale, by simulation (HybridFlow's setting: PPO with actor, critic, reference and reward
   models, 1024 prompts of 1024 + 1024 tokens, the `a100` profile of its testbed): the placement
   Algorithm 1 chooses for 7B and 13B on 16–128 GPUs; per-call strategies against one symmetric
   strategy (REAL); MCMC against exhaustive search on 8 and 16 GPUs; the 128-GPU search time.

The last line is one JSON object: rank_corr, mcmc_vs_bruteforce, search_s_128gpu, placements_8_3, ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.plan.cli import overrides
from asyncrl.plan.cost import Strategy
from asyncrl.plan.hardware import load_profile
from asyncrl.plan.search import SearchSpace, exhaustive, hybridflow, mcmc
from asyncrl.plan.workload import (
    KNOWN_MODELS,
    ModelSpec,
    Workload,
    config_model_spec,
    rl_calls,
    workload_from_config,
)
from benchmarks.async_rl import launch

SMALL = ["model.build_tiny.hidden=128", "model.build_tiny.layers=4", "model.build_tiny.heads=4",
         "rollout.max_tokens=12"]


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den


def cpu_plans(space: SearchSpace) -> list[tuple[str, Any, Any]]:
    """One plan per distinct layout (its best micro-batch by estimate) and a small-micro-batch variant."""
    result = exhaustive(space, keep=10_000)
    plans = [(result.best, result.cost), *result.runners_up]
    chosen: dict[tuple, tuple] = {}
    for plan, cost in plans:
        a = plan.strategy("actor")
        key = (plan.split, a.dp, a.tp, a.pp, a.gen_tp)
        chosen.setdefault(key, (plan, cost))
    out = []
    for (split, dp, tp, pp, g), (plan, cost) in chosen.items():
        name = "split" if split else f"dp{dp}tp{tp}pp{pp}g{g}"
        out.append((name, plan, cost))
    small = next(((p, c) for p, c in plans if not p.split and p.strategy("actor").dp == 2
                  and p.strategy("actor").micro_batch == 4), None)
    if small is not None:
        out.append(("dp2tp1pp1g1_mb4", *small))
    return out


def longest_prompt(task: str, n: int) -> int:
    """The longest templated prompt of the task's training rows in the tiny model's tokenizer
    (a batch of them trains at about this width once padding is trimmed)."""
    from asyncrl.data.dataset import PromptDataset
    from asyncrl.data.synthetic import make_rows
    from asyncrl.models.tiny import build_tokenizer

    items = PromptDataset(make_rows(task, n, 0), build_tokenizer(), max_prompt_len=1 << 20).items
    return max(len(it.input_ids) for it in items)


def validate_cpu(profile_path: str, steps: int, workdir: Path) -> dict[str, Any]:
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config

    base = [f"model.path={workdir / 'model'}", *SMALL, f"plan.prompt_len={longest_prompt('sort', 512)}"]
    cfg = rl_config(load_config("quickstart", base))
    profile = load_profile(profile_path)
    w = replace(workload_from_config(cfg, config_model_spec(cfg)), micro_batch_sizes=(4, 16, 64))
    space = SearchSpace(w, profile, 1, cfg.cluster.cpu_devices, deployable=True)
    runs = {}
    for name, plan, cost in cpu_plans(space):
        extra = [*base, *overrides(plan, space, profile), f"trainer.total_steps={steps}",
                 f"trainer.eval_every={steps}", f"trainer.save_every={steps}", "trainer.loggers=[console,jsonl]"]
        launch(name, extra, workdir, timeout_s=600)
        rows = [json.loads(ln) for ln in (workdir / name / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        measured = statistics.median(r["timing/step_s"] for r in rows if r["step"] > 2)
        runs[name] = {"estimated_s": round(cost.step_s, 4), "measured_s": round(measured, 4),
                      "overrides": overrides(plan, space, profile)}
        print(f"{name}: estimated {cost.step_s:.3f} s, measured {measured:.3f} s", file=sys.stderr, flush=True)
    est = [r["estimated_s"] for r in runs.values()]
    got = [r["measured_s"] for r in runs.values()]
    predicted = min(runs, key=lambda n: runs[n]["estimated_s"])
    best = min(runs, key=lambda n: runs[n]["measured_s"])
    errors = [abs(e - m) / m for e, m in zip(est, got, strict=True)]
    return {"rank_corr": round(_spearman(est, got), 3), "rel_error_median": round(statistics.median(errors), 3),
            "rel_error_max": round(max(errors), 3), "predicted_best": predicted, "measured_best": best,
            "predicted_best_within": round(runs[predicted]["measured_s"] / runs[best]["measured_s"], 3),
            "cpu_runs": runs}


def hybridflow_ppo(model: ModelSpec) -> Workload:
    """HybridFlow §8's PPO step: actor, critic, reference and reward models, 1024 prompts, 1024 + 1024 tokens."""
    calls = rl_calls("ppo", critic=True, ref=True, reward_model=True, recompute=False, actor_epochs=1, actor_minis=1)
    value = model.as_value_model()
    return Workload(models={"actor": model, "critic": value, "ref": model, "reward": value}, calls=calls,
                    sequences=1024, prompt_len=1024, response_len=1024)


def placements_8_3() -> dict[str, Any]:
    profile = load_profile("a100")
    out: dict[str, Any] = {}
    for label, name in (("7b", "meta-llama/Llama-2-7b-hf"), ("13b", "meta-llama/Llama-2-13b-hf")):
        w = hybridflow_ppo(KNOWN_MODELS[name])
        for gpus in (16, 32, 64, 96, 128):
            space = SearchSpace(w, profile, gpus // 8, 8, deployable=False, allow_split=False)
            r = hybridflow(space, keep=64)
            best_of: dict[str, float] = {}
            for plan, cost in [(r.best, r.cost), *r.runners_up]:
                kind = "colocate" if len(plan.sets) == 1 else "standalone" if len(plan.sets) == 4 else "split"
                best_of.setdefault(kind, cost.step_s)
            out[f"{label}_{gpus}"] = {"placement": r.best.placement(), "devices": list(r.best.devices),
                                      "step_s": round(r.cost.step_s, 2),
                                      "colocate_over_best_other": round(best_of["colocate"] / min(
                                          v for k, v in best_of.items() if k != "colocate"), 3)
                                      if len(best_of) > 1 else None}
    return out


def per_call_gain() -> dict[str, float]:
    """REAL's finding: a strategy per model call beats one strategy for every model."""
    profile = load_profile("h100")
    out = {}
    for label, name, gpus in (("7b_16", "meta-llama/Llama-2-7b-hf", 16), ("13b_32", "meta-llama/Llama-2-13b-hf", 32)):
        w = hybridflow_ppo(KNOWN_MODELS[name])
        space = SearchSpace(w, profile, gpus // 8, 8, deployable=False, allow_split=False)
        free = exhaustive_colocated(space, symmetric=False)
        same = exhaustive_colocated(space, symmetric=True)
        out[label] = round(same / free, 3)
    return out


def exhaustive_colocated(space: SearchSpace, symmetric: bool) -> float:
    """The best colocated plan's step time: each model with its own strategy (Algorithm 1's
    choice), or one (dp, tp, pp, micro-batch) shared by all, tried exhaustively."""
    units, sets, d = space.units, (space.units,), (space.total,)
    if not symmetric:
        r = hybridflow(space, top_k=8, keep=64)
        return min(c.step_s for p, c in [(r.best, r.cost), *r.runners_up] if len(p.sets) == 1)
    best = float("inf")
    for s in space.strategies("actor", space.total):
        if s.gen_tp != s.tp:  # one layout for every call, generation included (no hybrid-engine reshard)
            continue
        shared = Strategy(s.dp, s.tp, s.pp, s.micro_batch, 1)
        chosen = {u: (s if u == "actor" else shared) for u in units}
        best = min(best, space.cost(space.plan(sets, d, chosen)).step_s)
    return best


def mcmc_vs_bruteforce() -> dict[str, Any]:
    profile = load_profile("h100")
    out = {}
    for label, name, gpus in (("7b_8", "meta-llama/Llama-2-7b-hf", 8), ("7b_16", "meta-llama/Llama-2-7b-hf", 16)):
        w = replace(hybridflow_ppo(KNOWN_MODELS[name]), micro_batch_sizes=(4,))
        space = SearchSpace(w, profile, max(1, gpus // 8), min(8, gpus), deployable=False, allow_split=False)
        t0 = time.monotonic()
        brute = exhaustive(space, limit=20_000_000)
        brute_s = time.monotonic() - t0
        found = mcmc(SearchSpace(w, profile, max(1, gpus // 8), min(8, gpus), deployable=False, allow_split=False),
                     seconds=5.0, seed=1)
        out[label] = {"ratio": round(found.cost.step_s / brute.cost.step_s, 4), "bruteforce_plans": brute.evaluated,
                      "bruteforce_s": round(brute_s, 1), "mcmc_s": round(found.seconds, 2),
                      "mcmc_plans": found.evaluated}
    return out


def search_128() -> dict[str, Any]:
    """What `asyncrl-plan` does at 128 H100s (`plan.search=auto`: Algorithm 1, then MCMC from its plan)."""
    from asyncrl.plan.cli import search

    w = hybridflow_ppo(KNOWN_MODELS["meta-llama/Llama-2-7b-hf"])
    out = {}
    for label, deployable in (("hybridflow_space", False), ("asyncrl_space", True)):
        space = SearchSpace(w, load_profile("h100"), 16, 8, deployable=deployable, allow_split=deployable)
        t0 = time.monotonic()
        r = search(space, "auto", seconds=10.0, seed=0, keep=4)
        out[label] = {"seconds": round(time.monotonic() - t0, 2), "placement": r.best.placement(),
                      "step_s": round(r.cost.step_s, 2), "plans_priced": r.evaluated}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip-measure", action="store_true", help="simulation only (no CPU runs)")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-planner-") as tmp:
        workdir = Path(tmp)
        if not args.skip_measure:
            from asyncrl.plan.profile import main as profile_main

            prof = workdir / "cpu.json"
            profile_main(["--out", str(prof), *[f"{o}" for o in [f"model.path={workdir / 'model'}", *SMALL]]])
            result.update(validate_cpu(str(prof), args.steps, workdir))
        m = mcmc_vs_bruteforce()
        result["mcmc_vs_bruteforce"] = max(v["ratio"] for v in m.values())
        s = search_128()
        result["search_s_128gpu"] = max(v["seconds"] for v in s.values())
        result["placements_8_3"] = placements_8_3()
        result["per_call_gain"] = per_call_gain()
        result["mcmc_cases"], result["search_128"] = m, s
    print(json.dumps(result))


if __name__ == "__main__":
    main()
