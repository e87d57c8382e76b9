"""daemons/ and asyncrl-launch: smoke job, faults, status/stop, bad configuration."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemons.coordinator import Coordinator
from daemons.errors import PlacementError, WorkerDiedError
from daemons.node import NodeDaemon

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "asyncrl.launch"]


def _env(tmp_path: Path) -> dict[str, str]:
    """Launches run from tmp_path (Hydra's outputs/ lands there), importing this checkout."""
    return {**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:  # a zombie is not running
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                continue
        except OSError:
            continue
        alive.append(pid)
    return alive


def _run_launch(args: list[str], tmp_path: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(LAUNCH + args, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


# the acceptance smoke ------------------------------------------------------------------------
@pytest.mark.alone  # no store's segment may be left in /dev/shm
def test_smoke_job_embedded(tmp_path):
    t0 = time.monotonic()
    res = _run_launch(["--config-name", "smoke", f"cluster.log_dir={tmp_path}/logs"], tmp_path)
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stdout
    assert wall < 60
    assert "consumer pulled 2048 rows" in res.stdout
    assert res.stdout.count("spawned worker") >= 2
    # the driver only moved refs: a few hundred bytes for a 2 MiB shard
    driver_bytes = int(res.stdout.split("the driver moved ")[1].split()[0])
    assert driver_bytes < 4096
    logs = list((tmp_path / "logs").glob("smoke-*/worker-*.log"))  # <log_dir>/<job id>/
    assert len(logs) == 2
    assert not any(p.name.startswith("asyncrl-") for p in Path("/dev/shm").iterdir())


# faults ----------------------------------------------------------------------------------------
@pytest.fixture
async def cluster(tmp_path):
    # workers run only allowed packages: these tests call time.sleep, os.getpid (posix), json.loads
    coordinator = Coordinator(insecure=True, node_timeout=2.0, allowed_packages=("time", "os", "posix", "json"))
    await coordinator.start()
    node = NodeDaemon(coordinator.endpoint, insecure=True, cpu_devices=3, log_dir=tmp_path / "logs",
                      heartbeat_interval_s=0.3)
    await node.start()
    await node.wait_registered(10)
    yield coordinator, node
    await coordinator.shutdown_workers(grace_s=2)
    await node.close()
    await coordinator.close()


async def test_worker_killed_mid_call_fails_the_pending_future(cluster):
    coordinator, node = cluster
    pool = coordinator.create_pool("p", world_size=3)
    workers = await coordinator.spawn_workers(pool, group="g")
    pids = [w.info.pid for w in workers]
    pending = asyncio.ensure_future(workers[1].run("time:sleep", 60))
    await asyncio.sleep(0.5)
    os.kill(workers[1].info.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        await asyncio.wait_for(pending, 10)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.rank == 1 and err.node_id == node.node_id and "SIGKILL" in str(err)
    # the others still work, and a later call on the dead one fails at once
    assert await workers[0].run("os:getpid") == pids[0]
    with pytest.raises(WorkerDiedError):
        await workers[1].run("os:getpid")
    await coordinator.shutdown_workers(grace_s=2)
    assert _pids_alive(pids) == []


async def test_worker_exception_surfaces_with_remote_traceback(cluster):
    coordinator, _ = cluster
    (worker,) = await coordinator.spawn_workers(coordinator.create_pool("p", world_size=1))
    from transport import RemoteError

    with pytest.raises(RemoteError) as info:
        await worker.run("json:loads", "{not json")
    assert info.value.remote_type == "json.decoder.JSONDecodeError"
    with pytest.raises(RemoteError, match="cannot import"):
        await worker.run("json.no_such_module:fn")


async def test_killed_node_daemon_is_marked_dead(tmp_path):
    coordinator = Coordinator(insecure=True, node_timeout=1.5)
    await coordinator.start()
    port = coordinator.endpoint.rsplit(":", 1)[1]
    node_proc = subprocess.Popen(
        LAUNCH + ["--config-name", "smoke", f"cluster.coordinator=127.0.0.1:{port}", "cluster.node_rank=1",
                  "cluster.nnodes=2", "cluster.insecure=true", "cluster.heartbeat_interval_s=0.3",
                  f"cluster.log_dir={tmp_path}/logs"],
        cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await coordinator.wait_for_nodes(1, timeout=30)
        (node,) = coordinator.live_nodes()
        assert node.rank == 1
        os.killpg(node_proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while node.alive and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.1)
        assert not node.alive
        assert time.monotonic() - t0 < 1.5 + 1.5
        with pytest.raises(PlacementError, match="no node"):
            coordinator.create_pool("p", world_size=1)
    finally:
        if node_proc.poll() is None:
            os.killpg(node_proc.pid, signal.SIGKILL)
        node_proc.wait()
        await coordinator.close()


def test_missing_nodes_are_named(tmp_path):
    res = _run_launch(["--config-name", "smoke", "cluster.nnodes=3", "cluster.insecure=true",
                       "cluster.join_timeout_s=2", f"cluster.log_dir={tmp_path}/logs"], tmp_path)
    assert res.returncode == 1
    assert "missing node ranks [1, 2]" in res.stdout


# status and stop -------------------------------------------------------------------------------
def test_status_and_stop(tmp_path):
    env = _env(tmp_path)
    proc = subprocess.Popen(LAUNCH + ["--config-name", "smoke", "job.entry=asyncrl.jobs.smoke:hold",
                                      f"cluster.log_dir={tmp_path}/logs"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    cli = [sys.executable, "-m", "asyncrl.cli"]
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "holding 2 workers" in line:
                break
        st = subprocess.run(cli + ["status", "--json"], env=env, capture_output=True, text=True, timeout=30)
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert len(status["nodes"]) == 1 and len(status["workers"]) == 2
        assert all(w["state"] == "ready" for w in status["workers"])
        assert status["objects"]["count"] == 1
        human = subprocess.run(cli + ["status"], env=env, capture_output=True, text=True, timeout=30)
        assert "worker hold-0" in human.stdout
        stop = subprocess.run(cli + ["stop"], env=env, capture_output=True, text=True, timeout=30)
        assert stop.returncode == 0, stop.stderr
        assert "stop requested for job smoke-" in stop.stdout
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1
        assert "job stopped: asyncrl stop" in rest
        pids = [w["pid"] for w in status["workers"]]
        assert _pids_alive(pids) == []
        assert list((tmp_path / "state").glob("*.json")) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_status_without_a_coordinator_says_what_to_do(tmp_path):
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status"], env=_env(tmp_path),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "--coordinator HOST:PORT" in res.stderr


# bad configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--config-name", "smoke", "cluster.nodes=2"], "cluster.nodes"),
    (["--config-name", "no_such_config"], "available: "),
    (["--config-name", "smoke", "job.entry=missing/script.py:main"], "does not exist"),
    (["--config-name", "smoke", "job.entry=no_such_pkg.mod:main"], "cannot import"),
    (["--config-name", "smoke", "cluster.key_dir=/nonexistent/keys"], "asyncrl keys generate"),
    (["--config-name", "smoke", "cluster.nnodes=2"], "needs shared keys"),
    (["--config-name", "smoke", "cluster.node_rank=1", "cluster.coordinator=127.0.0.1:1", "cluster.nnodes=2",
      "cluster.insecure=true", "cluster.join_timeout_s=1"], "could not join the coordinator"),
])
def test_bad_config_gets_one_paragraph(tmp_path, args, message):
    """(`asyncrl-launch` forked from the session's pre-imported server: what it prints and exits with.)"""
    from tests.helpers import forked

    res = forked.launch(args + [f"cluster.log_dir={tmp_path}/logs"], env=_env(tmp_path), cwd=tmp_path, timeout=60)
    said = res.stdout + res.stderr
    assert res.returncode == 2, said
    assert message in said
    assert "Traceback" not in said


# cluster module ------------------------------------------------------------------------------
def test_state_file_roundtrip(tmp_path, monkeypatch):
    from daemons.cluster import read_states, remove_state, write_state
    from daemons.state import StateKind, state_for_this_process

    monkeypatch.setenv("ASYNCRL_STATE_DIR", str(tmp_path / "st"))
    assert read_states() == []
    state = state_for_this_process("tcp://127.0.0.1:5", True, None, "smoke-1", "smoke", StateKind.JOB)
    path = write_state(state)
    assert path == tmp_path / "st" / "smoke-1.json" and (path.stat().st_mode & 0o777) == 0o600
    assert read_states() == [state]
    remove_state("smoke-1")
    assert read_states() == []


async def test_head_node_passes_shm_pool_to_worker_stores(tmp_path):
    from daemons.cluster import ClusterConfig, ClusterSpec, HeadNode
    from daemons.messages import WorkerState

    spec = ClusterSpec(ClusterConfig(cpu_devices=1, insecure=True, log_dir=str(tmp_path / "logs"),
                                     heartbeat_interval_s=0.5, shm_pool_bytes=1 << 20),
                       write_state=True, state_dir=tmp_path / "st")
    async with HeadNode.start(spec) as head:
        assert [p.name for p in (tmp_path / "st").iterdir()] == [f"{head.state_id}.json"]
        (worker,) = await head.coordinator.spawn_workers(head.coordinator.create_pool("p"))
        assert worker.info.state is WorkerState.READY
        for _ in range(100):
            stats = await worker.call("store_stats", timeout=5)
            if stats["shm_pool_bytes_ready"]:
                break
            await asyncio.sleep(0.05)
        assert stats["shm_pool_bytes_ready"] >= 1 << 20
        status = await head.coordinator.status()
        assert [w.state for w in status.workers] == [WorkerState.READY]
        pid = worker.info.pid
    assert list((tmp_path / "st").iterdir()) == []
    assert _pids_alive([pid]) == []


def test_rendezvous_ports_stay_out_of_the_ephemeral_range():
    """A rendezvous port from bind(0) can be taken by an outgoing connection's local port before
    rank 0 listens on it (CI saw EADDRINUSE); the node hands out ports below the ephemeral range
    and never the same one twice while it may still be unbound."""
    from daemons.proc import _outside_ephemeral, free_port

    span = _outside_ephemeral()
    node = NodeDaemon.__new__(NodeDaemon)
    node.host, node._handed_ports = "127.0.0.1", {}
    ports = [node.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    if span is not None:
        assert all(span[0] <= p < span[1] for p in ports)
    assert free_port(avoid=set(ports)) not in ports


# the fork server -------------------------------------------------------------------------------
def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_workers_fork_from_the_fork_server_with_their_own_work_keys_and_log(tmp_path, monkeypatch):
    """cluster.warm_imports: CPU workers fork from the process's pre-imported fork server (here
    the test session's), each in its own process group with its own environment, CurveZMQ keys
    (never in its environment), log file and asyncrl's allocator settings; a worker whose
    load-time settings differ from the server's starts cold; the node's close leaves none behind.
    What the server imported is frozen (`daemons.heap`): a worker's collections never walk it.
    A worker's tqdm bars make no named semaphore (a forked process's multiprocessing lock is
    one, which a kill -9 of the worker and its resource tracker would leave in /dev/shm)."""
    import multiprocessing.forkserver

    from daemons.cluster import ClusterConfig, ClusterSpec, HeadNode
    from daemons.proc import ALLOCATOR_ENV
    from transport import CurveConfig

    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None  # the session's (tests/conftest.py)
    secret = CurveConfig.ephemeral()
    spec = ClusterSpec(ClusterConfig(cpu_devices=3, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=0.5,
                                     allowed_packages=["os", "posix", "gc", "tests"], warm_imports=["json"]),
                       curve=secret, state_dir=tmp_path / "st")
    async with HeadNode.start(spec) as head:
        workers = await head.coordinator.spawn_workers(head.coordinator.create_pool("p", world_size=2))
        pids = [w.info.pid for w in workers]
        assert [_parent(p) for p in pids] == [server, server]
        for w in workers:
            assert await w.run("os:getpid", timeout=10) == w.info.pid
            assert await w.run("os:getpgid", 0, timeout=10) == w.info.pid
            assert await w.run("os:getenv", "ASYNCRL_WORKER_ID", timeout=10) == w.info.worker_id
            assert all([await w.run("os:getenv", k, timeout=10) == v for k, v in ALLOCATOR_ENV.items()])
            assert secret.secret_key not in Path(f"/proc/{w.info.pid}/environ").read_bytes()
            assert await w.run("gc:get_freeze_count", timeout=10) > 100_000  # torch, transformers, asyncrl
            assert await w.run("tests.helpers.fork_probe:progress_bar_semaphores", timeout=10) == []
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read as libraries load: the server read its own
        (third,) = await head.coordinator.spawn_workers(head.coordinator.create_pool("q", world_size=1))
        assert _parent(third.info.pid) == os.getpid()  # a cold start, the node's own child
        assert await third.run("os:getenv", "OMP_NUM_THREADS", timeout=10) == "3"
        logs = sorted((tmp_path / "logs").rglob("worker-*.log"))
        assert len(logs) == 3 and all("ready at" in p.read_text() for p in logs)
    assert _pids_alive([*pids, third.info.pid]) == []


def test_a_forked_worker_dies_with_the_process_it_watches(tmp_path):
    """A forked worker's parent is the fork server, so the parent-death signal that ends a cold
    worker with its node cannot: `die_with` ends it when the node's process ends, SIGKILL included."""
    node = subprocess.Popen(["sleep", "60"])
    child = subprocess.Popen([sys.executable, "-c", f"from daemons.proc import die_with; import time; "
                              f"die_with({node.pid}); print('watching', flush=True); time.sleep(60)"],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "watching"
        node.kill()
        node.wait()
        assert child.wait(timeout=5) == -signal.SIGKILL
        gone = subprocess.run([sys.executable, "-c", f"from daemons.proc import die_with; import time; "
                               f"die_with({node.pid}); time.sleep(60)"], cwd=REPO, timeout=30)
        assert gone.returncode == -signal.SIGKILL  # already gone: at once
    finally:
        for p in (node, child):
            p.kill()
            p.wait()


def test_warm_imports_are_checked_and_gpu_nodes_start_cold(monkeypatch):
    """A GPU worker's CUDA_VISIBLE_DEVICES must be set before anything it imports could touch
    CUDA, so a node with GPUs starts no warm workers."""
    import daemons.node as node_mod
    from daemons.cluster import ClusterConfig
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="warm_imports"):
        ClusterConfig(warm_imports=["os; rm -rf /"]).check("cluster.")
    assert NodeDaemon("tcp://127.0.0.1:1", insecure=True, cpu_devices=1, warm_imports=("json",)).warm_imports == ("json",)
    monkeypatch.setattr(node_mod, "discover_devices", lambda cpu, gpus: ["cuda:0", "cuda:1"])
    assert NodeDaemon("tcp://127.0.0.1:1", insecure=True, warm_imports=("json",)).warm_imports == ()


def test_a_worker_whose_code_or_native_settings_differ_starts_cold(tmp_path):
    """The fork server has imported its modules and loaded its libraries already: a worker that
    would import another copy of a package (its PYTHONPATH) or read other load-time settings
    (OMP_*, PYTHON*, LD_*, HF_*) is not forked from it; the same code on another path entry is."""
    from daemons.node import _loads_as

    for d in ("a", "b", "c"):
        (tmp_path / d / "pkgx").mkdir(parents=True)
        (tmp_path / d / "pkgx" / "__init__.py").write_text("")
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path / "a")}
    for env, forked in [({**base, "PYTHONPATH": str(tmp_path / "b")}, False),
                        ({**base, "OMP_NUM_THREADS": "3"}, False),
                        ({**base, "THP_MEM_ALLOC_ENABLE": "0"}, False),
                        ({**base, "HF_HUB_OFFLINE": "1"}, False),
                        ({**base, "PYTHONPATH": f"{tmp_path / 'c'}{os.pathsep}{tmp_path / 'a'}"}, False),
                        ({**base, "PYTHONPATH": f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}"}, True),
                        ({**base, "ASYNCRL_WORKER_ID": "w"}, True)]:
        assert _loads_as(env, base, ("pkgx.sub",)) == forked, env


def test_exit_now_keeps_what_a_normal_exit_does_before_the_teardown(tmp_path):
    """`exit_now` (the end of asyncrl-launch, the CLI and every worker): the code comes back,
    non-daemon threads are waited for, exit handlers and weakref finalizers run, and buffered
    output is written; only the interpreter's module teardown is skipped."""
    code = f"""
import atexit, pathlib, sys, threading, time, weakref
from daemons.proc import exit_now
out = pathlib.Path({str(tmp_path)!r})
def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
import concurrent.futures
pool = concurrent.futures.ThreadPoolExecutor(2)  # idle threads, never shut down: a normal exit stops them
pool.submit(time.sleep, 0.01).result()
atexit.register(lambda: (out / "atexit").write_text("ran"))
class Held: pass
held = Held()
weakref.finalize(held, lambda: (out / "finalizer").write_text("ran"))
sys.stdout.write("buffered, no newline")
exit_now(3)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=_env(tmp_path))
    assert res.returncode == 3 and res.stdout == "buffered, no newline", res.stderr
    assert {p.name for p in tmp_path.iterdir() if p.is_file()} == {"thread", "atexit", "finalizer"}


def test_a_process_started_with_the_allocator_settings_faults_little():
    """A process started as the node starts every worker (`daemons.proc.ALLOCATOR_ENV` in its
    environment, `use_allocator_settings()` first in `daemons.worker.main`): writing a fresh 64 MiB
    tensor faults a few hundred times (2 MiB pages, where the kernel lends huge pages on request)
    where 4 KiB pages fault 16 384 times, and smaller ones after it reuse its freed pages (glibc's
    heap, not a fresh mapping): 48 MiB then 32 MiB hardly fault. It holds where a GLIBC_TUNABLES in
    the environment sets a trim threshold that overrides the environment's (511 faults without the
    mallopt). A second block of the *same* size is not asserted: a small allocation may land just
    after the freed block, and an aligned request asks a few bytes more than it frees, so glibc
    reuses it or not by the layout (48 MiB twice: the second faulted 535 times in 2 of 30 runs here
    and once on CI; 48 then 32 MiB: 0 and 0 in 40 of 40)."""
    from daemons.proc import ALLOCATOR_ENV

    code = """
from daemons.proc import use_allocator_settings
use_allocator_settings()
import resource, torch
def faults_writing(n):
    block = torch.empty(n, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block.fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults_writing(64 << 20), faults_writing(48 << 20) + faults_writing(32 << 20))
"""
    env = {**os.environ, **ALLOCATOR_ENV, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    first, second = map(int, out.stdout.split())
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.is_file() and "[never]" not in mode.read_text():
        assert first < (64 << 20) // 4096 // 4, first
    assert second < 64, second


_FORK_HERE = """
import json, os, sys, threading, time
from daemons.proc import with_allocator_settings
with_allocator_settings(os.environ)  # as asyncrl-launch does before it loads torch
import torch
torch.zeros(1)  # as the launcher's imports allocate: torch reads its allocator settings then
from daemons import forking
if sys.argv[2] == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
theirs, ours = os.pipe()  # as a pipe this process's parent handed it: its reader waits for the end
os.set_inheritable(ours, True)
here = forking.start(["json.decoder"], {**os.environ, "FROM_START": "1"}, here=True)
server = __import__("multiprocessing.forkserver").forkserver._forkserver._forkserver_pid
worker = forking.spawn("tests.helpers.fork_probe:report", (sys.argv[1],))
exit_code = worker.wait(60)
os.close(ours)
import select
ended = bool(select.select([theirs], [], [], 10)[0]) and os.read(theirs, 1) == b""
print(json.dumps({"here": here, "server": server, "me": os.getpid(), "exit": exit_code, "pipe_ended": ended,
                  "same_command": open(f"/proc/{server}/cmdline").read() == open("/proc/self/cmdline").read()}))
"""


@pytest.mark.parametrize("mode", ["alone", "thread"])
def test_a_launcher_forks_its_fork_server_from_itself_when_it_runs_one_thread(tmp_path, mode):
    """`forking.start(..., here=True)`, as asyncrl-launch calls it before it starts anything: the
    server is the process itself, forked (no fresh interpreter), with the environment it was
    given and none of the descriptors the process inherited (a pipe's reader sees its end); its
    worker writes a fresh 64 MiB tensor in 2 MiB pages (where the kernel lends them on request:
    torch loaded with the allocator settings) and reuses glibc's heap (the server's mallopt). With a
    second thread running, a fork could not copy it: a fresh server starts."""
    from daemons.proc import ALLOCATOR_ENV

    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}  # glibc reads them as it starts
    res = subprocess.run([sys.executable, "-c", _FORK_HERE, str(out), mode], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    ran, report = json.loads(res.stdout.splitlines()[-1]), json.loads(out.read_text())
    assert ran["exit"] == 0 and report["parent"] == ran["server"] and report["json_loaded"]
    assert ran["pipe_ended"]  # neither the server nor its worker holds what the process inherited
    assert report["env"]["FROM_START"] == "1" and all(report["env"][k] == v for k, v in ALLOCATOR_ENV.items())
    if mode == "thread":
        assert ran["here"] is None and not ran["same_command"]
        return
    assert ran["here"] == ran["server"] and ran["same_command"]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert report["fresh_faults"] < (64 << 20) // 4096 // 4, report
    assert report["reused_faults"] < 64, report


def test_the_thread_count_that_stops_a_fork_leaves_out_jemallocs_background_thread():
    """A launcher that read a user's parquet runs pyarrow's jemalloc background thread (a fresh
    fork server that imported the roles runs one too; jemalloc's fork handlers take care of it):
    `forking.threads` does not count it, so such a launcher still forks its server."""
    code = ("import os\nimport numpy\nfrom daemons.forking import threads\nbefore = threads()\n"  # numpy's one, torch's too
            "import pyarrow as pa\n"
            "pa.table({'x': list(range(100000))})\n"
            "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
            "print(before, threads(), 'jemalloc_bg_thd' in names)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    before, after, jemalloc = res.stdout.split()
    assert before == after, res.stdout + res.stderr
    if jemalloc != "True":
        pytest.skip("this pyarrow started no jemalloc background thread")
