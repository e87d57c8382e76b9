"""State files: how `asyncrl status|stop|shutdown|submit` find the jobs and daemons on this machine.

One file per job or daemon, `<state dir>/<id>.json` (the dir from $ASYNCRL_STATE_DIR, else
~/.asyncrl/state; mode 0600: it holds the cluster's keys). A job's file is written by the
process that runs it and removed by that process only; a daemon writes one for itself and one
for each job submitted to it. A file whose process is gone (kill -9) is stale: the pid and the
process's start time tell, without a network round trip, and reading the directory removes it.

Standard library only: the CLI answers from these files before it imports torch.
"""

from __future__ import annotations

import enum
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_DIR_ENV = "ASYNCRL_STATE_DIR"
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

JOB_LOGS_MARKER = ".asyncrl-job-logs"  # in each job log folder asyncrl made (node daemons, node 0's copies)


class StateKind(enum.StrEnum):
    JOB = "job"  # an `asyncrl-launch` job: its own coordinator, ended by `asyncrl stop`
    DAEMON = "daemon"  # `asyncrl-launch ... daemon`: runs submitted jobs, ended by `asyncrl shutdown`
    DAEMON_JOB = "daemon-job"  # a job submitted to a daemon: `endpoint` and `pid` are the daemon's


@dataclass(frozen=True)
class ClusterState:
    """What the CLI needs to reach a job's (or daemon's) coordinator on this machine."""

    endpoint: str  # "tcp://HOST:PORT"
    pid: int
    insecure: bool
    curve: dict[str, str] | None = None  # CurveConfig.to_env()
    job_id: str = ""
    name: str = ""
    kind: StateKind = StateKind.JOB
    started_at: float = 0.0  # time.time()
    pid_start: int = 0  # the process's start time (clock ticks after boot): a reused pid is another process

    def alive(self) -> bool:
        """Whether the process that wrote this file still runs."""
        if self.pid <= 0:
            return False
        if self.pid_start:
            return process_start(self.pid) == self.pid_start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process: it exists
            return True
        return True

    def client_curve(self) -> Any:
        """The CurveConfig a client presents to this coordinator (None when insecure)."""
        if self.insecure or self.curve is None:
            return None
        from transport import CurveConfig

        return CurveConfig.from_env(self.curve)


def process_start(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks after boot (Linux /proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":  # a zombie has ended
        return None
    return int(fields[19])  # field 22 of stat(5); the first two (pid, comm) are cut off


def state_dir(directory: str | os.PathLike | None = None) -> Path:
    """`directory`, else $ASYNCRL_STATE_DIR, else ~/.asyncrl/state."""
    if directory is not None:
        return Path(directory)
    return Path(os.environ.get(STATE_DIR_ENV, Path.home() / ".asyncrl" / "state"))


def new_job_id(name: str) -> str:
    """A job id for this machine: the job's name and six random hex digits (`smoke-3fa2c1`)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:40] or "job"
    return f"{base}-{secrets.token_hex(3)}"


def check_job_id(job_id: str) -> str:
    """`job_id` if it can name a file and a log directory; ConfigError otherwise."""
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        from transport.checks import ConfigError

        raise ConfigError(f"job id {job_id!r} is not valid: use 1-64 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit (or leave it out to get a generated one)")
    return job_id


def state_for_this_process(endpoint: str, insecure: bool, curve: dict[str, str] | None, job_id: str,
                           name: str, kind: StateKind) -> ClusterState:
    """A ClusterState naming this process as the one that serves `endpoint`."""
    return ClusterState(endpoint, os.getpid(), insecure, curve, check_job_id(job_id), name, kind,
                        round(time.time(), 3), process_start(os.getpid()) or 0)


def write_state(state: ClusterState, directory: str | os.PathLike | None = None) -> Path:
    """Create `<dir>/<job id>.json` (mode 0600); ConfigError if a live job holds that id already."""
    folder = state_dir(directory)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{check_job_id(state.job_id)}.json"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        old = _read(path)
        if old is not None and old.alive():
            from transport.checks import ConfigError

            raise ConfigError(f"a job with id {state.job_id!r} runs already (pid {old.pid}, {path}); "
                              "pick another id") from None
        path.unlink(missing_ok=True)  # stale: its process is gone
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f)
    return path


def remove_state(job_id: str, directory: str | os.PathLike | None = None) -> None:
    """Remove the state file of `job_id` if this process wrote it."""
    path = state_dir(directory) / f"{job_id}.json"
    state = _read(path)
    if state is not None and state.pid == os.getpid():
        path.unlink(missing_ok=True)


def read_states(directory: str | os.PathLike | None = None) -> list[ClusterState]:
    """The live jobs and daemons of this machine, oldest first. Stale files (their process is
    gone) are removed; files that are not asyncrl state files are left alone."""
    folder = state_dir(directory)
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return []
    live = []
    for path in paths:
        state = _read(path)
        if state is None:
            continue
        if state.alive():
            live.append(state)
        else:
            path.unlink(missing_ok=True)
    return sorted(live, key=lambda s: (s.started_at, s.job_id))


def _read(path: Path) -> ClusterState | None:
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        return ClusterState(str(raw["endpoint"]), int(raw["pid"]), bool(raw["insecure"]), raw.get("curve"),
                            str(raw.get("job_id") or path.stem), str(raw.get("name", "")),
                            StateKind(raw.get("kind", "job")), float(raw.get("started_at", 0.0)),
                            int(raw.get("pid_start", 0)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # gone meanwhile, or not one of ours
