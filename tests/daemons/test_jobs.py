"""Many jobs on one machine and one daemon: a state file and a log directory per job, `asyncrl
status|stop --job`, `asyncrl shutdown`, jobs isolated inside a daemon, and the systemd units."""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from daemons.state import (
    ClusterState,
    StateKind,
    process_start,
    read_states,
    state_for_this_process,
    write_state,
)

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "asyncrl.launch"]
CLI = [sys.executable, "-m", "asyncrl.cli"]
UNITS = REPO / "daemons" / "systemd"


class _Proc:
    """A launched process group whose output is collected by a thread; killed if still running."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.out:
            assert self.proc.poll() is None or text in self.out, f"exited {self.proc.returncode}:\n{self.out}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{self.out}"
            time.sleep(0.1)

    def finish(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(5)


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}


def _cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    return process_start(pid) is not None


def _status(env: dict[str, str], *args: str) -> dict:
    res = _cli(env, "status", "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


# jobs of asyncrl-launch ------------------------------------------------------------------------
@pytest.mark.slow  # ~17 s (suite time); test_daemon_runs_jobs_side_by_side_and_shuts_down_for_a_restart runs by default
def test_jobs_side_by_side_have_their_own_state_and_logs(tmp_path):
    """Two held jobs and a third that finishes, all at once with one state dir and one log dir:
    `status` lists them, `stop` asks which, stopping one leaves the other running."""
    env = _env(tmp_path)
    logs = tmp_path / "logs"
    procs = [_Proc(LAUNCH + ["--config-name", "smoke", f"job.name={name}", f"cluster.log_dir={logs}",
                             f"hydra.run.dir={tmp_path / name}", *extra], env)
             for name, extra in (("ja", ["job.entry=asyncrl.jobs.smoke:hold"]),
                                 ("jb", ["job.entry=asyncrl.jobs.smoke:hold"]), ("jc", []))]
    held_a, held_b, finishing = procs
    try:
        for p in (held_a, held_b):
            p.wait_for("holding 2 workers", timeout=90)
        assert finishing.finish(90) == 0, finishing.out  # its exit removes its own state file only
        listed = _status(env)["jobs"]
        assert sorted(j["name"] for j in listed) == ["ja", "jb"] and {j["kind"] for j in listed} == {"job"}
        id_a, id_b = (next(j["job_id"] for j in listed if j["name"] == n) for n in ("ja", "jb"))
        human = _cli(env, "status")
        assert id_a in human.stdout and id_b in human.stdout

        ambiguous = _cli(env, "stop")
        assert ambiguous.returncode == 2 and "choose one with --job ID" in ambiguous.stderr
        assert id_a in ambiguous.stderr and id_b in ambiguous.stderr
        assert held_a.proc.poll() is None and held_b.proc.poll() is None

        pids_a = [w["pid"] for w in _status(env, "--job", id_a)["workers"]]
        stop = _cli(env, "stop", "--job", id_a)
        assert stop.returncode == 0 and f"stop requested for job {id_a}" in stop.stdout, stop.stderr
        assert held_a.finish(30) == 1 and "job stopped: asyncrl stop" in held_a.out

        only_b = _status(env)  # one job left: its full status
        assert [j["job_id"] for j in only_b["jobs"]] == [id_b]
        assert [w["state"] for w in only_b["workers"]] == ["ready", "ready"]
        assert all(_alive(w["pid"]) for w in only_b["workers"])
        assert not any(_alive(p) for p in pids_a)
        assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [f"{id_b}.json"]
        unknown = _cli(env, "stop", "--job", "nope-000000")
        assert unknown.returncode == 2 and id_b in unknown.stderr

        assert _cli(env, "stop").returncode == 0  # the only job now
        assert held_b.finish(30) == 1
        assert list((tmp_path / "state").iterdir()) == []
        dirs = sorted(p.name for p in logs.iterdir())
        assert len(dirs) == 3 and id_a in dirs and id_b in dirs
        for d in logs.iterdir():  # two workers per job, each log written by one job only
            files = list(d.glob("worker-*.log"))
            assert len(files) == 2, d
            assert [f.read_text().count(" ready at ") for f in files] == [1, 1]
    finally:
        for p in procs:
            p.kill()


def test_stale_state_file_answers_at_once(tmp_path, monkeypatch, capsys):
    """kill -9 leaves a job's state file behind: status sees the process is gone without a
    network round trip (it used to wait 10 s for the dead endpoint) and removes the file."""
    from asyncrl import cli

    monkeypatch.setenv("ASYNCRL_STATE_DIR", str(tmp_path / "state"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"  # nothing listens
    write_state(ClusterState(endpoint, dead.pid, True, None, "gone-1", "gone", StateKind.JOB, 1.0,
                             pid_start=123))
    # a pid that was reused: this process runs, but not since the time the file records
    write_state(ClusterState(endpoint, os.getpid(), True, None, "reused-1", "reused", StateKind.DAEMON, 1.0,
                             pid_start=(process_start(os.getpid()) or 0) + 1))
    for args in (["status"], ["stop"], ["shutdown"]):
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as exc:
            cli.main(args)
        took = time.monotonic() - t0
        assert exc.value.code == 1 and took < 1.0, (args, took)
        assert "runs on this machine" in capsys.readouterr().err
    assert list((tmp_path / "state").iterdir()) == []


def test_live_but_silent_coordinator_times_out_quickly(tmp_path, monkeypatch, capsys):
    from asyncrl import cli

    monkeypatch.setenv("ASYNCRL_STATE_DIR", str(tmp_path / "state"))
    with socket.socket() as listener:  # accepts TCP, never speaks ZMTP
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        state = state_for_this_process(f"tcp://127.0.0.1:{listener.getsockname()[1]}", True, None,
                                       "silent-1", "silent", StateKind.JOB)
        path = write_state(state)
        t0 = time.monotonic()
        with pytest.raises(SystemExit):
            cli.main(["status"])
        took = time.monotonic() - t0
        path.unlink()
    # it gives up after its own timeout instead of waiting on the socket forever (the margin
    # is for a loaded 2-core machine: 6.4 s was seen there)
    assert cli.CONNECT_TIMEOUT_S <= took < cli.CONNECT_TIMEOUT_S + 10, took
    assert "no answer" in capsys.readouterr().err


def test_state_file_ids(tmp_path):
    from daemons.state import remove_state
    from transport.checks import ConfigError

    mine = state_for_this_process("tcp://127.0.0.1:1", True, None, "job-1", "job", StateKind.JOB)
    write_state(mine, tmp_path)
    with pytest.raises(ConfigError, match="runs already"):
        write_state(mine, tmp_path)
    for bad in ("../etc", "", "a/b", ".hidden"):
        with pytest.raises(ConfigError, match="not valid"):
            write_state(ClusterState("tcp://x:1", os.getpid(), True, job_id=bad), tmp_path)
    # a stale file under the id is replaced; another live process's file is never removed
    theirs = ClusterState("tcp://127.0.0.1:2", 1, True, None, "init-1", "init", StateKind.JOB)
    (tmp_path / "init-1.json").write_text(json.dumps({**theirs.__dict__, "kind": "job"}))
    remove_state("init-1", tmp_path)
    assert (tmp_path / "init-1.json").exists()
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a state file: left alone
    assert [s.job_id for s in read_states(tmp_path)] == ["init-1", "job-1"]
    assert (tmp_path / "notes.json").exists()


# one coordinator, several jobs ------------------------------------------------------------------
async def test_end_job_stops_only_its_workers_and_forgets_them(tmp_path):
    from daemons.coordinator import Coordinator
    from daemons.messages import WorkerState
    from daemons.node import NodeDaemon

    coordinator = Coordinator(insecure=True, node_timeout=5.0)
    await coordinator.start()
    node = NodeDaemon(coordinator.endpoint, insecure=True, cpu_devices=2, log_dir=tmp_path / "logs",
                      heartbeat_interval_s=0.3)
    await node.start()
    try:
        await node.wait_registered(10)
        one, two = coordinator.begin_job("one-1", "one"), coordinator.begin_job("two-1", "two")
        (w1,) = await coordinator.spawn_workers(coordinator.create_pool("p", 1, job=one.job_id))
        (w2,) = await coordinator.spawn_workers(coordinator.create_pool("p", 1, job=two.job_id))
        await w1.run("asyncrl.jobs.smoke:make_batch", 8, 4, 0)
        assert (await coordinator.status()).objects["count"] == 1
        await coordinator.end_job(one.job_id)
        assert not _alive(w1.info.pid)
        assert await w2.call("ping", timeout=5) == w2.info.worker_id
        assert w2.info.state is WorkerState.READY
        assert list(coordinator.workers) == list(coordinator.handles) == [w2.info.worker_id]
        assert list(coordinator.pools) == ["two-1/p"] and list(coordinator.jobs) == ["two-1"]
        assert coordinator.objects == {}
        for _ in range(100):  # the node forgets a worker once it has reported its exit
            if list(node.children) == [w2.info.worker_id]:
                break
            await asyncio.sleep(0.05)
        assert list(node.children) == [w2.info.worker_id]
        assert (tmp_path / "logs" / "one-1" / f"worker-{w1.info.worker_id}.log").exists()
        await coordinator.end_job(two.job_id)
        assert coordinator.workers == coordinator.handles == coordinator.pools == coordinator.jobs == {}
    finally:
        await coordinator.shutdown_workers(grace_s=2)
        await node.close()
        await coordinator.close()


# daemon mode and the systemd units -----------------------------------------------------------
def _unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keys are case-sensitive
    unit.read(UNITS / name)
    return unit


def _node_env_example() -> dict[str, str]:
    """The settings the node unit's comment says /etc/asyncrl/node.env must hold."""
    lines = (UNITS / "asyncrl-node.service").read_text().splitlines()
    pairs = [ln.lstrip("#").strip().split("=", 1) for ln in lines if ln.startswith("#   ASYNCRL_")]
    return dict(pairs)


