"""Node daemon: one per machine. Registers its devices, spawns and reaps worker processes.

It heartbeats the coordinator from a thread of its own (`daemons.liveness`); when the
coordinator has been unreachable for `coordinator_timeout` seconds it kills its workers (no
orphans) and keeps trying to register again, so a restarted coordinator gets the node back —
unless `head_loss_timeout` is set (a job's non-head node): after that long without the head the
daemon stops (`stopped` is set, `stop_reason` says why).
Worker logs go to `<log_dir>/<job id>/worker-<worker id>.log`: jobs sharing a node never share
a log file.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from daemons import forking
from daemons.errors import PlacementError
from daemons.liveness import HeartbeatSender
from daemons.messages import ChildStatus, NodeInfoReply, NodeRegistration, WorkerExit, WorkerSpec
from daemons.proc import (
    ALLOCATOR_CHOICE_ENV,
    ALLOCATOR_ENV,
    die_with_parent,
    exit_reason,
    interface_for,
    kill_group,
    tail,
    with_allocator_settings,
)
from daemons.proc import free_port as _free_port
from daemons.state import JOB_LOGS_MARKER, check_job_id
from objectstore.memory import resolve_memory_limit
from objectstore.segments import remove_stale_segments
from transport import CurveConfig, RpcClient, RpcServer, TransportError, expose
from transport.peers import ServerLimits

log = logging.getLogger(__name__)

# `-c` rather than `-m daemons.worker`: code run inside a worker imports daemons.worker and must
# see the same module (and its runtime) as the entry point.
WORKER_CMD = [sys.executable, "-c", "from daemons.worker import main; main()"]

# Each worker store keeps one pre-faulted shared-memory segment of this size ready for the first
# same-node pull of an object (see objectstore.store): it costs this much /dev/shm per worker
# (twice that while refilling). Off by default: benchmarks.objectstore, with a consumer that
# reads every byte, measured no gain beyond noise.
DEFAULT_SHM_POOL_BYTES = 0
SHM_POOL_ENV = "ASYNCRL_SHM_POOL_BYTES"
# Each worker store's memory limit in bytes (see objectstore.memory).
STORE_MEMORY_LIMIT_ENV = "ASYNCRL_STORE_MEMORY_LIMIT"
KEYS_ON_STDIN_ENV = "ASYNCRL_KEYS_ON_STDIN"  # a worker reads its key pair (JSON) from stdin
NODE_DEVICES_ENV = "ASYNCRL_NODE_DEVICES"  # a worker's share of the node's cores is one device's
# Besides after each abnormal worker exit, the node sweeps /dev/shm this often: a dead worker's
# forked children can hold its segments' lock a little longer than the worker lives.
SHM_SWEEP_INTERVAL_S = 30.0


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("node task %s crashed", task.get_name(), exc_info=task.exception())


def _sweep_shm() -> None:
    """Remove the shared memory of stores that are gone; a failure is logged, never fatal."""
    try:
        remove_stale_segments()
    except OSError as e:
        log.warning("could not sweep shared-memory segments of dead stores: %s", e)


def discover_devices(cpu_devices: int, gpus_per_node: int = 0) -> list[str]:
    """CUDA GPUs when present (the first `gpus_per_node` of them; 0 = all), else `cpu_devices`
    CPU "devices" so everything runs here."""
    try:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        visible = 0
    if visible:
        if gpus_per_node > visible:
            raise PlacementError(f"cluster.gpus_per_node={gpus_per_node} but this node sees {visible} GPUs; lower it "
                                 "or make more visible (CUDA_VISIBLE_DEVICES)")
        return [f"cuda:{i}" for i in range(gpus_per_node or visible)]
    return [f"cpu:{i}" for i in range(cpu_devices)]


def fork_server_imports(devices: list[str], warm_imports: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """What a node with `devices` has its fork server import (`cluster.warm_imports`): nothing
    with GPUs, whose workers start cold (a GPU worker's CUDA_VISIBLE_DEVICES must be set before
    anything it imports could touch CUDA)."""
    return () if any(d.startswith("cuda") for d in devices) else tuple(warm_imports)


def gpu_env(device: str, visible: str | None) -> dict[str, str]:
    """The environment that pins a worker to `device` ("cuda:i", the i-th GPU this node sees):
    CUDA_VISIBLE_DEVICES names that GPU as the node itself was given it (entry i of the node's
    own CUDA_VISIBLE_DEVICES, such as "5" of SLURM's "4,5,6,7" or a GPU UUID; i itself when
    unset) and the worker calls it cuda:0. Empty for a CPU device."""
    if not device.startswith("cuda:"):
        return {}
    index = int(device.split(":", 1)[1])
    if visible is None:
        physical = str(index)
    else:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if index >= len(ids):
            raise PlacementError(f"device {device} is not among this node's CUDA_VISIBLE_DEVICES={visible!r}; "
                                 "restart the node daemon with the GPUs it may use")
        physical = ids[index]
    return {"CUDA_VISIBLE_DEVICES": physical, "ASYNCRL_DEVICE": "cuda:0"}


KEEP_JOB_LOGS = 20  # job log folders a node keeps (cluster.keep_job_logs)


JOB_LOG_TAIL_BYTES = 4 << 20  # per worker log: what node 0 copies of another node's logs


def _remove_job_logs(folder: Path) -> None:
    """Delete what asyncrl wrote in a job's log folder (worker logs, the marker, other nodes'
    logs copied into marked sub-folders), and the folder once empty; anything else in it stays,
    and so does the folder."""
    for sub in folder.iterdir() if folder.is_dir() else ():
        if sub.is_dir() and not sub.is_symlink() and (sub / JOB_LOGS_MARKER).is_file():
            _remove_job_logs(sub)
    for f in [*folder.glob("worker-*.log"), folder / JOB_LOGS_MARKER]:
        with contextlib.suppress(OSError):
            f.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


# environment variables read as the interpreter or a native library loads (a fork server has
# loaded them already); PYTHONPATH is the exception: a forked worker adds its entries to sys.path
_AT_START = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "TORCH_", "CUDA_", "HF_",
             "TRANSFORMERS_",
             *ALLOCATOR_ENV, ALLOCATOR_CHOICE_ENV)


def _read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_AT_START) and k not in ("PYTHONPATH", "PYTHONUNBUFFERED")}


def _loads_as(env: dict[str, str], ahead: dict[str, str], imports: tuple[str, ...]) -> bool:
    """Whether a worker started with `env` would load as a process started with `ahead` that
    imported `imports` did: the same load-time settings, the same code for those packages."""
    return _load_difference(env, ahead, imports) is None


def _load_difference(env: dict[str, str], ahead: dict[str, str], imports: tuple[str, ...]) -> str | None:
    """What makes a worker started with `env` load otherwise than the fork server did (None: nothing)."""
    mine, its = _read_at_start(env), _read_at_start(ahead)
    if mine != its:  # settings that the interpreter or its libraries read as they load differ
        keys = sorted(k for k in mine.keys() | its.keys() if mine.get(k) != its.get(k))
        return f"{', '.join(keys)} differ from the fork server's"
    for top in sorted({m.split(".")[0] for m in imports}):
        if _found(top, env) != _found(top, ahead):
            return f"{top} would be imported from {_found(top, env)}, not {_found(top, ahead)}"
    return None


def _found(package: str, env: dict[str, str]) -> str | None:
    """Where a worker started with `env` imports `package` from (its file), None if nowhere."""
    path = [os.getcwd(), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *sys.path[1:]]
    for finder in sys.meta_path:  # in the interpreter's order: an editable install's finder too
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        on_path = finder is importlib.machinery.PathFinder
        spec = importlib.machinery.PathFinder.find_spec(package, path) if on_path else find(package, None)
        if spec is not None:
            return spec.origin
    return None


def _start_cold(env: dict[str, str], keys: dict[str, str], log_path: str) -> subprocess.Popen:
    """A worker in a fresh interpreter, in its own session, killed when the node's thread that
    started it dies; its keys written to its stdin."""
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(WORKER_CMD, env={**env, KEYS_ON_STDIN_ENV: "1"} if keys else env,
                                stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if keys else subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent)
    if keys:
        with proc.stdin:  # a few hundred bytes: the pipe buffers them until the worker reads
            proc.stdin.write(json.dumps(keys).encode() + b"\n")
    return proc


@dataclass
class _Child:
    worker_id: str
    proc: subprocess.Popen | forking.ForkedProcess
    log_path: str
    reported: bool = False


class NodeDaemon:
    def __init__(
        self,
        coordinator: str,
        *,
        node_rank: int = 0,
        host: str = "127.0.0.1",
        cpu_devices: int = 2,
        gpus_per_node: int = 0,
        curve: CurveConfig | None = None,
        insecure: bool = False,
        log_dir: str | os.PathLike = "/tmp/asyncrl-logs",
        heartbeat_interval_s: float = 1.0,
        coordinator_timeout_s: float = 10.0,
        node_id: str | None = None,
        shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES,
        head_loss_timeout_s: float | None = None,
        store_memory_limit: int | None = None,
        limits: ServerLimits | None = None,
        keep_job_logs: int = KEEP_JOB_LOGS,
        warm_imports: tuple[str, ...] = (),
    ) -> None:
        self.coordinator_endpoint = coordinator
        self.keep_job_logs = keep_job_logs
        self.node_rank = node_rank
        self.host = host
        self.node_id = node_id or f"{socket.gethostname()}-{node_rank}"
        self.devices = discover_devices(cpu_devices, gpus_per_node)
        self.curve, self.insecure = curve, insecure
        self.log_dir = Path(log_dir)
        self.heartbeat_interval = heartbeat_interval_s
        self.coordinator_timeout = coordinator_timeout_s
        self.head_loss_timeout = head_loss_timeout_s
        self.shm_pool_bytes = shm_pool_bytes
        # None: each store's share of the node's default (a worker per device, and a driver)
        self.store_memory_limit = resolve_memory_limit(store_memory_limit, stores_on_node=len(self.devices) + 1)
        self.children: dict[str, _Child] = {}
        self.warm_imports = fork_server_imports(self.devices, warm_imports)
        self._handed_ports: dict[int, float] = {}  # port -> when free_port gave it out
        self.server = RpcServer(f"tcp://{host}:0", curve=curve, insecure=insecure, limits=limits,
                                name=f"node-{node_rank}")
        self.coordinator = RpcClient(coordinator, curve=curve, insecure=insecure, name="node->coordinator",
                                     heartbeat_interval=heartbeat_interval_s,
                                     heartbeat_timeout=max(2.0, coordinator_timeout_s / 2))
        self.registered = asyncio.Event()
        self.stopped = asyncio.Event()
        self.stop_reason = ""
        self.heartbeats = HeartbeatSender(self.node_id, curve=curve, insecure=insecure,
                                          interval=heartbeat_interval_s, on_unknown=self.registered.clear)
        self._last_contact = time.monotonic()  # last answer from the coordinator (registration)
        self._ever_registered = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server.register_object(self)
        endpoint = await self.server.start()
        loop = asyncio.get_running_loop()
        self.heartbeats.start()
        self._tasks = [loop.create_task(self._keep_registered(), name="node-register"),
                       loop.create_task(self._watch_coordinator(), name="node-watch"),
                       loop.create_task(self._reap(), name="node-reap")]
        for task in self._tasks:
            task.add_done_callback(_log_crash)
        if self.warm_imports:
            # the server imports while the job starts; it stays for the next jobs of a daemon
            forking.start(self.warm_imports, with_allocator_settings(dict(os.environ)))
        return endpoint

    async def wait_registered(self, timeout: float) -> None:
        await asyncio.wait_for(self.registered.wait(), timeout)

    async def close(self) -> None:
        t0 = time.monotonic()
        stopped = await asyncio.to_thread(self.kill_all)
        if stopped:
            log.info("node %s stopped %d worker(s) in %.1fs", self.node_id, stopped, time.monotonic() - t0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.heartbeats.close()
        await self.coordinator.close()
        await self.server.close()

    # registration and heartbeats -------------------------------------------------------
    async def _keep_registered(self) -> None:
        """Register whenever not registered (at start, after the coordinator forgot this node or
        was unreachable); heartbeats then go from the liveness thread."""
        while True:
            if not self.registered.is_set():
                try:
                    reg = NodeRegistration(self.node_id, self.node_rank, self.host,
                                           self.server.endpoint, tuple(self.devices))
                    port = await self.coordinator.call("register_node", reg,
                                                       timeout=max(1.0, self.heartbeat_interval * 3))
                except TransportError as e:
                    log.debug("registering with %s: %s", self.coordinator_endpoint, e)
                else:
                    self._last_contact = time.monotonic()
                    host = self.coordinator_endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
                    self.heartbeats.target(f"tcp://{host}:{port}")
                    self.registered.set()
                    self._ever_registered = True
                    log.info("node %s registered with %s (%d devices)", self.node_id,
                             self.coordinator_endpoint, len(self.devices))
            await asyncio.sleep(self.heartbeat_interval)

    def silence(self) -> float:
        """Seconds since the coordinator last answered this node."""
        return time.monotonic() - max(self._last_contact, self.heartbeats.last_ok)

    async def _watch_coordinator(self) -> None:
        lost = False
        while True:
            await asyncio.sleep(min(0.5, self.heartbeat_interval))
            silent = self.silence()
            if (self.head_loss_timeout is not None and self._ever_registered
                    and silent > self.head_loss_timeout and not self.stopped.is_set()):
                self.stop_reason = (
                    f"the head's coordinator {self.coordinator_endpoint} has been unreachable for "
                    f"{silent:.0f}s (cluster.head_loss_timeout_s={self.head_loss_timeout:g}): node 0 "
                    "died or the network between the nodes is down; this node stops. Restart the job "
                    "(from its last checkpoint) once node 0 is back")
                log.error("%s", self.stop_reason)
                self.stopped.set()  # the owner closes the daemon, which stops the workers
                continue
            if self.registered.is_set() and silent > max(2.0, 3 * self.heartbeat_interval):
                # heartbeats go unanswered: register again through the coordinator's own port (a
                # restarted coordinator has a new heartbeat port; a live one just answers)
                self.registered.clear()
            if silent <= self.coordinator_timeout:
                lost = False
                continue
            if not lost and (self._ever_registered or any(c.proc.poll() is None for c in self.children.values())):
                lost = True
                log.warning("coordinator %s unreachable for %.0fs; stopping this node's workers",
                            self.coordinator_endpoint, silent)
                self.heartbeats.target(None)
                self.registered.clear()  # a restarted coordinator gets this node back
                await asyncio.to_thread(self.kill_all)

    # workers ------------------------------------------------------------------------------
    def _job_log_dir(self, job_id: str) -> Path:
        """`<log_dir>/<job id>`; a new one is marked as ours, and the oldest marked job
        folders beyond `keep_job_logs` go (those of running workers never)."""
        folder = self.log_dir / job_id
        if folder.is_dir():
            return folder
        folder.mkdir(parents=True)
        (folder / JOB_LOGS_MARKER).write_text(job_id + "\n")
        live = {folder.name, *(Path(c.log_path).parent.name for c in self.children.values())}
        try:
            ours = sorted((d for d in self.log_dir.iterdir()
                           if d.is_dir() and d.name not in live and (d / JOB_LOGS_MARKER).is_file()),
                          key=lambda d: d.stat().st_mtime)
        except OSError:
            return folder
        for old in ours[:max(0, len(ours) + len(live) - self.keep_job_logs)]:
            _remove_job_logs(old)
        return folder

    @expose
    async def spawn_worker(self, spec: WorkerSpec) -> int:
        """Start a worker process with `spec.env` added to this daemon's environment; returns its pid."""
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spawn_worker takes a WorkerSpec, got a {type(spec).__qualname__}")
        worker_id = spec.worker_id
        if worker_id in self.children:
            raise ValueError(f"worker {worker_id!r} runs already on node {self.node_id}")
        folder = self._job_log_dir(check_job_id(spec.job_id)) if spec.job_id else self.log_dir
        folder.mkdir(parents=True, exist_ok=True)
        log_path = str(folder / f"worker-{worker_id}.log")
        env, keys = self._worker_env(spec)
        # off the loop: a fork server still importing answers once it has
        proc, how = await asyncio.to_thread(self._start_forked, env, keys, log_path), "forked from the fork server"
        if proc is None:
            proc, how = _start_cold(env, keys, log_path), "cold"
        if worker_id in self.children:  # the same id spawned meanwhile
            kill_group(proc, 0)
            raise ValueError(f"worker {worker_id!r} runs already on node {self.node_id}")
        self.children[worker_id] = _Child(worker_id, proc, log_path)
        log.info("spawned worker %s pid %d, %s (log %s)", worker_id, proc.pid, how, log_path)
        return proc.pid

    def _worker_env(self, spec: WorkerSpec) -> tuple[dict[str, str], dict[str, str]]:
        """A worker's environment (this daemon's, the allocator settings, the spec's, the node's
        facts) and, apart, its CurveZMQ keys."""
        worker_id = spec.worker_id
        full_env = {**with_allocator_settings(dict(os.environ)), SHM_POOL_ENV: str(self.shm_pool_bytes),
                    STORE_MEMORY_LIMIT_ENV: str(self.store_memory_limit),
                    **{k: str(v) for k, v in spec.env.items()},
                    "ASYNCRL_WORKER_ID": worker_id, "ASYNCRL_NODE_ID": self.node_id,
                    "ASYNCRL_HOST": self.host, "ASYNCRL_COORDINATOR": self.coordinator_endpoint,
                    NODE_DEVICES_ENV: str(len(self.devices)), "PYTHONUNBUFFERED": "1"}
        full_env.update(gpu_env(str(spec.env.get("ASYNCRL_DEVICE", "")), os.environ.get("CUDA_VISIBLE_DEVICES")))
        # collectives (gloo/NCCL) must use the interface the cluster talks over, not whatever
        # the hostname resolves to (often 127.0.1.1); a user's own setting wins
        iface = interface_for(self.host)
        if iface is not None:
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                full_env.setdefault(var, iface)
        # keys come from the coordinator in spec.env (its worker key pair): this node's own
        # cluster key never reaches a worker, and an inherited one is dropped
        for key in [k for k in full_env if k.startswith("ASYNCRL_CURVE_")]:
            if key not in spec.env:
                del full_env[key]
        # the worker's keys go through a pipe (its stdin, or the fork server's), never its
        # environment (which any process of the same user reads in /proc/PID/environ)
        keys = {k: full_env.pop(k) for k in [k for k in full_env if k.startswith("ASYNCRL_CURVE_")]}
        if self.insecure:
            full_env["ASYNCRL_INSECURE"] = "1"
        return full_env, keys

    def _start_forked(self, env: dict[str, str], keys: dict[str, str], log_path: str) -> forking.ForkedProcess | None:
        """Fork this worker from the process's fork server (`daemons.forking`) where one runs and
        the worker would load as the server did; None where not (CPU workers only)."""
        ahead = forking.running()
        if ahead is None or any(d.startswith("cuda") for d in self.devices):
            return None
        if (why := _load_difference(env, ahead, forking.imports())) is not None:
            log.info("starting a worker cold: %s", why)
            return None
        try:
            return forking.spawn("daemons.worker:forked_main", ({"env": env, "keys": keys, "log": log_path}, os.getpid()))
        except Exception as e:  # noqa: BLE001 - a server that cannot fork (one of its imports broke it): start cold
            log.warning("the fork server could not start a worker (%s: %s); starting it cold", type(e).__name__, e)
            return None

    @expose(blocking=True)  # waits for the exit: keep the loop free
    def kill_worker(self, worker_id: str, grace_s: float = 5.0) -> bool:
        child = self.children.get(worker_id)
        if child is None:
            return False
        kill_group(child.proc, grace_s)
        return True

    @expose(blocking=True)  # waits for the exits: keep the loop free
    def kill_workers(self, worker_ids: list[str], grace_s: float = 5.0) -> int:
        """Stop these workers (one job's), leaving the node's other workers running."""
        wanted = set(worker_ids)
        return self._kill([c for c in list(self.children.values()) if c.worker_id in wanted], grace_s)

    @expose(blocking=True)  # waits for the exits: keep the loop free
    def kill_all(self, grace_s: float = 5.0) -> int:
        return self._kill(list(self.children.values()), grace_s)

    @staticmethod
    def _kill(children: list[_Child], grace_s: float) -> int:
        """SIGTERM every child's process group at once, then reap each (SIGKILL after `grace_s`)."""
        alive = [c for c in children if c.proc.poll() is None]
        for child in alive:
            try:
                os.killpg(child.proc.pid, 15)
            except ProcessLookupError:
                pass
        for child in alive:
            kill_group(child.proc, grace_s)
        return len(alive)

    @expose
    def exits(self, worker_ids: list[str]) -> list[WorkerExit]:
        """The exits (code, reason, log tail) of those of `worker_ids` that have ended, now."""
        out = []
        for worker_id in worker_ids:
            child = self.children.get(worker_id)
            code = None if child is None else child.proc.poll()
            if code is not None:
                out.append(WorkerExit(worker_id, code, exit_reason(code), tail(child.log_path)))
        return out

    @expose
    def free_port(self) -> int:
        """A port for a rendezvous listener, never one handed out in the last 10 minutes (two
        pools asking at once must not get the same port before either binds it)."""
        now = time.monotonic()
        self._handed_ports = {p: t for p, t in self._handed_ports.items() if now - t < 600}
        port = _free_port(self.host, avoid=self._handed_ports)
        self._handed_ports[port] = now
        return port

    @expose
    def shutdown(self) -> None:
        self.stopped.set()

    @expose(blocking=True)  # file reads stay off the daemon's event loop
    def job_logs(self, job_id: str, max_bytes: int = JOB_LOG_TAIL_BYTES) -> dict:
        """The last `max_bytes` of each worker log of job `job_id` on this node, for node 0 to
        keep beside its own: {"host", "dir", "files": {name: bytes}}. Only `worker-*.log` regular
        files of the job's folder are read (no links followed)."""
        folder = self.log_dir / check_job_id(job_id)
        max_bytes = max(0, min(int(max_bytes), JOB_LOG_TAIL_BYTES))
        files: dict[str, bytes] = {}
        if folder.is_dir() and not folder.is_symlink():
            for path in sorted(folder.glob("worker-*.log")):
                try:  # non-blocking: a FIFO under that name must not hang the call
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue  # a link or a file that went
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):  # a directory, FIFO or device named like a log
                    os.close(fd)
                    continue
                with os.fdopen(fd, "rb") as f:
                    f.seek(max(0, info.st_size - max_bytes))
                    files[path.name] = f.read(max_bytes)
        return {"host": socket.gethostname(), "dir": str(folder.resolve()), "files": files}

    @expose
    def info(self) -> NodeInfoReply:
        return NodeInfoReply(self.node_id, self.host, tuple(self.devices),
                             {w: ChildStatus(c.proc.pid, exit_reason(c.proc.poll()), c.log_path)
                              for w, c in self.children.items()})

    async def _reap(self) -> None:
        """Report each worker's exit (code or signal, and its log tail) to the coordinator, and
        remove the shared memory of stores that died without closing."""
        last_sweep = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            if time.monotonic() - last_sweep > SHM_SWEEP_INTERVAL_S:
                last_sweep = time.monotonic()
                _sweep_shm()
            for child in list(self.children.values()):
                code = child.proc.poll()
                if code is None or child.reported:
                    continue
                child.reported = True
                reason = exit_reason(code)
                log.info("worker %s %s", child.worker_id, reason)
                if code != 0:  # a killed store cannot unlink its shared memory: do it for it
                    _sweep_shm()
                try:
                    await self.coordinator.call(
                        "worker_exited", WorkerExit(child.worker_id, code, reason, tail(child.log_path)),
                        timeout=5)
                except TransportError as e:
                    log.warning("could not report exit of %s: %s", child.worker_id, e)
                # reported: forget it, so a daemon serving job after job does not grow
                if self.children.get(child.worker_id) is child:
                    del self.children[child.worker_id]
