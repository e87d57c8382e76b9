"""Workers forked from a pre-imported fork server instead of started as fresh interpreters.

A worker started cold imports torch, transformers and asyncrl first: ~5 s of CPU each on the
2-core machine. A process that runs node daemons may start one fork server (multiprocessing's)
that imports a module list once; a CPU worker is then forked from it in milliseconds and takes
its own environment, keys and log before it runs anything (`daemons.worker.forked_main`). The
server belongs to the process (multiprocessing keeps one per process), so its state is this
module's. A worker whose load-time settings or code path differ from the server's starts cold
(`daemons.node._loads_as` checks).

The server is a fresh interpreter, or (`start(..., here=True)`, `asyncrl-launch` before it starts
anything) this process forked: what it imported already (torch, the job's module: ~7 s of a
launch's ~11 s of server imports) is then not imported again.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import os
import socket
import sys
import threading
import time
from multiprocessing import connection, resource_tracker
from typing import Any

_state: dict[str, Any] = {"env": None, "imports": ()}
_SERVER_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]  # Python 3.11 and 3.12


def start(imports: list[str] | tuple[str, ...], env: dict[str, str] | None = None, here: bool = False) -> int | None:
    """Start this process's fork server importing `imports`, with environment `env` (this
    process's by default); a no-op if it runs already. What forks from it skips those imports.
    `here`: the server is this process, forked, when it can be (`can_fork_here`; else a fresh
    interpreter): it must have loaded what it imported with `env`'s load-time settings. The
    server's pid when this process forked it."""
    if _state["env"] is not None:
        return None
    env = dict(os.environ) if env is None else env
    multiprocessing.set_forkserver_preload([*imports, "daemons.preloaded"])  # the last one freezes the heap
    if here and can_fork_here() and (pid := _fork_here(env)) is not None:
        _state.update(env=env, imports=tuple(imports))
        return pid
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # multiprocessing starts the server with this process's environment
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _state.update(env=env, imports=tuple(imports))
    return None


def can_fork_here() -> bool:
    """Whether a fork of this process would be whole: one thread (no other Python thread, no zmq
    context's I/O threads, no running event loop), on a Python whose fork server `_fork_here`
    knows how to start (3.14's, say, is also given a key to check its clients with)."""
    zmq = sys.modules.get("zmq")
    try:
        asyncio.get_running_loop()
        return False
    except RuntimeError:
        pass
    known = list(inspect.signature(multiprocessing.forkserver.main).parameters) == _SERVER_MAIN_PARAMETERS
    return threading.active_count() == 1 and (zmq is None or zmq.Context._instance is None) and known


def _fork_here(env: dict[str, str]) -> int | None:
    """multiprocessing's `ForkServer.ensure_running`, with this process forked instead of a fresh
    interpreter started: the child takes `env` and the allocator settings, imports the preload
    list and serves; it ends (as that server does) when every holder of the alive pipe has. None
    when the fork fails (no server: the caller starts a fresh one)."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    resource_tracker.ensure_running()  # before the fork: the server's children share this one
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:  # no memory or no process slot for a copy of this process
            os.close(alive_r)
            os.close(alive_w)
            return None
        if pid == 0:
            os.close(alive_w)
            _serve_here(listener.fileno(), alive_r, env, server._preload_modules)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


def _serve_here(listener: int, alive_r: int, env: dict[str, str], preload: list[str]) -> None:
    """The forked server's life: only the descriptors a fresh one is given (the others this process
    inherited from its own parent would stay open in every worker: a pipe's reader would never see
    its end), `env`, then multiprocessing's server loop; its exit status as a fresh one's (0 when
    the alive pipe closes, 1 and the traceback on an error), never the launcher's exit handlers."""
    import traceback

    from daemons.proc import use_allocator_settings

    code = 1
    try:
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2 and fd not in (listener, alive_r) and _inheritable(fd):
                os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        use_allocator_settings()
        multiprocessing.forkserver.main(listener, alive_r, preload)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # the listing's own descriptor, closed by now
        return False


def threads() -> int:
    """The threads this process runs, native ones included (Linux: /proc; 0 elsewhere), but not
    jemalloc's background thread (pyarrow's allocator, started by its first table: jemalloc's own
    fork handlers take care of it, and a fresh server that imported `asyncrl.roles.warm` has one too)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    return sum(1 for t in tasks if _thread_name(t) != "jemalloc_bg_thd")


def _thread_name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return ""


def running() -> dict[str, str] | None:
    """The environment the fork server started with (what its load-time settings are); None
    when this process runs none."""
    return _state["env"]


def imports() -> tuple[str, ...]:
    return _state["imports"]


class ForkedProcess:
    """A process forked from the fork server, with what the node uses of a `subprocess.Popen`;
    its exit status comes through the server (it is the server's child)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self._proc = proc
        self.pid: int = proc.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode


def _call(target: str, args: tuple) -> None:
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*args)


def spawn(target: str, args: tuple, group_wait_s: float = 5.0) -> ForkedProcess:
    """Fork `target(*args)` ("module:function") from the running server; it must make itself a
    session leader (`os.setsid`) first: this returns once it has (or it ended), so its group
    can be killed."""
    proc = multiprocessing.get_context("forkserver").Process(target=_call, args=(target, args), daemon=False)
    proc.start()
    # the node kills, reaps and reports its workers itself: multiprocessing must not join them
    # as this process exits (a node's exit would wait on every worker still running)
    multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]
    deadline = time.monotonic() + group_wait_s
    while proc.exitcode is None and time.monotonic() < deadline:
        try:
            if os.getpgid(proc.pid) == proc.pid:  # type: ignore[arg-type]
                break
        except ProcessLookupError:
            break
        time.sleep(0.001)
    return ForkedProcess(proc)
