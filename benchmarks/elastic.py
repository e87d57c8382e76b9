"""An elastic rollout pool losing a node and gaining one, across network namespaces as hosts.

Four namespaces on one bridge play four hosts: A runs `asyncrl-launch` (the coordinator and the
training worker), B and C run node daemons whose devices take the two rollout workers, and D
joins mid-run with `asyncrl-launch --join`. The job is the quickstart as users run it, split
placement with `rollout.elastic=true`, one CPU device and one torch thread per node (D: two
devices, two rollout workers). At step `--kill-at` every process of host C gets SIGKILL (its node
daemon and its rollout worker), at a moment its worker is using CPU (generating: read from
/proc, so the kill lands mid-call); at step `--join-at` host D starts. Needs root (`ip netns`).

Reported: `prompts_trained_once` (the ledger holds every step's prompts, each data row once an epoch),
rollout throughput (generated tokens / generation seconds, the steps' own numbers) before the
loss, after it and after the join, `throughput_after_loss_ratio` = (after / before) / ((N-1)/N)
for N = 2 workers, `throughput_after_join_ratio` = after the join / after the loss (3 workers then, against 1, on 2 cores),
`weight_copies_per_node` (of D's two workers, how many took a version from another host; 1: the
other took its copy through shared memory) and `weights_relayed_mb_per_sync`,
`join_to_first_generate_s` (from D's launch to the end of the first step generated with its
worker live), `weight_sync_mb_per_sync` (the median step's weight sync: what the live workers
pulled, `perf/weight_sync_mb`), the run's exit code and steps. The last line printed is one JSON
object.

    python -m benchmarks.elastic
    python -m benchmarks.elastic --steps 150 --kill-at 25 --join-at 50   # the defaults
    python -m benchmarks.elastic --weight-sync delta                     # the workers pull deltas
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from asyncrl.config import rl_config
from asyncrl.launch import load_config
from daemons.proc import kill_group
from objectstore import remove_stale_segments
from transport.auth import generate_keys

REPO = Path(__file__).resolve().parent.parent
PORT = 29400


def trained_once(ledger: list[dict], n: int, epoch: int | None = None) -> bool:
    """Whether a ledger shows steps 1..N once each, no data row drawn twice within an epoch of
    `epoch` draws (all of them when None), and each drawn prompt's `n` rows in its step's update."""
    from collections import Counter

    # by data row where the data numbers them: two rows of the synthetic set can hold the same
    # prompt text (4,096 rows, 3,370 texts), and so the same uid
    drawn = [d for row in ledger for d in (row["data_rows"] if None not in row.get("data_rows", [None]) else row["uids"])]
    epoch = epoch or len(drawn) or 1
    epochs = [drawn[i:i + epoch] for i in range(0, len(drawn), epoch)]
    steps_ok = [row["step"] for row in ledger] == list(range(1, len(ledger) + 1))
    return steps_ok and all(len(set(e)) == len(e) for e in epochs) and all(
        Counter(row["rows"]) == Counter({u: n * c for u, c in Counter(row["uids"]).items()}) for row in ledger)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def hosts(n: int):
    """`n` network namespaces on one bridge, 10.233.<k>.1 … n; removed afterwards."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.233.{os.getpid() % 200 + 20}"
    bridge, names, links = f"arlbr{tag}", [f"arl-el-{tag}-{i}" for i in range(n)], []
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _ip("link", "set", bridge, "up")
        for i, ns in enumerate(names):
            _ip("netns", "add", ns)
            outer, inner = f"arlo{tag}{i}"[:15], f"arli{tag}{i}"[:15]
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            links.append(outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield [(ns, f"{subnet}.{i + 1}") for i, ns in enumerate(names)]
    finally:
        for ns in names:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def _wait_busy(pids: list[int], timeout_s: float) -> None:
    """Until one of `pids` uses CPU in two polls in a row (a worker mid-generation), or the timeout."""
    deadline, last, busy = time.monotonic() + timeout_s, {p: _cpu_ticks(p) for p in pids}, 0
    while time.monotonic() < deadline and busy < 2:
        time.sleep(0.01)
        now = {p: _cpu_ticks(p) for p in pids}
        busy = busy + 1 if any(now[p] > last[p] for p in pids) else 0
        last = now


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if '"actor/pg_loss"' in x]


def _throughput(rows: list[dict[str, Any]]) -> float | None:
    gen = sum(r["timing/gen_s"] for r in rows)
    return sum(r["response/tokens"] for r in rows) / gen if gen > 0 and rows else None


