"""`asyncrl inspect` on a long run: the first page of a generated 10,000-step run directory.

    python -m benchmarks.inspect [--steps 10000] [--rows 32]

Writes a run directory as a long quickstart-shaped run leaves it — `metrics.jsonl` (46 metrics a
step), the kept rollouts (`--rows` a step over 2 ranks, a parquet file per rank every 10 steps,
asyncrl.roles.kept_rollouts' schema), `samples.jsonl` (an evaluation every 25 steps) — starts
`asyncrl inspect` on it as users do (its own process, `--port 0`), and times over HTTP, cold: the
runs page, the rollout table's first page, a metric's curve, one rollout, and a table sorted by
reward over every step (all files read), then the same warm; the server's memory after all of them
(peak RSS). The reference in the same run: reading the run's kept rollouts whole with pandas (what
a user without the inspector does). One JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

METRIC_KEYS = 46
FLUSH = 10
WORDS = ["sort", "the", "numbers", "answer", "<|user|>", "<|assistant|>", "<eos>", *map(str, range(10))]


def write_run(out: Path, steps: int, rows: int = 32, ranks: int = 2, eval_every: int = 25, seed: int = 0,
              multi_turn: bool = False) -> Path:
    """A run directory as asyncrl writes it, with random numbers (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    (out / "config.yaml").write_text(f"model:\n  path: null\ntrainer:\n  keep_rollouts: {rows}\n")
    _metrics(out / "metrics.jsonl", steps, eval_every, rng)
    _samples(out / "samples.jsonl", steps, eval_every, rng)
    for rank in range(ranks):
        for first in range(1, steps + 1, FLUSH):
            _rollout_file(out, rank, first, min(steps, first + FLUSH - 1), rows // ranks, rng, multi_turn)
    return out


def _metrics(path: Path, steps: int, eval_every: int, rng: random.Random) -> None:
    names = ["critic/score_mean", "response/length_mean", "actor/entropy", "actor/pg_loss"]
    names += [f"perf/metric_{k}" for k in range(METRIC_KEYS - len(names))]
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "val/reward": 0.0}) + "\n")
        for s in range(1, steps + 1):
            row = {"step": s, **{k: rng.random() + s / steps for k in names}}
            if s % eval_every == 0:
                row.update({"val/reward": s / steps, "eval/all/pass@1": s / steps, "eval/all/pass@4": min(1, 2 * s / steps)})
            f.write(json.dumps(row) + "\n")


def _samples(path: Path, steps: int, eval_every: int, rng: random.Random) -> None:
    with open(path, "w") as f:
        for s in range(0, steps + 1, eval_every):
            for i in range(3):
                f.write(json.dumps({"step": s, "prompt_index": i, "sample": 0, "data_source": "synthetic/sort",
                                    "ground_truth": "1 2 3", "score": rng.random(), "prompt": "sort 3 1 2",
                                    "response": "1 2 3"}) + "\n")


