"""Many jobs on one machine (issue 13, item 6), as a bounded scenario on localhost.

    python -m benchmarks.chaos_jobs

Three `asyncrl-launch` jobs start at once with one state directory and one log directory: two
hold their workers until stopped, the third runs the smoke job to its end. Then `asyncrl
status` must list the two held jobs, `asyncrl stop` without `--job` must refuse and list them,
`asyncrl stop --job A` must end A (its workers gone) while B keeps running (its workers alive,
its status answered), and every job must leave its own log directory and no state file behind.
`two_jobs_ok` is true when all of that held. `stale_status_s` is how long `asyncrl status`
takes (in process, after imports) when a killed job left its state file behind, next to the
call timeout it used to wait out (`previous_status_timeout_s`). Every process started here is killed
by its process group at the end. The last line printed is one JSON object.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "asyncrl.launch"]
CLI = [sys.executable, "-m", "asyncrl.cli"]
DEADLINE_S = 80.0


class _Job:
    """One launched job: output collected by a thread, its process group killed at the end."""

    def __init__(self, name: str, entry: str, env: dict[str, str], logs: Path) -> None:
        argv = LAUNCH + ["--config-name", "smoke", f"job.name={name}", f"job.entry={entry}",
                         f"cluster.log_dir={logs}", f"hydra.run.dir={logs.parent / name}",
                         "smoke.rows=256", "smoke.cols=16"]
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.out: list[str] = []
        self._reader = threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def text(self) -> str:
        return "".join(self.out)

    def wait_for(self, text: str, deadline: float) -> bool:
        while text not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return text in self.text()
            time.sleep(0.1)
        return True

    def finish(self, deadline: float) -> int | None:
        try:
            return self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(5)


def _alive(pid: int) -> bool:
    from daemons.state import process_start

    return process_start(pid) is not None


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def _two_jobs(tmp: Path, checks: dict[str, bool]) -> None:
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    logs = tmp / "logs"
    deadline = time.monotonic() + DEADLINE_S
    jobs = [_Job("held-a", "asyncrl.jobs.smoke:hold", env, logs),
            _Job("held-b", "asyncrl.jobs.smoke:hold", env, logs),
            _Job("finishing", "asyncrl.jobs.smoke:main", env, logs)]
    a, b, finishing = jobs
    try:
        checks["both_held"] = all(j.wait_for("holding 2 workers", deadline) for j in (a, b))
        checks["third_finished"] = finishing.finish(deadline) == 0
        if not checks["both_held"]:
            return
        listed = json.loads(_cli(env, "status", "--json").stdout or "{}").get("jobs", [])
        ids = {j["name"]: j["job_id"] for j in listed}
        checks["status_lists_both"] = sorted(ids) == ["held-a", "held-b"]
        if not checks["status_lists_both"]:
            return
        ambiguous = _cli(env, "stop")
        checks["stop_asks_which"] = ambiguous.returncode == 2 and ids["held-a"] in ambiguous.stderr
        pids = {n: [w["pid"] for w in json.loads(_cli(env, "status", "--json", "--job", i).stdout)["workers"]]
                for n, i in ids.items()}
        checks["stop_one"] = _cli(env, "stop", "--job", ids["held-a"]).returncode == 0
        checks["stopped_job_ended"] = a.finish(deadline) == 1 and not any(_alive(p) for p in pids["held-a"])
        other = _cli(env, "status", "--json", "--job", ids["held-b"])
        checks["other_job_unaffected"] = (
            b.proc.poll() is None and other.returncode == 0 and all(_alive(p) for p in pids["held-b"])
            and [w["state"] for w in json.loads(other.stdout)["workers"]] == ["ready", "ready"])
        checks["stop_other"] = _cli(env, "stop", "--job", ids["held-b"]).returncode == 0 and b.finish(deadline) == 1
        checks["no_state_left"] = list((tmp / "state").glob("*.json")) == []
        checks["own_log_dirs"] = sorted(len(list(d.glob("worker-*.log"))) for d in logs.iterdir()) == [2, 2, 2]
    finally:
        for j in jobs:
            j.kill()


def _stale_status(tmp: Path) -> float:
    """Seconds `asyncrl status` takes (in process) with a killed job's state file left behind."""
    from asyncrl import cli
    from daemons.state import ClusterState, StateKind, write_state

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    saved = os.environ.get("ASYNCRL_STATE_DIR")
    os.environ["ASYNCRL_STATE_DIR"] = str(tmp / "stale")
    try:
        write_state(ClusterState("tcp://127.0.0.1:9", dead.pid, True, None, "killed-1", "killed", StateKind.JOB,
                                 time.time(), pid_start=1))
        t0 = time.monotonic()
        with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
            cli.main(["status"])
        return time.monotonic() - t0
    finally:
        if saved is None:
            os.environ.pop("ASYNCRL_STATE_DIR", None)
        else:
            os.environ["ASYNCRL_STATE_DIR"] = saved


def run() -> dict[str, Any]:
    """The scenario; {"two_jobs_ok": bool, ...} with each check and the timings."""
    t0 = time.monotonic()
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-chaos-jobs-") as tmp:
        _two_jobs(Path(tmp), checks)
        stale_s = _stale_status(Path(tmp))
    expected = ["both_held", "third_finished", "status_lists_both", "stop_asks_which", "stop_one",
                "stopped_job_ended", "other_job_unaffected", "stop_other", "no_state_left", "own_log_dirs"]
    return {"two_jobs_ok": all(checks.get(k, False) for k in expected),
            "two_jobs_checks": {k: checks.get(k, False) for k in expected},
            "stale_status_s": round(stale_s, 3), "previous_status_timeout_s": 10.0,
            "two_jobs_wall_s": round(time.monotonic() - t0, 1)}


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
