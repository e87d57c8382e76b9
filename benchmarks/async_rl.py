"""Synchronous vs asynchronous RL on the same devices, same task, same number of samples.

Each run is `python -m asyncrl.launch --config-name quickstart ...` in a subprocess, exactly as a
user runs it (coordinator, node daemon, worker processes, object store, checkpoints), on a task
whose answers have long-tailed lengths (`copy_tail`: most 1-4 symbols, one in seven 5-16):

- `sync`: today's default, every role colocated on `--devices` workers, generation → scoring →
  update in order (`rollout.max_staleness=0`);
- `sync_reseeded`: the same with seed + 1, for how much held-out rewards differ by chance
  (`reward_noise`);
- `split_k0`: training on `--devices - 1` workers, generation on 1 (`trainer.placement=split`),
  still synchronous: the same pools, nothing overlapped;
- `async_kK` for K in `--ks`: the split pools with generation running up to K policy versions
  ahead of training, the weights broadcast from the training pool after each update and loaded
  between decode steps (`rollout.interrupt_on_update`), the decoupled PPO objective
  (`actor.policy_loss=decoupled`), continuous batching on the rollout worker.

Every run trains the same `--steps` steps of the same batch (the same number of samples) from the
same initial model. Reported per run: the training loop's seconds (the sum of `timing/step_s`,
evaluations and checkpoints excluded), generated response tokens per second, mean step seconds,
the largest staleness seen and the held-out reward (greedy, 128 prompts) at the end; then
`speedup_kK` = loop seconds of `sync` / those of `async_kK`, `speedup_best`, `reward_sync` and
`reward_async_best` (the held-out reward of the fastest async run). The last line printed is
one JSON object.

    python -m benchmarks.async_rl                       # the README's numbers
    python -m benchmarks.async_rl --steps 20 --ks 1     # a quick look

`--serial-sync` adds, for every K, the same run with the weight sync between the steps
(`trainer.overlap_weight_sync=false`) instead of beside the next step's training, and reports
`overlap_speedup_kK` = its loop seconds / the overlapped run's; each run reports what the loop
waited for syncs (`weight_sync_wait_s`) and what they took (`weight_sync_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daemons.proc import kill_group
from objectstore import remove_stale_segments

REPO = Path(__file__).resolve().parent.parent
TASK = "copy_tail"


def recipe(workdir: Path, steps: int, seed: int, hidden: int, layers: int, extra: list[str]) -> list[str]:
    """The overrides every run shares: the model, the task and the number of samples."""
    return [f"seed={seed}", f"model.path={workdir / 'model'}", f"model.build_tiny.task={TASK}",
            f"model.build_tiny.hidden={hidden}", f"model.build_tiny.layers={layers}",
            f"data.synthetic.task={TASK}", "rollout.max_tokens=17", f"trainer.total_steps={steps}",
            f"trainer.eval_every={steps}", f"trainer.save_every={steps}", "trainer.loggers=[console,jsonl]", *extra]


def runs(devices: int, ks: list[int], seed: int, serial_sync: bool = False) -> dict[str, list[str]]:
    split = ["trainer.placement=split", f"trainer.n_workers={devices - 1}", "rollout.n_workers=1"]
    # the same synchronous run with another seed: how far held-out rewards differ by chance
    out = {"sync": [f"trainer.n_workers={devices}"], "sync_reseeded": [f"trainer.n_workers={devices}", f"seed={seed + 1}"],
           "split_k0": split}
    for k in ks:  # interruptible rollouts, and the objective for stale samples
        out[f"async_k{k}"] = [*split, f"rollout.max_staleness={k}", "rollout.interrupt_on_update=true",
                              "actor.policy_loss=decoupled"]
        if serial_sync:  # the weight sync between the steps instead of beside the next one
            out[f"async_k{k}_serial_sync"] = [*out[f"async_k{k}"], "trainer.overlap_weight_sync=false"]
    return out


def launch(name: str, overrides: list[str], workdir: Path, timeout_s: float,
           config: str = "quickstart") -> dict[str, Any]:
    """One run in its own process group; its summary and per-step metrics."""
    out_dir = workdir / name
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", config, *overrides,
           f"trainer.output_dir={out_dir}", "trainer.resume=none"]
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(workdir / "state")}
    stdout, stderr = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
    proc: subprocess.Popen | None = None
    t0 = time.monotonic()
    try:
        with stdout.open("w") as o, stderr.open("w") as e:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=o, stderr=e, start_new_session=True)
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"run {name} ran past --timeout-s={timeout_s:.0f}")
            time.sleep(0.5)
    finally:
        if proc is not None:
            kill_group(proc, grace_s=15)
        remove_stale_segments()
    if proc.returncode != 0:
        tail = "\n".join(stderr.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    summary = json.loads([ln for ln in stdout.read_text().splitlines() if ln.strip()][-1])
    rows = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if r["step"] > 0]
    loop_s = sum(r["timing/step_s"] for r in steps)
    tokens = sum(r.get("response/tokens", 0.0) for r in steps)
    return {"loop_s": round(loop_s, 2), "tokens_per_s": round(tokens / loop_s, 1),
            "step_s": round(loop_s / len(steps), 3),
            "max_staleness_seen": max(r.get("async/staleness", 0.0) for r in steps),
            "response_len": round(sum(r.get("response/length_mean", 0.0) for r in steps) / len(steps), 2),
            "reward_end": summary["val_reward_end"], "reward_start": summary["val_reward_start"],
            "logprob_diff_max": max(r.get("rollout/logprob_diff_max", 0.0) for r in steps),
            # split placement: what the loop waited for weight syncs, and what they took in all
            "weight_sync_wait_s": round(sum(r.get("timing/weight_sync_s", 0.0) for r in steps), 3),
            "weight_sync_s": round(sum(r.get("perf/weight_sync_s", 0.0) for r in steps), 3),
            "wall_s": round(time.monotonic() - t0, 1)}


def summarize(results: dict[str, dict], ks: list[int]) -> dict[str, Any]:
    sync = results["sync"]
    out: dict[str, Any] = {"benchmark": "async_rl", "task": TASK}
    speed = {k: sync["loop_s"] / results[f"async_k{k}"]["loop_s"] for k in ks}
    for k, v in speed.items():
        out[f"speedup_k{k}"] = round(v, 3)
    best = max(speed, key=speed.get)
    out.update({"speedup_best": round(speed[best], 3), "best_k": best,
                "speedup_split_k0": round(sync["loop_s"] / results["split_k0"]["loop_s"], 3),
                "reward_sync": sync["reward_end"], "reward_async_best": results[f"async_k{best}"]["reward_end"],
                "reward_noise": round(abs(sync["reward_end"] - results["sync_reseeded"]["reward_end"]), 4),
                "runs": results})
    for k in ks:  # --serial-sync: the same run with the sync between the steps
        if f"async_k{k}_serial_sync" in results:
            out[f"overlap_speedup_k{k}"] = round(results[f"async_k{k}_serial_sync"]["loop_s"] / results[f"async_k{k}"]["loop_s"], 3)
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps of every run (default: the quickstart's 300)")
    p.add_argument("--ks", default="1,2,4", help="max_staleness values of the async runs")
    p.add_argument("--devices", type=int, default=2, help="CPU workers every run uses in all (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="tiny model width (default: the quickstart's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit on one run")
    p.add_argument("--serial-sync", action="store_true",
                   help="also each async run with trainer.overlap_weight_sync=false (overlap_speedup_kK)")
    p.add_argument("extra", nargs="*", help="more overrides for every run (key=value)")
    a = p.parse_args(argv)
    ks = [int(k) for k in a.ks.split(",") if k.strip()]
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a terminated benchmark still cleans up
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-async-rl-") as tmp:
            workdir = Path(tmp)
            shared = recipe(workdir, a.steps, a.seed, a.hidden, a.layers, a.extra)
            results = {}
            for name, overrides in runs(a.devices, ks, a.seed, a.serial_sync).items():
                print(f"[{name}] python -m asyncrl.launch --config-name quickstart {' '.join(shared + overrides)}",
                      flush=True)
                results[name] = launch(name, shared + overrides, workdir, a.timeout_s)
                print(f"[{name}] {json.dumps(results[name])}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(summarize(results, ks)))


if __name__ == "__main__":
    main()
