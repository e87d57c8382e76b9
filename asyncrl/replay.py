"""`asyncrl replay RUN_DIR --step N`: re-run a training step's actor update from what the run kept.

The run must have kept replay bundles (`trainer.replay.window` > 0, asyncrl.roles.replay) for
step N and every step after the complete checkpoint it starts from. The replay is a job of the
run's own configuration (`trainer.mode=replay`, the same workers and layout): the checkpoint
loaded, the updates from it up to N re-run from their bundles, and each step's loss, gradient
norm, metrics and weights compared with the run's, bit for bit. Optionally step N's old
log-probs are recomputed (`--log-probs`) and the first non-finite activation named
(`--nonfinite`, with `--plant-nan MODULE@MICRO_BATCH` to test it).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from asyncrl.roles.replay import ReplayError, kept_steps
from asyncrl.rundir import CONFIG_FILE, complete_checkpoints

log = logging.getLogger(__name__)


async def replay_run(trainer: Any) -> dict[str, Any]:
    """The driver of trainer.mode=replay, on a set-up `Trainer`: the summary of the comparison."""
    cfg, out_dir = trainer.cfg, Path(trainer.cfg.trainer.output_dir)
    step = cfg.trainer.replay.step
    start = replay_start(out_dir, step, trainer.roles.actor.world_size)
    log.info("replaying step %d of %s from %s", step, out_dir, f"checkpoint step_{start}" if start else "the model")
    if start:
        await trainer.load(out_dir / "checkpoints" / f"step_{start}")
    results = []
    for s in range(start + 1, step + 1):
        per_rank = await trainer.roles.actor.replay_update(s, s == step)
        results.append(compare(s, per_rank))
    last = per_rank
    summary = {"replay_step": step, "from_checkpoint": start, "replayed_steps": len(results),
               **{k: all(r[k] for r in results) for k in ("loss_equal", "grad_norm_equal", "metrics_equal",
                                                          "weights_equal")},
               "first_difference": next((r["differences"] for r in results if r["differences"]), None),
               "steps": results}
    summary["bit_exact"] = all(summary[k] for k in ("loss_equal", "grad_norm_equal", "metrics_equal", "weights_equal"))
    if "old_log_probs_equal" in last[0]:
        seen = [r["old_log_probs_equal"] for r in last]
        summary["old_log_probs_equal"] = None if None in seen else all(seen)
    if "nonfinite" in last[0]:
        found = [dict(r["nonfinite"], rank=rank) for rank, r in enumerate(last) if r["nonfinite"]]
        summary["nonfinite"] = min(found, key=lambda f: (f["micro_batch"], f["rank"])) if found else None
    return summary


def replay_start(out_dir: Path, step: int, ranks: int) -> int:
    """The step of the newest complete checkpoint before `step` (0: the model as loaded) from which
    every step up to `step` has its bundles on all `ranks` ranks; ReplayError when none does."""
    kept = set(kept_steps(out_dir, ranks))
    saved = [int(p.name.removeprefix("step_")) for p in complete_checkpoints(out_dir)]
    starts = [c for c in (0, *saved) if c < step and all(s in kept for s in range(c + 1, step + 1))]
    if not starts:
        raise ReplayError(
            f"step {step} of {out_dir} cannot be replayed: it needs a complete checkpoint before it (kept: "
            f"{saved or 'none'}) and the replay bundles of every step after that one up to {step} on all {ranks} "
            f"training ranks (kept: {sorted(kept) or 'none'}). Keep more steps (trainer.replay.window at least "
            "trainer.save_every) or replay a step the window still holds")
    return max(starts)


def compare(step: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One replayed step against the run: which of its values are bit for bit the same."""
    differences = []
    for rank, r in enumerate(per_rank):
        was, now = r["recorded"]["metrics"], r["metrics"]
        for key in sorted(set(was) | set(now)):
            a, b = was.get(key), now.get(key)
            if not _same(a, b):
                differences.append({"step": step, "rank": rank, "what": key, "run": a, "replay": b})
        if r["recorded"]["weights"] != r["weights"]:
            differences.append({"step": step, "rank": rank, "what": "weights", "run": r["recorded"]["weights"][:16],
                                "replay": r["weights"][:16]})
    keys = {d["what"] for d in differences}
    return {"step": step, "loss_equal": not any("loss" in k for k in keys),
            "grad_norm_equal": not any("grad_norm" in k for k in keys), "metrics_equal": not keys - {"weights"},
            "weights_equal": "weights" not in keys, "differences": differences[:8]}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# the command --------------------------------------------------------------------------------------
def command(args: argparse.Namespace) -> int:
    """Compose the run's recorded configuration as a replay job and run it as asyncrl-launch does."""
    from asyncrl.launch import main as launch

    run = Path(args.run_dir).resolve()
    recorded = run / CONFIG_FILE
    bad = [o for o in args.cluster if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        print(f"asyncrl replay: --cluster {bad[0]!r}: give KEY=VALUE of the cluster section (e.g. host=127.0.0.1); "
              "what the step ran with is the run's recorded configuration", file=sys.stderr)
        return 2
    if not recorded.is_file():
        print(f"asyncrl replay: {run} is not a run directory (no {CONFIG_FILE}); give the trainer.output_dir of a "
              "run that kept replay bundles", file=sys.stderr)
        return 2
    cfg = yaml.safe_load(recorded.read_text())
    cfg["trainer"].update(output_dir=str(run), mode="replay")
    # the replay's worker logs apart from the run's (a node keeps only its newest job folders), and
    # nothing of Hydra's written over the run's .hydra
    cfg["cluster"]["log_dir"] = str(run / "replay" / "logs")
    cfg["hydra"] = {"output_subdir": None}
    cfg["trainer"]["replay"] = {**cfg["trainer"].get("replay", {}), "step": args.step, "log_probs": args.log_probs,
                                "nonfinite": args.nonfinite or bool(args.plant_nan), "plant_nan": args.plant_nan}
    with tempfile.TemporaryDirectory(prefix="asyncrl-replay-") as tmp:
        (Path(tmp) / "replay.yaml").write_text(yaml.safe_dump({"defaults": ["rl_defaults", "_self_"], **cfg},
                                                               sort_keys=False))
        return launch(["--config-dir", tmp, "--config-name", "replay", *(f"cluster.{o}" for o in args.cluster)])