def _exec_start(name: str, env: dict[str, str]) -> list[str]:
    """The unit's ExecStart as argv, ${VAR}s filled from `env`, the launcher run from this checkout."""
    argv = shlex.split(_unit(name)["Service"]["ExecStart"])
    assert argv[0] == "/opt/asyncrl/.venv/bin/asyncrl-launch"
    for k, v in env.items():
        argv = [a.replace("${" + k + "}", v) for a in argv]
    assert not any("${" in a for a in argv), argv
    return LAUNCH + argv[1:]


@pytest.mark.parametrize("name", ["asyncrl-coordinator.service", "asyncrl-node.service"])
def test_systemd_unit_command_resolves_with_the_shipped_config(name):
    from asyncrl.launch import load_config

    argv = _exec_start(name, _node_env_example())
    assert argv[len(LAUNCH):len(LAUNCH) + 3] == ["--config-name", "cluster", "daemon"]
    cfg = load_config("cluster", argv[len(LAUNCH) + 3:], daemon=True)
    if name == "asyncrl-node.service":
        assert cfg.cluster.node_rank == 1 and cfg.cluster.coordinator == "10.0.0.1:29400"
    service = _unit(name)["Service"]
    assert service["Restart"] == "on-failure"
    assert "2" in service["RestartPreventExitStatus"].split()  # a config error does not loop


