"""`srun asyncrl-launch` inside a SLURM allocation: the environment read, and a GRPO job through
`sbatch` on a real slurmctld + slurmd that the test starts (Debian's SLURM; skipped where absent)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemons.proc import free_port
from daemons.slurm import check_gpus, cluster_overrides, expand_hostlist, job_keys, slurm_step
from transport.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost", "SLURM_SUBMIT_DIR": "/tmp"}


def test_host_lists_expand_as_slurm_writes_them():
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_hostlist("node7") == ["node7"]


def test_the_step_gives_each_task_its_node_rank_head_port_and_keys(tmp_path):
    assert slurm_step({}) is None
    assert slurm_step({**STEP, "SLURM_STEP_ID": "batch"}) is None  # the batch script's own shell
    step = slurm_step({**STEP, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert (step.ntasks, step.proc_id, step.head, step.port) == (2, 1, "localhost", 24242)
    head = socket.gethostbyname("localhost")
    assert cluster_overrides(step, []) == ["cluster.nnodes=2", "cluster.node_rank=1", f"cluster.coordinator={head}:24242",
                                           f"cluster.key_dir={step.key_dir}"]
    # what the command line sets stays the command line's
    assert cluster_overrides(step, ["cluster.port=3000", "cluster.insecure=true"]) == [
        "cluster.nnodes=2", "cluster.node_rank=1", f"cluster.coordinator={head}:3000"]
    first = slurm_step({**STEP, "SLURM_PROCID": "0", "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert "cluster.port=24242" in cluster_overrides(first, []) and f"cluster.host={head}" in cluster_overrides(first, [])
    # task 0 makes the per-job keys where the others find them; a leftover is not overwritten
    assert job_keys(first, str(first.key_dir)) and (first.key_dir / "authorized").is_dir()
    assert not job_keys(step, str(step.key_dir))
    with pytest.raises(ConfigError, match="exists"):
        job_keys(first, str(first.key_dir))
    assert not job_keys(first, str(tmp_path / "mine"))  # the user's own keys: not made, not removed


def test_an_allocation_with_fewer_gpus_than_the_config_is_refused():
    step = slurm_step({**STEP, "SLURM_GPUS_ON_NODE": "4"})
    check_gpus(step, 0, 8)
    with pytest.raises(ConfigError, match="trainer.n_workers=9 GPU workers, but the step has 8"):
        check_gpus(step, 0, 9)
    with pytest.raises(ConfigError, match="cluster.gpus_per_node=8, but SLURM gave this node 4"):
        check_gpus(step, 8, None)


# a real SLURM ---------------------------------------------------------------------------------------
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sacct", "scontrol")


@pytest.fixture
def slurm(tmp_path):
    """munged, slurmctld and slurmd of our own (own config, ports, sockets, state), one node of
    this machine's CPUs; stopped by pid at the end."""
    if any(shutil.which(b) is None for b in SLURM_BINARIES) or os.geteuid() != 0:
        pytest.skip("needs Debian's SLURM (apt-get install slurmctld slurmd slurm-client munge) and root")
    root = tmp_path / "slurm"
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True)
    (root / "munge.key").write_bytes(os.urandom(1024))
    (root / "munge.key").chmod(0o400)
    host = socket.gethostname()
    # two ports outside the ephemeral range (no outgoing connection takes them first), distinct
    ctld_port = free_port()
    slurmd_port = free_port(avoid={ctld_port})
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=asyncrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
PlugStackConfig=/dev/null
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pids = []
    try:
        subprocess.run(["munged", "-S", f"{root}/munge.socket", f"--key-file={root}/munge.key",
                        f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log",
                        f"--seed-file={root}/munge.seed", "-f"], check=True, env=env, timeout=30)
        pids.append(root / "munged.pid")
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(conf)], check=True, env=env, timeout=30)
            pids.append(root / f"{daemon}.pid")
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout:
            assert time.monotonic() < deadline, (root / "log" / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield env, root
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
        for pid_file in reversed(pids):
            for _ in range(50):
                if not pid_file.exists():
                    break
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    break
                time.sleep(0.1)


def _wait_for(env: dict, job: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(1)
    raise TimeoutError(f"job {job} still running after {timeout} s")


def test_grpo_trains_through_sbatch_and_srun_on_a_real_slurm(slurm, tmp_path):
    """examples/slurm/grpo.sbatch as shipped, submitted with `sbatch` (two tasks on this one node:
    Debian's slurmd runs one node per machine), the GPU request overridden for a CPU node; the two
    tasks become asyncrl node 0 and 1 from SLURM's environment alone, with per-job keys."""
    env, root = slurm
    from asyncrl.models.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", task="sort", hidden=32, layers=1, heads=2, sft_steps=0)
    out = tmp_path / "run"
    submit = tmp_path / "submit"
    submit.mkdir()
    job_env = {**env, "ASYNCRL_LAUNCH": f"{sys.executable} -m asyncrl.launch", "ASYNCRL_CONFIG": "quickstart",
               "PYTHONPATH": str(REPO), "ASYNCRL_STATE_DIR": str(tmp_path / "state")}
    res = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gres=none",
                          f"--chdir={submit}", str(REPO / "examples" / "slurm" / "grpo.sbatch"),
                          f"trainer.output_dir={out}", f"model.path={model}", "model.build_tiny=null",
                          "trainer.n_workers=2", "cluster.cpu_devices=1", "trainer.total_steps=3",
                          "trainer.eval_every=3", "data.batch_size=4", "rollout.n=2", "rollout.max_tokens=4",
                          "data.synthetic.n_val=8", "trainer.loggers=[jsonl]"],
                         capture_output=True, text=True, env=job_env, cwd=submit, timeout=60)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    state = _wait_for(env, job, timeout=300)
    log = (submit / f"asyncrl-grpo-{job}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-4000:]
    summary = json.loads([line for line in log.splitlines() if line.startswith('{"algorithm"')][-1])
    assert summary["steps"] == 3
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]
    assert "node 1 joined" in log and "(CurveZMQ)" in log  # the second task joined as node 1, keys on
    assert not (submit / ".asyncrl" / f"slurm-{job}-keys").exists()  # task 0 removed the per-job keys


def test_the_planner_prints_an_sbatch_script_that_leaves_the_cluster_flags_to_slurm(capsys, tmp_path):
    from asyncrl.launch import check_config, load_config
    from asyncrl.plan.cli import main as plan_main

    model = "model.path=Qwen/Qwen2.5-7B-Instruct"  # a shape the planner knows (a fresh clone has no tiny model)
    assert plan_main(["--config-name", "grpo", "cluster.nnodes=2", "cluster.gpus_per_node=8", model, "--sbatch"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gres=gpu:8" in script and "--ntasks-per-node=1" in script
    (tmp_path / "run.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "run.sbatch")]).returncode == 0
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    words = srun.split()
    overrides = words[words.index("grpo") + 1:-1]
    assert not any(o.startswith(("cluster.nnodes", "cluster.key_dir", "cluster.coordinator")) for o in overrides)
    # as task 1 of a two-node step would run it
    step = slurm_step({**STEP, "SLURM_SUBMIT_DIR": str(tmp_path)})
    cfg = check_config(load_config("grpo", [*cluster_overrides(step, overrides), *overrides]))
    assert (cfg.cluster.nnodes, cfg.cluster.node_rank, cfg.cluster.gpus_per_node) == (2, 1, 8)
