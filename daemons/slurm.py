"""`srun asyncrl-launch ...` inside a SLURM allocation: the cluster flags read from SLURM's
environment instead of written by hand.

Each task of the step is one asyncrl node (one task per node: `srun --ntasks-per-node=1`; several
tasks on one node also work, each a node of its own): task 0 hosts the coordinator on the first
host of the step's node list, the others join it. The coordinator's port comes from the job id
unless `cluster.port` is set; keys are `cluster.key_dir` when set, else a pair made per job by
task 0 under `$SLURM_SUBMIT_DIR/.asyncrl/` (a shared filesystem, as the job's output files need)
that the other tasks wait for, removed when task 0 exits.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from transport.auth import generate_keys
from transport.checks import ConfigError

PORT_BASE, PORT_SPAN = 20000, 20000  # the coordinator's port: PORT_BASE + job id % PORT_SPAN
KEY_WAIT_S = 120.0  # how long a task waits for task 0's per-job keys


@dataclass(frozen=True)
class SlurmStep:
    """What asyncrl needs of the `srun` step this process is a task of."""

    job_id: str
    ntasks: int
    proc_id: int
    hosts: tuple[str, ...]
    gpus_on_node: int | None  # SLURM_GPUS_ON_NODE; None when the allocation names no GPUs
    submit_dir: Path

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits) % PORT_SPAN

    @property
    def key_dir(self) -> Path:
        return self.submit_dir / ".asyncrl" / f"slurm-{self.job_id}-keys"


def slurm_step(env: Mapping[str, str] = os.environ) -> SlurmStep | None:
    """The step this process runs in, or None outside `srun` (a batch script's own shell included:
    there a multi-node launch would wait for nodes that never start)."""
    step = env.get("SLURM_STEP_ID")
    if "SLURM_JOB_ID" not in env or step is None or not step.isdigit():
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
    gpus = env.get("SLURM_GPUS_ON_NODE")
    return SlurmStep(job_id=env["SLURM_JOB_ID"], ntasks=int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "1")),
                     proc_id=int(env.get("SLURM_PROCID", "0")), hosts=tuple(hostnames(nodelist)),
                     gpus_on_node=int(gpus) if gpus and gpus.isdigit() else None,
                     submit_dir=Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd()))


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if m is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def _given(overrides: list[str], key: str) -> str | None:
    for o in reversed(overrides):
        k, _, v = o.lstrip("+").partition("=")
        if k == key:
            return v
    return None


def cluster_overrides(step: SlurmStep, overrides: list[str]) -> list[str]:
    """The `cluster.*` overrides this task runs with: its node rank among the step's tasks, the
    head's address, the port and keys; keys the command line sets itself are left to it."""
    if step.ntasks == 1:
        return []
    head = socket.gethostbyname(step.head)
    port = int(_given(overrides, "cluster.port") or step.port)
    out = {"cluster.nnodes": str(step.ntasks), "cluster.node_rank": str(step.proc_id)}
    if step.proc_id == 0:
        out.update({"cluster.host": head, "cluster.port": str(port)})
    else:
        out["cluster.coordinator"] = f"{head}:{port}"
    if _given(overrides, "cluster.key_dir") is None and _given(overrides, "cluster.insecure") not in ("true", "True"):
        out["cluster.key_dir"] = str(step.key_dir)
    return [f"{k}={v}" for k, v in out.items() if _given(overrides, k) is None]


def job_keys(step: SlurmStep, key_dir: str) -> bool:
    """Task 0 makes the per-job keys (written aside, then renamed into place); the others wait
    for them. Whether this task made them (and so removes them when it exits)."""
    root = Path(key_dir)
    if root != step.key_dir:  # the user's own keys
        return False
    if step.proc_id == 0:
        if root.exists():
            raise ConfigError(f"{root} exists: keys of an earlier job with id {step.job_id}? remove it")
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".slurm-{step.job_id}-", dir=root.parent))
        generate_keys(tmp)
        tmp.rename(root)
        return True
    deadline = time.monotonic() + KEY_WAIT_S
    while not (root / "authorized").is_dir():
        if time.monotonic() > deadline:
            raise ConfigError(f"no per-job keys at {root} after {KEY_WAIT_S:.0f} s: task 0 makes them there, on "
                              "a filesystem every node must share; or pass cluster.key_dir=DIR (copied to every node)")
        time.sleep(0.2)
    return False


def remove_job_keys(step: SlurmStep) -> None:
    shutil.rmtree(step.key_dir, ignore_errors=True)


def check_gpus(step: SlurmStep, gpus_per_node: int, workers: int | None) -> None:
    """The allocation's GPUs against the config: `cluster.gpus_per_node` at most this node's share,
    and the training workers within the step's GPUs."""
    if step.gpus_on_node is None:
        return
    if gpus_per_node > step.gpus_on_node:
        raise ConfigError(f"cluster.gpus_per_node={gpus_per_node}, but SLURM gave this node {step.gpus_on_node} "
                          f"GPU(s) (SLURM_GPUS_ON_NODE); ask for more (--gpus-per-node) or lower it")
    total = step.gpus_on_node * step.ntasks
    if workers is not None and workers > total:
        raise ConfigError(f"trainer.n_workers={workers} GPU workers, but the step has {total} GPU(s) "
                          f"({step.ntasks} task(s) x {step.gpus_on_node}); lower trainer.n_workers or ask SLURM for "
                          "more nodes or --gpus-per-node")


def hostnames(spec: str) -> list[str]:
    """`scontrol show hostnames` where SLURM is installed (any list syntax), else our parser."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return expand_hostlist(spec)
