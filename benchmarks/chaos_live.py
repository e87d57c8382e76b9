"""Live chaos on this machine (localhost, bounded, ~80 s): the faults of issue 13 items 4 and 5.

    python -m benchmarks.chaos_live

- `stall_8s_ok`: a job whose driver blocks its event loop for 8 s (`time.sleep` in `async def`),
  with nodes declared dead after 2 s of silence, still succeeds, and a warning names the stall.
- `blamed_rank_correct`: one rank of a two-rank gloo all-reduce loop is killed with SIGKILL, three
  times; how many times the error was `WorkerDiedError` naming that rank (`blame_s`: how long
  after the kill each error came).
- `head_loss_exit_s`: seconds from kill -9 of a two-node job's head until node 1's
  `asyncrl-launch` exits, against its `cluster.head_loss_timeout_s` (the limit, reported as
  `head_loss_timeout_s`; `head_loss_ratio` is the one over the other).

Every process started is ended by process group; the last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.jobs import faults

REPO = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "asyncrl.launch", "--config-name", "smoke"]
STALL_S = 8.0
HEAD_LOSS_TIMEOUT_S = 5.0


def _start(argv: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(out, "wb") as f:
        return subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stall(tmp: Path) -> dict[str, Any]:
    out = tmp / "stall.out"
    proc = _start(LAUNCH + ["job.entry=asyncrl.jobs.faults:stall", "cluster.node_timeout_s=2",
                            "cluster.heartbeat_interval_s=0.3", f"cluster.log_dir={tmp}/stall-logs",
                            f"hydra.run.dir={tmp}/stall-run"],
                  out, {"ASYNCRL_STATE_DIR": str(tmp / "state-stall"), faults.STALL_ENV: str(STALL_S)})
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _end(proc)
    text = out.read_text(errors="replace")
    warned = f"event loop was blocked for {STALL_S:.0f}." in text
    return {"stall_8s_ok": rc == 0 and warned and '"same_workers": true' in text, "stall_warning": warned}


async def _blame(tmp: Path, attempts: int = 3) -> dict[str, Any]:
    from asyncrl.single_controller.context import local_cluster
    from daemons.errors import WorkerDiedError

    right, seconds = 0, []
    async with local_cluster(cpu_devices=2 * attempts, log_dir=tmp / "blame-logs", insecure=True) as ctx:
        pools = [ctx.create_pool(f"p{attempt}", world_size=2) for attempt in range(attempts)]
        groups = await asyncio.gather(*(ctx.spawn_group(p, faults.Collective) for p in pools))
        all_pids = await asyncio.gather(*(g.setup() for g in groups))
        for attempt, (group, pids) in enumerate(zip(groups, all_pids, strict=True)):
            victim = attempt % 2
            call = group.allreduce_for(60.0)
            await asyncio.sleep(0.5)
            os.kill(pids[victim], signal.SIGKILL)
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(call, 30)
            except WorkerDiedError as e:
                right += e.rank == victim
            except Exception:  # blamed on the wrong rank or error: counted as wrong
                pass
            seconds.append(round(time.monotonic() - t0, 2))
    return {"blamed_rank_correct": f"{right} of {attempts}", "blame_s": seconds}


def blame(tmp: Path) -> dict[str, Any]:
    from transport.loop import run

    return run(_blame(tmp))


def head_loss(tmp: Path) -> dict[str, Any]:
    from daemons.proc import free_port

    port = free_port()
    env = {"ASYNCRL_STATE_DIR": str(tmp / "state-head")}
    common = ["cluster.nnodes=2", "cluster.insecure=true", "cluster.cpu_devices=1", "cluster.host=127.0.0.1"]
    out0, out1 = tmp / "head.out", tmp / "node1.out"
    head = _start(LAUNCH + ["job.entry=asyncrl.jobs.smoke:hold", *common, f"cluster.port={port}",
                            f"cluster.log_dir={tmp}/logs0", f"hydra.run.dir={tmp}/run0"], out0, env)
    node = _start(LAUNCH + [*common, f"cluster.coordinator=127.0.0.1:{port}", "cluster.node_rank=1",
                            f"cluster.head_loss_timeout_s={HEAD_LOSS_TIMEOUT_S:g}",
                            f"cluster.log_dir={tmp}/logs1", f"hydra.run.dir={tmp}/run1"], out1, env)
    took = None
    try:
        deadline = time.monotonic() + 60
        while "holding 2 workers" not in out0.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the two-node job did not start:\n{out0.read_text()}\n{out1.read_text()}")
            time.sleep(0.1)
        os.killpg(head.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            node.wait(timeout=HEAD_LOSS_TIMEOUT_S + 20)
            took = round(time.monotonic() - t0, 2)
        except subprocess.TimeoutExpired:
            pass
    finally:
        _end(head)
        _end(node)
    return {"head_loss_exit_s": took, "head_loss_timeout_s": HEAD_LOSS_TIMEOUT_S,
            "head_loss_ratio": None if took is None else round(took / HEAD_LOSS_TIMEOUT_S, 2)}


def run() -> dict[str, Any]:
    """Run the three scenarios; returns their measurements."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chaos-live-") as d:
        tmp = Path(d)
        result: dict[str, Any] = {}
        for name, scenario in (("stall", stall), ("blame", blame), ("head_loss", head_loss)):
            t1 = time.monotonic()
            result.update(scenario(tmp))
            result[f"{name}_wall_s"] = round(time.monotonic() - t1, 1)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
