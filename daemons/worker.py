"""Worker process entry point: an RPC server plus a local object store.

A node daemon starts `python -m daemons.worker` with the environment distributed training
expects (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES …) and
asyncrl's own (ASYNCRL_WORKER_ID, ASYNCRL_COORDINATOR, ASYNCRL_HOST, keys). The worker reports
`worker_ready` to the coordinator and then serves calls: `run` executes an importable function
by its dotted path (code never travels over the wire), and hosted objects (the programming
model's Worker classes) are created and called by name.

Only functions and classes of allowed packages can be named (`AllowList`): asyncrl's own, the
job's package and `cluster.allowed_packages`, handed over in ASYNCRL_ALLOWED_PACKAGES. The check
happens before anything is imported (importing runs code), and the object found must itself be
defined in an allowed module, so `asyncrl.launch:os.system` is refused like `os:system`.

The process's `WorkerRuntime` is handed to code explicitly, never through a global: a function
run by `run` that has a `runtime` parameter gets it as that keyword, and a hosted class that
defines `create_hosted(runtime, *args, **kwargs)` is built through it (asyncrl's `Worker` does).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daemons.errors import NotAllowedError
from daemons.logs import setup_logging
from daemons.messages import WorkerReady
from daemons.node import KEYS_ON_STDIN_ENV, SHM_POOL_ENV, STORE_MEMORY_LIMIT_ENV
from daemons.proc import die_with, exit_now, lock_progress_bars_by_thread, use_allocator_settings
from objectstore import ObjectRef, ObjectStore
from objectstore.memory import resolve_memory_limit
from transport import CurveConfig, RpcClient, RpcServer, expose, trace
from transport.checks import ConfigError
from transport.loop import run
from transport.peers import ServerLimits

log = logging.getLogger(__name__)


ALLOWED_ENV = "ASYNCRL_ALLOWED_PACKAGES"
COORDINATOR_KEY_ENV = "ASYNCRL_CURVE_COORDINATOR"  # the coordinator's public key
# asyncrl's own packages a worker may always run from (its Worker classes, jobs, rewards)
BUILTIN_ALLOWED = ("asyncrl",)


@dataclass(frozen=True)
class AllowList:
    """The packages whose functions and classes a worker runs; anything else is refused."""

    packages: tuple[str, ...] = BUILTIN_ALLOWED

    @classmethod
    def from_env(cls, env: dict[str, str]) -> AllowList:
        extra = [p.strip() for p in env.get(ALLOWED_ENV, "").split(",") if p.strip()]
        return cls(tuple(dict.fromkeys([*BUILTIN_ALLOWED, *extra])))

    def allows(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.packages)

    def check(self, module: str, path: str) -> None:
        if not self.allows(module):
            raise NotAllowedError(
                f"this worker runs only code from {', '.join(self.packages)}; {path!r} is in "
                f"{module!r}. Add its package to cluster.allowed_packages (or define the function "
                "in the job's own package)")


def split_path(path: str) -> tuple[str, str]:
    """`package.module:attr` (or `package.module.attr`) as (module, attr)."""
    if not isinstance(path, str):
        raise ConfigError(f"{path!r} is not an importable 'module:name' path")
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{path!r} is not an importable 'module:name' path")
    return module_name, attr


def entry_package(entry: str | None) -> str | None:
    """The package a job entry lives in: `pkg` for "pkg.mod:main", the script's module name for
    "path/to/script.py:main" (workers import it from the script's directory)."""
    if not entry:
        return None
    path, sep, _ = entry.rpartition(":")
    path = path if sep else entry
    if path.endswith(".py"):
        return path.rsplit("/", 1)[-1][:-3] or None
    return path.split(".", 1)[0] or None


def resolve_allowed(path: str, allowed: AllowList) -> Any:
    """`resolve(path)` for a path a peer sent: its module, and the module defining the object it
    names, must be in `allowed`; no private attributes on the way."""
    module_name, attr = split_path(path)
    allowed.check(module_name, path)
    if any(part.startswith("_") for part in attr.split(".")):
        raise NotAllowedError(f"{path!r} names a private attribute; workers run only public "
                              "functions and classes")
    obj = resolve(path)
    defined_in = getattr(obj, "__module__", None)
    if not callable(obj) or not isinstance(defined_in, str):
        raise NotAllowedError(f"{path!r} is not a function or class defined in {module_name!r}")
    allowed.check(defined_in, path)
    return obj


async def resolve_off_loop(path: str, allowed: AllowList) -> Any:
    """`resolve_allowed`, importing a module not loaded yet in a thread: a role's first import
    (torch, transformers: seconds, over 10 s on a loaded machine) must not stall heartbeats."""
    module = sys.modules.get(split_path(path)[0])
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        return resolve_allowed(path, allowed)
    return await asyncio.to_thread(resolve_allowed, path, allowed)


def resolve(path: str) -> Any:
    """Import `package.module:attr` (or `package.module.attr`). Trusted callers only (the
    launcher resolving its own job entry); a path from the network goes through `resolve_allowed`."""
    module_name, attr = split_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import {module_name!r} for {path!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


@dataclass
class WorkerRuntime:
    """What a function running inside a worker can see about its process."""

    worker_id: str
    node_id: str
    rank: int
    world_size: int
    local_rank: int
    device: str
    group: str
    store: ObjectStore
    loop: asyncio.AbstractEventLoop
    instances: dict[str, Any] = field(default_factory=dict)
    allowed: AllowList = field(default_factory=AllowList)
    state: dict[str, Any] = field(default_factory=dict)  # what the layers above keep per process

    def resolve(self, path: str) -> Any:
        """The function or class `path` names, if this worker's allow-list admits it."""
        return resolve_allowed(path, self.allowed)

    def _in_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def put(self, value: Any) -> ObjectRef:
        """Store `value` in this worker's object store (callable from any thread)."""
        if self._in_loop() or threading.current_thread() is threading.main_thread():
            return self.store.put(value)
        return asyncio.run_coroutine_threadsafe(_call_async(self.store.put, value), self.loop).result()

    def get(self, ref: ObjectRef, rows: tuple[int, int] | None = None) -> Any:
        """Fetch `ref` (or its rows) from a worker thread; async code awaits `store.get`."""
        if self._in_loop():
            raise RuntimeError("inside the event loop use `await runtime.store.get(ref)`")
        return asyncio.run_coroutine_threadsafe(self.store.get(ref, rows), self.loop).result()


async def _call_async(fn: Callable, *args: Any) -> Any:
    return fn(*args)


def takes(fn: Callable, name: str) -> bool:
    """Whether `fn` has a parameter called `name` (builtins without a signature have none)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def wants_runtime(fn: Callable) -> bool:
    """Whether `fn` takes the worker's runtime (it has a parameter named `runtime`)."""
    return takes(fn, "runtime")


class WorkerProcess:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.worker_id = env["ASYNCRL_WORKER_ID"]
        self.node_id = env["ASYNCRL_NODE_ID"]
        self.rank = int(env.get("RANK", "0"))
        self.host = env.get("ASYNCRL_HOST", "127.0.0.1")
        self.insecure = env.get("ASYNCRL_INSECURE") == "1"
        # the worker key pair (servers here present it); the coordinator presents its own key
        self.curve = None if self.insecure else CurveConfig.from_env(env)
        self.coordinator_curve = None
        if self.curve is not None:
            self.coordinator_curve = CurveConfig(self.curve.public_key, self.curve.secret_key,
                                                 env[COORDINATOR_KEY_ENV].encode())
        elif not self.insecure:
            raise ConfigError("this worker got no keys (ASYNCRL_CURVE_*) and is not insecure; "
                              "workers are started by a node daemon, not by hand")
        self.limits = ServerLimits.from_env(env)
        self.shm_pool_bytes = int(env.get(SHM_POOL_ENV, "0"))
        limit = env.get(STORE_MEMORY_LIMIT_ENV)  # set by the node daemon
        self.store_memory_limit = resolve_memory_limit(int(limit) if limit else None, stores_on_node=1)
        self.allowed = AllowList.from_env(env)
        self.stopped = asyncio.Event()
        self.store: ObjectStore | None = None
        self.runtime: WorkerRuntime | None = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        store = self.store = ObjectStore(
            node_id=self.node_id, endpoint=f"tcp://{self.host}:0", bulk_host=self.host,
            curve=self.curve, insecure=self.insecure, limits=self.limits, name=f"store-{self.worker_id}",
            shm_pool_bytes=self.shm_pool_bytes, memory_limit_bytes=self.store_memory_limit)
        await store.start()
        self.runtime = WorkerRuntime(
            worker_id=self.worker_id, node_id=self.node_id, rank=self.rank,
            world_size=int(self.env.get("WORLD_SIZE", "1")), local_rank=int(self.env.get("LOCAL_RANK", "0")),
            device=self.env.get("ASYNCRL_DEVICE", "cpu"), group=self.env.get("ASYNCRL_GROUP", ""),
            store=store, loop=loop, allowed=self.allowed)
        server = RpcServer(f"tcp://{self.host}:0", curve=self.curve, insecure=self.insecure,
                           limits=self.limits, name=f"worker-{self.worker_id}")
        server.register_object(self)
        await server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopped.set)
        coordinator = RpcClient(self.env["ASYNCRL_COORDINATOR"], curve=self.coordinator_curve, insecure=self.insecure,
                                name="worker->coordinator")
        await coordinator.call("worker_ready", WorkerReady(self.worker_id, server.endpoint,
                                                           store.endpoint, os.getpid()), timeout=30)
        log.info("worker %s ready at %s (store %s)", self.worker_id, server.endpoint, store.endpoint)
        await self.stopped.wait()
        log.info("worker %s shutting down", self.worker_id)
        await coordinator.close()
        await server.close()
        await store.close()

    # endpoints ------------------------------------------------------------------------------
    @expose
    async def run(self, fn_path: str, args: list, kwargs: dict) -> Any:
        """Run the importable function `fn_path` ("module:name") of an allowed package."""
        fn = await resolve_off_loop(fn_path, self.allowed)
        if wants_runtime(fn):
            kwargs = {**kwargs, "runtime": self.runtime}
        return await _invoke(fn, args, kwargs)

    @expose
    def ping(self) -> str:
        return self.worker_id

    @expose
    def shutdown(self) -> None:
        self.stopped.set()

    @expose
    def trace_start(self) -> None:
        """Record this process's spans until `trace_collect` (`asyncrl.single_controller.trace`)."""
        trace.start()

    @expose
    def trace_collect(self) -> dict[str, Any]:
        return {**trace.collect(), "pid": os.getpid()}

    @expose
    def trace_clock(self) -> int:
        return trace.clock_ns()

    @expose
    def store_stats(self) -> dict[str, Any]:
        if self.store is None:
            raise RuntimeError(f"worker {self.worker_id} has not started its object store yet")
        return self.store.stats()

    @expose
    async def create_instance(self, name: str, cls_path: str, args: list, kwargs: dict) -> str:
        cls = await resolve_off_loop(cls_path, self.allowed)
        create = getattr(cls, "create_hosted", None)
        if create is not None:  # the class takes this process's runtime
            instance = await asyncio.to_thread(create, self.runtime, *args, **kwargs)
        else:
            instance = await asyncio.to_thread(cls, *args, **kwargs)
        self.runtime.instances[name] = instance
        return name

    @expose
    async def call_instance(self, name: str, method: str, args: list, kwargs: dict) -> Any:
        instance = self.runtime.instances.get(name)
        if instance is None:
            raise KeyError(f"this worker hosts no instance {name!r}; hosted: {sorted(self.runtime.instances)}")
        if method.startswith("_"):
            raise AttributeError(f"private method {method!r} cannot be called remotely")
        fn = getattr(instance, method, None)
        if fn is None:
            raise AttributeError(f"{type(instance).__qualname__} has no method {method!r}")
        with trace.span(f"{name}.{args[0] if method.startswith('asyncrl_') and args else method}", "call"):
            return await _invoke(fn, args, kwargs)


async def _invoke(fn: Callable, args: list, kwargs: dict) -> Any:
    """Coroutines run on the loop; plain functions in a thread so heartbeats keep flowing."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


def _take_work(work: dict) -> dict[str, str]:
    """Become the worker `work` describes (environment, keys, log file) in a process that has
    imported ahead: its output goes to the log, its environment and PYTHONPATH are the work's."""
    fd = os.open(work["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(work["env"])
    # PYTHONPATH as the interpreter would have read it: after the script's own entry ('' for -c)
    extra = [p for p in work["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    return {**work["env"], **work["keys"]}


def forked_main(work: dict, node_pid: int) -> None:
    """A worker forked from the node's fork server (`daemons.forking`): its own session, killed
    when the node's process dies (as a cold worker is by its parent-death signal), then `work`'s."""
    os.setsid()
    die_with(node_pid)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    _serve(_take_work(work))


def main() -> None:
    env = dict(os.environ)
    if env.pop(KEYS_ON_STDIN_ENV, None) == "1":  # the node daemon's pipe: keys never in the environment
        env.update(json.loads(sys.stdin.readline()))
        sys.stdin.close()
    _serve(env)


def _serve(env: dict[str, str]) -> None:
    use_allocator_settings()  # by mallopt too: a GLIBC_TUNABLES in the environment would override ALLOCATOR_ENV
    lock_progress_bars_by_thread()  # no named semaphore a kill -9 would leave in /dev/shm
    for key in [k for k in os.environ if k.startswith("ASYNCRL_CURVE_")]:
        del os.environ[key]  # the code this worker runs, and its children, need no keys
    setup_logging("worker", env.get("RANK"))
    run(WorkerProcess(env).serve())
    exit_now(0)  # the store and sockets are closed: the interpreter's teardown is not waited for


if __name__ == "__main__":
    main()
