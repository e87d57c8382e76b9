"""Do the losses of 2025 learn, and does on-policy distillation beat RL to a teacher's reward?

Every run is the quickstart as users run it (`python -m asyncrl.launch --config-name quickstart`,
a subprocess with its own process group: coordinator, node daemon, two FSDP2 workers, the tiny
random-init model, the synthetic sort task, held-out reward every `trainer.eval_every` steps),
changed only by the overrides named here. Per seed:

1. **GRPO** (the quickstart, `actor.ppo_mini_batches=2` for every run so that the ratio differs
   from 1 on the second mini-batch and each loss's clip or weight acts);
2. **each loss** (`actor.policy_loss=gspo|cispo|clip_cov|kl_cov`, GSPO with its
   `actor.loss_agg_mode=seq-mean-token-mean`), everything else equal;
3. **on-policy distillation** (`algorithm.name=opd`): the same random-init student, the teacher
   = that seed's GRPO run's final checkpoint, run for as many steps as GRPO needed to reach 0.9 of
   the teacher's held-out reward (so OPD wins only by reaching it sooner).

Reported: held-out gain (end - start) per run, `gain_ratio_<loss>` = mean gain over seeds / GRPO's;
`opd_reward_ratio` = OPD's best held-out reward / the teacher's (mean over seeds);
`opd_steps_ratio` = steps OPD needed to reach 0.9 of the teacher's reward / steps GRPO needed
(mean over seeds; a seed where OPD does not get there counts OPD's steps as GRPO's + eval_every);
every run's wall seconds. The last line printed is one JSON object.

    python -m benchmarks.algorithms                        # seeds 0,1,2, the quickstart's steps
    python -m benchmarks.algorithms --seeds 0 --steps 100 --losses cispo
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.config import rl_config
from asyncrl.launch import load_config
from benchmarks.learnability import CONFIG, run_asyncrl

LOSSES = ("gspo", "cispo", "clip_cov", "kl_cov")
SHARED = ["actor.ppo_mini_batches=2"]
LOSS_OVERRIDES = {"gspo": ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
                  "cispo": ["actor.policy_loss=cispo"], "clip_cov": ["actor.policy_loss=clip_cov"],
                  "kl_cov": ["actor.policy_loss=kl_cov"]}
REACH = 0.9  # of the teacher's held-out reward


def run(name: str, seed: int, root: Path, extra: list[str], steps: int | None, timeout_s: float) -> dict[str, Any]:
    """One quickstart run with `extra` overrides; its held-out curve and wall seconds."""
    workdir = root / f"{name}_s{seed}"
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = [f"seed={seed}", f"trainer.output_dir={workdir / 'asyncrl'}", f"model.path={root / f'model_s{seed}'}",
                 *SHARED, *extra] + ([f"trainer.total_steps={steps}"] if steps else [])
    result = run_asyncrl(overrides, rl_config(load_config(CONFIG, overrides)), workdir, timeout_s)
    evals = result["evals"]
    out = {"gain": evals[-1][1] - evals[0][1], "start": evals[0][1], "end": evals[-1][1], "wall_s": round(result["wall_s"], 1),
           "evals": evals, "checkpoint": str(workdir / "asyncrl" / "checkpoints" / f"step_{result['steps']}" / "actor" / "hf")}
    print(json.dumps({"run": name, "seed": seed, **{k: v for k, v in out.items() if k != "evals"}}), flush=True)
    return out


def first_reaching(evals: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, r in evals if r >= target - 1e-9), None)


def distillation(seed: int, root: Path, grpo: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """OPD from the same student, the GRPO run's end as the teacher, for GRPO's steps to the target."""
    teacher_reward = max(r for _, r in grpo["evals"][-1:])
    target = REACH * teacher_reward
    grpo_steps = first_reaching(grpo["evals"], target)
    opd = run("opd", seed, root, ["algorithm.name=opd", f"teacher.path={grpo['checkpoint']}"], grpo_steps, timeout_s)
    opd_steps = first_reaching(opd["evals"], target)
    every = grpo["evals"][1][0] - grpo["evals"][0][0]
    return {"teacher_reward": teacher_reward, "grpo_steps": grpo_steps, "opd_steps": opd_steps,
            "opd_best": max(r for _, r in opd["evals"]), "opd_wall_s": opd["wall_s"],
            "steps_ratio": (opd_steps if opd_steps is not None else grpo_steps + every) / grpo_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the quickstart's)")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--no-opd", action="store_true")
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    losses = [x for x in args.losses.split(",") if x]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ["grpo", *losses]}
    opd: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-algorithms-") as tmp:
        root = Path(tmp)
        for seed in seeds:
            runs["grpo"].append(run("grpo", seed, root, [], args.steps, args.timeout_s))
            for loss in losses:
                runs[loss].append(run(loss, seed, root, LOSS_OVERRIDES[loss], args.steps, args.timeout_s))
            if not args.no_opd:
                opd.append(distillation(seed, root, runs["grpo"][-1], args.timeout_s))
                print(json.dumps({"opd": seed, **opd[-1]}), flush=True)
    gain = {name: statistics.mean(r["gain"] for r in rs) for name, rs in runs.items()}
    out: dict[str, Any] = {"config": CONFIG, "shared_overrides": SHARED, "seeds": seeds,
                           **{f"gain_{k}": round(v, 4) for k, v in gain.items()},
                           **{f"gain_ratio_{k}": round(gain[k] / gain["grpo"], 3) if gain["grpo"] > 0 else None
                              for k in losses},
                           **{f"wall_s_{k}": [r["wall_s"] for r in rs] for k, rs in runs.items()}}
    if opd:
        out.update(opd_reward_ratio=round(statistics.mean(o["opd_best"] / o["teacher_reward"] for o in opd), 3),
                   opd_steps_ratio=round(statistics.mean(o["steps_ratio"] for o in opd), 3),
                   opd_runs=opd)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