def run(steps: int, kill_at: int, join_at: int, timeout_s: float, weight_sync: str = "full") -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="asyncrl-elastic-") as tmp_dir, hosts(4) as nets:
        tmp = Path(tmp_dir)
        keys = tmp / "keys"
        generate_keys(keys)
        (a, ip_a), (b, ip_b), (c, ip_c), (d, ip_d) = nets
        out = tmp / "run"
        env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(REPO)}
        launch = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart"]
        common = [f"cluster.key_dir={keys}", "cluster.cpu_devices=1", "cluster.nnodes=3"]

        def node(ns: str, args: list[str], log: str) -> subprocess.Popen:
            with (tmp / log).open("w") as err:
                return subprocess.Popen(["ip", "netns", "exec", ns, *launch, *args], stdout=subprocess.PIPE,
                                        stderr=err, text=True, cwd=REPO, env=env, start_new_session=True)

        head = node(a, [*common, f"cluster.host={ip_a}", f"cluster.port={PORT}", f"cluster.log_dir={tmp / 'logs-a'}",
                        f"trainer.output_dir={out}", f"model.path={tmp / 'model'}", f"trainer.total_steps={steps}",
                        f"trainer.eval_every={steps}", f"trainer.save_every={steps}", "trainer.placement=split",
                        "trainer.n_workers=1", "rollout.n_workers=2", "rollout.elastic=true",
                        "trainer.torch_threads=1", "trainer.loggers=[jsonl]", f"rollout.weight_sync={weight_sync}"],
                    "a.log")
        others = [node(ns, [*common, f"cluster.coordinator={ip_a}:{PORT}", f"cluster.node_rank={rank}",
                            f"cluster.host={ip}", f"cluster.log_dir={tmp / f'logs-{rank}'}"], f"{rank}.log")
                  for rank, (ns, ip) in ((1, (b, ip_b)), (2, (c, ip_c)))]
        joiner, t_join, joined_s = None, None, None
        deadline = time.monotonic() + timeout_s
        try:
            while head.poll() is None and time.monotonic() < deadline:
                done = _steps(out)
                if len(done) >= kill_at and others[1].poll() is None:  # host C is lost: every process in it,
                    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", c], capture_output=True,
                                                           text=True).stdout.split()]
                    _wait_busy(pids, timeout_s=5.0)  # while its rollout worker is generating (on CPU)
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    others[1].wait(10)
                if len(done) >= join_at and joiner is None:
                    t_join = time.monotonic()
                    joiner = node(d, ["--join", f"{ip_a}:{PORT}", f"cluster.key_dir={keys}", "cluster.cpu_devices=2",
                                      f"cluster.host={ip_d}", f"cluster.log_dir={tmp / 'logs-d'}"], "d.log")
                if joined_s is None and t_join is not None and done and done[-1].get("rollout/workers_joined", 0) >= 1 \
                        and done[-1]["rollout/workers"] >= 2:
                    joined_s = time.monotonic() - t_join
                time.sleep(0.1)
            stdout, _ = head.communicate(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in [head, *others, *([joiner] if joiner else [])]:
                kill_group(p, grace_s=5)
            remove_stale_segments()
        rows = _steps(out)
        ledger = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()] if (out / "ledger.jsonl").exists() else []
        cfg = rl_config(load_config("quickstart", []))
        n, epoch = cfg.rollout.n, cfg.data.synthetic.n_train  # 4,096 rows: 150 steps of 32 draw 4,800
        lost_at = next((r["step"] for r in rows if r["rollout/workers_lost"] >= 1), None)
        joined_at = next((r["step"] for r in rows if r["rollout/workers_joined"] >= 1), None)
        before = [r for r in rows if r["step"] < (lost_at or 1 << 30) and r["step"] > 1]  # step 1: warm-up
        after_loss = [r for r in rows if lost_at and lost_at < r["step"] < (joined_at or 1 << 30)]
        after_join = [r for r in rows if joined_at and r["step"] > joined_at]
        tp = {k: _throughput(v) for k, v in (("before", before), ("after_loss", after_loss), ("after_join", after_join))}
        summary = json.loads(stdout.strip().splitlines()[-1]) if head.returncode == 0 else {}
        return {
            "exit_code": head.returncode, "steps": summary.get("steps"), "weight_sync": weight_sync, "lost_at_step": lost_at, "joined_at_step": joined_at,
            "prompts_trained_once": len(ledger) == len(rows) == steps and trained_once(ledger, n, epoch),
            **{f"throughput_{k}_tok_s": round(v, 1) if v else None for k, v in tp.items()},
            "weight_sync_mb_per_sync": round(statistics.median(r["perf/weight_sync_mb"] for r in rows), 3) if rows else None,
            "throughput_after_loss_ratio": round(tp["after_loss"] / tp["before"] / 0.5, 3)
            if tp["after_loss"] and tp["before"] else None,
            "throughput_after_join_ratio": round(tp["after_join"] / tp["after_loss"], 3)
            if tp["after_join"] and tp["after_loss"] else None,
            "join_to_first_generate_s": round(joined_s, 2) if joined_s is not None else None,
            "regenerated_prompts": rows[-1]["rollout/regenerated_prompts"] if rows else None,
            # host D's two workers: how many of them took each version from another host (1: one
            # pulled, the other took its copy through shared memory), and what that copy was
            "weight_copies_per_node": max((r["rollout/weight_copies_per_node"] for r in after_join), default=None),
            "weights_relayed_mb_per_sync": round(statistics.median(r["rollout/weights_relayed_mb"] for r in after_join), 3)
            if after_join else None,
            "head_log_tail": None if head.returncode == 0 else (tmp / "a.log").read_text()[-1500:],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-at", type=int, default=25)
    p.add_argument("--join-at", type=int, default=50)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--weight-sync", choices=["full", "delta"], default="full", help="rollout.weight_sync")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks.elastic needs root for `ip netns` (network namespaces as hosts)")
    print(json.dumps(run(args.steps, args.kill_at, args.join_at, args.timeout_s, args.weight_sync)))


if __name__ == "__main__":
    main()