def _rollout_file(out: Path, rank: int, first: int, last: int, per_step: int, rng: random.Random,
                  multi_turn: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.roles.kept_rollouts import schema

    cols: dict[str, list] = {f.name: [] for f in schema()}
    for step in range(first, last + 1):
        for row in range(per_step):
            n = rng.randint(4, 24)
            ids = [rng.randrange(len(WORDS)) for _ in range(n)]
            mask = [0 if multi_turn and n // 3 <= j < n // 2 else 1 for j in range(n)]
            roll = [-rng.random() * 3 for _ in range(n)]
            values = {"step": step, "rank": rank, "row": row, "uid": f"{step}-{rank}-{row}",
                      "data_source": ("synthetic/sort", "synthetic/count")[row % 2],
                      "prompt": "sort " + " ".join(str(rng.randrange(10)) for _ in range(4)),
                      "response": " ".join(WORDS[i] for i in ids), "response_ids": ids, "model_token": mask,
                      "reward": rng.choice([0.0, 0.25, 0.5, 1.0]), "reward_parts": json.dumps({"acc": rng.random()}),
                      "advantage": rng.gauss(0, 1), "response_length": sum(mask),
                      "finish_reason": rng.choice(["stop", "length"]), "weights_version": step - 1, "staleness": 0,
                      "num_turns": 2.0 if multi_turn else None, "tool_calls": 1.0 if multi_turn else None,
                      "tool_errors": 0.0 if multi_turn else None, "env_errors": None,
                      "rollout_log_probs": roll, "trainer_log_probs": [x + rng.gauss(0, 0.01) for x in roll],
                      "advantages": [rng.gauss(0, 1)] * n}
            for k, v in values.items():
                cols[k].append(v)
    path = out / "rollouts" / f"rank{rank}" / f"steps_{first:07d}-{last:07d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(cols, schema=schema()), path, compression="zstd")


def start_inspector(run_dirs: list[Path], *extra: str, env: dict[str, str] | None = None
                    ) -> tuple[subprocess.Popen, str]:
    """`asyncrl inspect RUN_DIR... --port 0` in its own process group; returns it and its URL."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "inspect", *map(str, run_dirs), "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"at (http://\S+)", line)
        if m:
            return proc, m[1]
    stop_inspector(proc)
    raise RuntimeError("asyncrl inspect did not print its URL:\n" + "".join(lines))


def stop_inspector(proc: subprocess.Popen) -> None:
    """End the inspector's process group (SIGTERM, then SIGKILL)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def timed_get(url: str) -> tuple[float, int, int]:
    """Seconds for a whole response, its status and its size."""
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            body, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    return time.perf_counter() - t0, status, len(body)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(run: Path, steps: int) -> dict:
    proc, url = start_inspector([run])
    pages = {"runs_page": "", "rollout_table": "runs/0/rollouts", "curve": "api/series?key=critic/score_mean",
             "one_rollout": f"runs/0/rollouts/{steps}/1/3", "evaluations": "runs/0/evals",
             "table_by_reward_all_steps": "runs/0/rollouts?sort=-reward",
             "text_search_last_100_steps": f"runs/0/rollouts?text=answer&step_min={steps - 99}"}
    try:
        cold = {name: timed_get(url + p) for name, p in pages.items()}
        warm = {name: timed_get(url + p) for name, p in pages.items()}
        rss = peak_rss_mib(proc.pid)
    finally:
        stop_inspector(proc)
    bad = {n: s for n, (_, s, _) in {**cold, **warm}.items() if s != 200}
    if bad:
        raise RuntimeError(f"pages that did not answer 200: {bad}")
    return {"cold_s": {n: round(t, 3) for n, (t, _, _) in cold.items()},
            "warm_s": {n: round(t, 3) for n, (t, _, _) in warm.items()},
            "page_bytes": {n: b for n, (_, _, b) in cold.items()}, "server_peak_rss_mib": round(rss, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=32, help="kept rollouts a step (trainer.keep_rollouts)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="inspect-bench-") as tmp:
        t0 = time.perf_counter()
        run = write_run(Path(tmp) / "run", args.steps, args.rows)
        written = time.perf_counter() - t0
        files = list(run.rglob("*.parquet"))
        size = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
        result = measure(run, args.steps)
        import pandas as pd

        t0 = time.perf_counter()
        whole = pd.concat([pd.read_parquet(f) for f in files])
        pandas_s = time.perf_counter() - t0
    first = max(result["cold_s"]["runs_page"], result["cold_s"]["rollout_table"])
    print(json.dumps({"steps": args.steps, "kept_rows": len(whole), "rollout_files": len(files),
                      "run_dir_mb": round(size / 1e6, 1), "generated_s": round(written, 1), **result,
                      "first_page_s": first, "first_page_under_1s": first <= 1.0,
                      "memory_under_300mb": result["server_peak_rss_mib"] <= 300,
                      "pandas_read_all_rollouts_s": round(pandas_s, 2),
                      "first_page_vs_pandas_read": round(pandas_s / first, 1)}))


if __name__ == "__main__":
    main()
