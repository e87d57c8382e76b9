"""The quickstart's GRPO steps as users run them: the step, its phases, and the framework's own cost.

    python -m benchmarks.speed [--steps 60] [--runs 2] [--baseline /path/to/other/checkout] [key=value ...]

Each run is `asyncrl-launch --config-name quickstart` (the README's command: its model, data,
batch and defaults; metrics.jsonl as the record) cut to `--steps` steps, in a fresh output
directory. Reported, as medians over the steps after the first 5 of every run:
- `step_ms_median`, each phase's median (`phase_ms`: the workers' own times of generate,
  the reshard, reward, advantage, update), and `overhead_ms_median`: the step minus its
  phases, i.e. everything that is not a worker computing (the driver, RPC, pulls, waits);
- `trace_overhead_ratio`: the median step of the runs' traced steps (trainer.trace on steps
  6..15 of one more run) over the same steps untraced;
- `update_to_generate_gap_ms`: per rank, the median time a worker sat between a step's update
  and the next step's generation (what a device idles between steps), from one more run whose
  workers' spans are recorded over steps 20-50 of the trainer's own loop (`benchmarks.step_gap`);
- with `--baseline DIR` (a checkout of another commit: `git worktree add DIR <commit>`), the
  same runs of that checkout interleaved with these, and `step_ratio_vs_baseline` =
  this checkout's median step / the baseline's (same machine, same sitting), and its gap.

Trailing `key=value` overrides go to every run (e.g. `trainer.n_workers=1` on one GPU).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import USER_ENV

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps left out of the medians: the first steps warm caches and allocators
TRACED = list(range(6, 16))


def launch(checkout: Path, out: Path, steps: int, extra: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """One quickstart run of `checkout` cut to `steps` (the user's environment and `env`); its
    metrics.jsonl rows that are steps."""
    args = [sys.executable, "-c", "import sys; from asyncrl.launch import main; sys.exit(main())",
            "--config-name", "quickstart", f"trainer.output_dir={out}", f"trainer.total_steps={steps}",
            "trainer.eval_every=1000", "trainer.save_every=1000", *extra]
    env = {**USER_ENV, **(env or {}), "PYTHONPATH": str(checkout),
           "ASYNCRL_STATE_DIR": str(out.parent / f"{out.name}.state")}
    res = subprocess.run(args, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"the quickstart of {checkout} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "timing/step_s" in r]


def idle_gap(checkout: Path, tmp: Path, name: str, common: list[str]) -> list[float]:
    """Per rank, a worker's median idle between an update and the next generation (`benchmarks.step_gap`)."""
    from benchmarks import step_gap

    path = tmp / f"{name}.json"
    launch(checkout, tmp / name, step_gap.LAST + 2, [*common, f"job.entry={REPO / 'benchmarks' / 'step_gap.py'}:main"],
           {"ASYNCRL_GAP_TRACE": str(path)})
    return step_gap.gaps(path)


def busy_s(row: dict) -> float:
    """The workers' own time in a step (weight_sync repeats sync when colocated)."""
    return sum(v for k, v in row.items() if k.startswith("timing/") and k.endswith("_s")
               and k not in ("timing/step_s", "timing/overhead_s", "timing/weight_sync_s"))


def summarise(rows: list[dict]) -> dict:
    kept = [r for r in rows if r["step"] > WARMUP]
    phases = sorted({k for r in kept for k in r if k.startswith("timing/") and k not in
                     ("timing/step_s", "timing/overhead_s", "timing/weight_sync_s")})
    return {"steps": len(kept),
            "step_ms_median": 1000 * statistics.median(r["timing/step_s"] for r in kept),
            "overhead_ms_median": 1000 * statistics.median(r["timing/step_s"] - busy_s(r) for r in kept),
            "phase_ms": {p.removeprefix("timing/").removesuffix("_s"): round(1000 * statistics.median(
                r.get(p, 0.0) for r in kept), 2) for p in phases}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=2, help="runs of each checkout (interleaved)")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of another commit to compare")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. trainer.n_workers=1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncrl-speed-") as tmp:
        common = [f"model.path={Path(tmp) / 'model'}", *args.overrides]  # the quickstart's own model, built by the first run
        ours: list[dict] = []
        base: list[dict] = []
        for i in range(args.runs):
            ours += launch(REPO, Path(tmp) / f"ours{i}", args.steps, common)
            if args.baseline is not None:
                base += launch(args.baseline.resolve(), Path(tmp) / f"base{i}", args.steps, common)
        traced = launch(REPO, Path(tmp) / "traced", max(args.steps, TRACED[-1]), [*common,
                        f"trainer.trace=[{','.join(map(str, TRACED))}]"])
        traces = sorted((Path(tmp) / "traced" / "trace").glob("step_*.json"))
        gap = idle_gap(REPO, Path(tmp), "gap", common)
        base_gap = idle_gap(args.baseline.resolve(), Path(tmp), "base_gap", common) if args.baseline else None
        plain = statistics.median(r["timing/step_s"] for r in ours if r["step"] in TRACED)
        with_trace = statistics.median(r["timing/step_s"] for r in traced if r["step"] in TRACED)
    out = {"benchmark": "speed", "config": "quickstart", "overrides": args.overrides, "steps_per_run": args.steps, "runs": args.runs,
           **summarise(ours), "traced_steps": TRACED, "traced_files": len(traces),
           "traced_step_ms_median": round(1000 * with_trace, 2), "untraced_step_ms_median": round(1000 * plain, 2),
           "trace_overhead_ratio": round(with_trace / plain, 3), "update_to_generate_gap_ms": gap}
    if args.baseline is not None:
        b = summarise(base)
        out["baseline"] = {"checkout": str(args.baseline), **b, "update_to_generate_gap_ms": base_gap}
        out["step_ratio_vs_baseline"] = round(out["step_ms_median"] / b["step_ms_median"], 3)
    for k in ("step_ms_median", "overhead_ms_median"):
        out[k] = round(out[k], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