@pytest.mark.parametrize("name", ["asyncrl-coordinator.service", "asyncrl-node.service"])
def test_systemd_units_verify(name, tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # verify insists that the ExecStart binary exists: point it at this interpreter
    text = (UNITS / name).read_text().replace("/opt/asyncrl/.venv/bin/asyncrl-launch", sys.executable)
    (tmp_path / name).write_text(text)
    res = subprocess.run([tool, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stderr.strip() and not res.stdout.strip(), res.stdout + res.stderr


def test_daemon_runs_jobs_side_by_side_and_shuts_down_for_a_restart(tmp_path):
    """The coordinator unit's and the node unit's command lines, on this machine: jobs submitted
    to the daemon are isolated, `stop` ends a job, `shutdown` the daemon with status 75."""
    from asyncrl.jobs.nodes import SHUTDOWN_EXIT
    from transport.auth import generate_keys

    keys = tmp_path / "keys"
    generate_keys(keys)
    env = _env(tmp_path)
    local = [f"cluster.key_dir={keys}", f"cluster.log_dir={tmp_path / 'logs'}", "cluster.cpu_devices=2"]
    daemon = _Proc(_exec_start("asyncrl-coordinator.service", {}) +
                   ["cluster.port=0", "cluster.host=127.0.0.1", *local], env)
    procs = [daemon]
    try:
        daemon.wait_for("registered with", timeout=60)
        (head,) = read_states(tmp_path / "state")
        assert head.kind is StateKind.DAEMON
        port = head.endpoint.rsplit(":", 1)[1]
        node = _Proc(_exec_start("asyncrl-node.service", {"ASYNCRL_COORDINATOR": f"127.0.0.1:{port}",
                                                           "ASYNCRL_NODE_RANK": "1"}) + local, env)
        procs.append(node)
        node.wait_for("registered with", timeout=60)

        held = _Proc(CLI + ["submit", "asyncrl.jobs.smoke:hold", "--job", "held-1", "--timeout", "120"], env)
        procs.append(held)
        deadline = time.monotonic() + 60
        while not [j for j in _status(env, "--job", head.job_id)["jobs"] if j["workers"] == 2]:
            assert time.monotonic() < deadline and held.proc.poll() is None, held.out + daemon.out
            time.sleep(0.2)
        held_pids = [w["pid"] for w in _status(env, "--job", "held-1")["workers"]]
        # another job runs to its end meanwhile: its end stops its own workers only
        sub = _cli(env, "submit", "asyncrl.jobs.smoke:main", "--daemon", head.job_id,
                   "--overrides", json.dumps({"smoke": {"rows": 64, "cols": 8}}), "--timeout", "90", timeout=120)
        assert sub.returncode == 0, sub.stderr + daemon.out
        assert json.loads(sub.stdout.splitlines()[-1])["rows_pulled"] == 32
        held_status = _status(env, "--job", "held-1")
        assert [w["state"] for w in held_status["workers"]] == ["ready", "ready"]
        assert all(_alive(p) for p in held_pids)

        stop = _cli(env, "stop")  # the only job: held-1, not the daemon
        assert stop.returncode == 0 and "held-1" in stop.stdout, stop.stderr
        assert held.finish(30) == 1 and "job held-1 stopped: asyncrl stop" in held.out
        assert not any(_alive(p) for p in held_pids)
        after = _status(env)  # the daemon alone: nothing of the two jobs is left
        assert after["jobs"] == [] and after["workers"] == [] and after["pools"] == {}
        assert after["objects"]["count"] == 0 and len(after["nodes"]) == 2
        idle = _cli(env, "stop")
        assert idle.returncode == 1 and "asyncrl shutdown" in idle.stderr
        assert {p.name for p in (tmp_path / "logs").iterdir()} >= {"held-1"}

        down = _cli(env, "shutdown")
        assert down.returncode == 0 and f"exits with status {SHUTDOWN_EXIT}" in down.stdout, down.stderr
        assert daemon.finish(30) == SHUTDOWN_EXIT, daemon.out
        assert node.proc.poll() is None  # a node outlives the coordinator and re-registers later
        node.proc.send_signal(signal.SIGTERM)
        assert node.finish(30) == 0, node.out
        assert list((tmp_path / "state").iterdir()) == []
    finally:
        for p in procs:
            p.kill()


def _readme_block(text: str, after: str, fence: str) -> str:
    """The first fenced block of kind `fence` after the line containing `after`."""
    rest = text[text.index(after):]
    start = rest.index(f"```{fence}\n") + len(fence) + 4
    return rest[start:rest.index("```", start)]


def _readme_commands(block: str) -> list[str]:
    return [ln.split(" #")[0].strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _outputs(res: subprocess.CompletedProcess, job: _Proc, daemon: _Proc) -> str:
    return f"{res.stderr}\n--- the job's submit:\n{job.out[-6000:]}\n--- the daemon:\n{daemon.out[-8000:]}"


def test_the_readme_commands_run_as_written(tmp_path):
    """daemons/systemd/README.md's commands, as written, against the coordinator unit's command
    line: the `keys generate` lines, every line of "With the CLI" (local and remote submits of a
    smoke job and of `--config-name grpo` RL jobs, status, stop, shutdown) and the Python example.
    Only the paths, the address and the job ids (`ID`, `nightly-1`) are replaced."""
    from asyncrl.jobs.nodes import SHUTDOWN_EXIT
    from asyncrl.models.tiny import ensure_tiny_model

    text = (UNITS / "README.md").read_text()
    keys, state = tmp_path / "keys", tmp_path / "state"
    # the remote jobs' model is wide enough that a step takes ~1.4 s here: their 200 default steps
    # outlast the status calls before their stop (at hidden 64 they took ~45 s, and a loaded CI
    # machine's CLI calls outlasted them: the job had ended when `stop --job` ran); the local job
    # runs its 5 steps to the end on the small one
    wide = ensure_tiny_model(tmp_path / "model", task="sort", hidden=256, layers=4, heads=4)
    small = ensure_tiny_model(tmp_path / "small", task="sort")
    subst = {"/opt/asyncrl/.venv/bin/asyncrl": "asyncrl", "/etc/asyncrl/keys": str(keys), "/path/to/keys": str(keys),
             "/var/lib/asyncrl/state": str(state), "/models/qwen": str(small)}

    def argv(line: str) -> list[str]:
        for a, b in subst.items():
            line = line.replace(a, b)
        words = shlex.split(line)
        words = [w for w in words if w != "sudo"]
        assert words[0] == "asyncrl", line
        return CLI + words[1:]

    env = {**_env(tmp_path), "PYTHONPATH": str(REPO)}
    for line in ("sudo /opt/asyncrl/.venv/bin/asyncrl keys generate /etc/asyncrl/keys",
                 "asyncrl keys generate /etc/asyncrl/keys --name alice"):
        assert line.replace("sudo ", "") in text.replace("sudo ", "")  # as the README has them
        res = subprocess.run(argv(line), env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    commands = _readme_commands(_readme_block(text, "With the CLI", "sh"))
    export = commands.pop(0)
    assert export.startswith("export ASYNCRL_STATE_DIR=/var/lib/asyncrl/state")
    env["ASYNCRL_STATE_DIR"] = str(state)

    # the coordinator unit, its keys and logs here; runs write relative paths under tmp_path
    daemon = _Proc(_exec_start("asyncrl-coordinator.service", {}) +
                   ["cluster.port=0", "cluster.host=127.0.0.1", f"cluster.key_dir={keys}",
                    f"cluster.log_dir={tmp_path / 'logs'}", "cluster.cpu_devices=2"], env)
    procs = [daemon]

    def run(line: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(argv(line), env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)

    def listed(job: str) -> list[dict]:
        return [j for j in _status(env, "--job", head.job_id)["jobs"] if j["job_id"] == job]

    def running(job: str) -> None:
        deadline = time.monotonic() + 90
        while not [j for j in listed(job) if j["workers"]]:
            assert time.monotonic() < deadline, daemon.out
            time.sleep(0.3)

    def gone(job: str) -> None:
        """Until the daemon lists `job` no more: a stopped job's record outlives its submit by its
        teardown, and the next job of that id must not be taken for it."""
        deadline = time.monotonic() + 60
        while listed(job):
            assert time.monotonic() < deadline, daemon.out
            time.sleep(0.3)

    try:
        daemon.wait_for("registered with", timeout=60)
        (head,) = read_states(state)
        subst["10.0.0.1:29400"] = head.endpoint.removeprefix("tcp://")
        by_kind: dict[str, list[str]] = {}
        for line in commands:
            words = shlex.split(line)
            kind = words[1] + (" remote" if "--coordinator" in words else "") + (" rl" if "--config-name" in words else "")
            by_kind.setdefault(kind, []).append(line)
        assert set(by_kind) == {"submit", "submit rl", "status", "stop", "shutdown", "submit remote rl",
                                "status remote", "stop remote"}, by_kind

        (smoke,) = by_kind["submit"]
        res = run(smoke)
        assert res.returncode == 0, res.stderr + daemon.out
        assert json.loads(res.stdout.splitlines()[-1])["rows_pulled"] > 0
        (rl,) = by_kind["submit rl"]
        res = run(rl)
        assert res.returncode == 0, res.stderr + daemon.out
        result = json.loads(res.stdout.splitlines()[-1])
        assert result["algorithm"] == "grpo" and result["steps"] == 5
        assert "asyncrl: step 5" in res.stderr  # progress echoed while it ran
        assert (tmp_path / "outputs" / "grpo" / "checkpoints" / "step_5").is_dir()
        for line in by_kind["status"]:
            if "--job ID" not in line:
                assert run(line, 60).returncode == 0

        # a remote RL job, twice: stopped from this node by id, then remotely; each its own id and
        # working directory (its outputs/grpo there), so nothing of the first is the second's
        subst["/models/qwen"] = str(wide)
        (remote,) = by_kind["submit remote rl"]
        stoppers = (*[ln for ln in by_kind["stop"] if "--job ID" in ln], *by_kind["stop remote"])
        for i, stopper in enumerate(stoppers, start=1):
            subst["ID"] = subst["nightly-1"] = job_id = f"nightly-{i}"  # the README's example id, too
            (tmp_path / job_id).mkdir()
            job = _Proc(argv(remote), env, cwd=tmp_path / job_id)
            procs.append(job)
            running(job_id)
            (remote_status,) = by_kind["status remote"]
            shown = run(remote_status, 60)
            assert shown.returncode == 0 and job_id in shown.stdout, _outputs(shown, job, daemon)
            for line in by_kind["status"]:
                if "--job ID" in line:
                    status = run(line, 60)
                    assert status.returncode == 0, _outputs(status, job, daemon)
            stop = run(stopper, 60)
            assert stop.returncode == 0 and job_id in stop.stdout, _outputs(stop, job, daemon)
            assert job.finish(60) == 1 and "stopped" in job.out, job.out
            gone(job_id)

        # the Python example, with a user identity of its own
        code = _readme_block(text, "The same from Python", "python")
        code = code.replace("tcp://10.0.0.1:29400", head.endpoint).replace("/path/to/keys", str(keys))
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "rows_pulled" in res.stdout, res.stderr + daemon.out

        bad = _cli(env, "submit", "--config-name", "grpo", "trainer.totl_steps=3", timeout=60)
        assert bad.returncode == 2 and "trainer.total_steps" in bad.stderr  # a typo, before anything runs
        # what asyncrl-launch checks before it starts, submit checks before it submits
        missing = _cli(env, "submit", "--config-name", "grpo", "model.path=/models/qwen", "trainer.total_steps=5",
                       timeout=60)
        assert missing.returncode == 2 and "model.path=/models/qwen" in missing.stderr, missing.stderr
        assert "submitted" not in missing.stderr and "Traceback" not in missing.stderr
        (down,) = by_kind["shutdown"]
        assert run(down, 60).returncode == 0
        assert daemon.finish(30) == SHUTDOWN_EXIT, daemon.out
        # the RL jobs' imports and config checks run off the daemon's loop: no "blocked" warning
        blocked = [line for line in daemon.out.splitlines() if "event loop was blocked" in line]
        assert not blocked, blocked
    finally:
        for p in procs:
            p.kill()


def test_status_starts_without_importing_torch(tmp_path):
    """`asyncrl status` answers in well under a second: the CLI path imports no torch."""
    code = ("import sys, time\nt = time.perf_counter()\nfrom asyncrl.cli import main\n"
            "try:\n    rc = main(['status'])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print(rc, 'torch' in sys.modules, round(time.perf_counter() - t, 3))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(REPO)})
    rc, torch_loaded, seconds = res.stdout.split()
    assert torch_loaded == "False", res.stderr
    assert float(seconds) < 1.0, res.stdout


def test_node_keeps_its_newest_job_log_folders_and_nothing_else_goes(tmp_path):
    """Job log folders rotate (cluster.keep_job_logs): the oldest ones the node made go, a
    running job's stays, and what the node did not make stays untouched."""
    from daemons.node import JOB_LOGS_MARKER, NodeDaemon

    logs = tmp_path / "logs"
    node = NodeDaemon("tcp://127.0.0.1:1", log_dir=logs, keep_job_logs=3, insecure=True)
    (logs / "mine").mkdir(parents=True)
    (logs / "mine" / "notes.txt").write_text("a user's folder, no marker")
    (logs / "README").write_text("a user's file")
    made = []
    for i in range(5):
        folder = node._job_log_dir(f"job-{i}")
        (folder / "worker-a.log").write_text("log")
        made.append(folder)
        if i == 1:  # a user's file inside one of ours: only our files go, the folder stays
            (folder / "keep.txt").write_text("mine")
        os.utime(folder, (1000 + i, 1000 + i))
    left = sorted(p.name for p in logs.iterdir())
    assert left == ["README", "job-1", "job-2", "job-3", "job-4", "mine"], left
    assert sorted(p.name for p in (logs / "job-1").iterdir()) == ["keep.txt"]
    assert (logs / "mine" / "notes.txt").exists() and (made[4] / JOB_LOGS_MARKER).exists()


async def test_node_0_keeps_a_copy_of_every_nodes_job_logs(tmp_path):
    """`Coordinator.collect_job_logs`: another node's worker logs (their tails) land in
    `<node 0's log dir>/<job>/<node id>/`; links are not followed, a bad job id is refused by the
    node, and node 0's rotation removes the copies with the job's folder."""
    from daemons.coordinator import Coordinator
    from daemons.node import JOB_LOG_TAIL_BYTES, NodeDaemon, _remove_job_logs

    coordinator = Coordinator("tcp://127.0.0.1:0", insecure=True)
    await coordinator.start()
    head = NodeDaemon(coordinator.endpoint, insecure=True, cpu_devices=1, log_dir=tmp_path / "a")
    other = NodeDaemon(coordinator.endpoint, insecure=True, cpu_devices=1, log_dir=tmp_path / "b", node_rank=1)
    try:
        for node in (head, other):
            await node.start()
            await node.wait_registered(10)
        folder = other._job_log_dir("job-x")
        (folder / "worker-w1.log").write_bytes(b"x" * (JOB_LOG_TAIL_BYTES + 10) + b"the end\n")
        (tmp_path / "secret").write_text("not a log")
        (folder / "worker-evil.log").symlink_to(tmp_path / "secret")
        (folder / "notes.txt").write_text("not a worker log")
        os.mkfifo(folder / "worker-fifo.log")  # would block a plain open
        (folder / "worker-dir.log").mkdir()
        dest = head._job_log_dir("job-x")
        (dest / "worker-w0.log").write_text("node 0's own\n")
        assert await coordinator.collect_job_logs("job-x", dest) == 1
        (copy,) = (dest / other.node_id).glob("worker-*.log")
        data = copy.read_bytes()
        assert copy.name == "worker-w1.log" and len(data) == JOB_LOG_TAIL_BYTES and data.endswith(b"the end\n")
        assert not (dest / head.node_id).exists()  # node 0's own logs are already there
        # a copy that cannot be written is a warning, not a failure of the job
        os.chmod(dest / other.node_id, 0o500)
        try:
            if os.geteuid() != 0:  # root writes anyway
                assert await coordinator.collect_job_logs("job-x", dest) == 0
        finally:
            os.chmod(dest / other.node_id, 0o700)
        assert await coordinator.collect_job_logs("../escape", tmp_path / "nowhere") == 0  # refused by check_job_id
        assert not (tmp_path / "nowhere").exists()
        _remove_job_logs(dest)
        assert not dest.exists()
    finally:
        for node in (other, head):
            await node.close()
        await coordinator.close()
