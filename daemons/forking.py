"""Workers forked from a pre-imported fork server instead of started as fresh interpreters.

A worker started cold imports torch, transformers and asyncrl first: ~5 s of CPU each on the
2-core machine. A process that runs node daemons may start one fork server (multiprocessing's)
that imports a module list once; a CPU worker is then forked from it in milliseconds and takes
its own environment, keys and log before it runs anything (`daemons.worker.forked_main`). The
server belongs to the process (multiprocessing keeps one per process), so its state is this
module's. A worker whose load-time settings or code path differ from the server's starts cold
(`daemons.node._loads_as` checks).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import os
import time
from typing import Any

_state: dict[str, Any] = {"env": None, "imports": ()}


def start(imports: list[str] | tuple[str, ...], env: dict[str, str] | None = None) -> None:
    """Start this process's fork server importing `imports`, with environment `env` (this
    process's by default); a no-op if it runs already. What forks from it skips those imports."""
    if _state["env"] is not None:
        return
    env = dict(os.environ) if env is None else env
    multiprocessing.set_forkserver_preload([*imports, "daemons.preloaded"])  # the last one freezes the heap
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # multiprocessing starts the server with this process's environment
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _state.update(env=env, imports=tuple(imports))


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
