"""Processes forked from one pre-imported fork server per test session (tests only).

A rank group or an `asyncrl-launch` started as a fresh interpreter imports torch, transformers
and asyncrl first: 3-5 s of CPU a process on the 2-core CI machine, paid ~100 times a suite.
Here they fork from multiprocessing's fork server instead, which imported `PRELOAD` once. The
server is a fresh single-threaded process (not the test process), started as the session starts
(tests/conftest.py) with the test process's environment and sys.path; each child takes its own
environment, working directory and PYTHONPATH entries before it runs anything. The node daemons
of the test process and of forked launches fork their CPU workers from it too (`daemons.forking`;
a launch is handed the server's address). What a library reads from the
environment as it is imported (HF_HOME, say) comes from the server's start: such tests, and
tests of the command line itself (its imports, its exit, what a shell sees), start the real
command instead.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daemons import forking
from daemons.proc import end_group

# what every rank group and launch imports; one list: the server reads it once, when it starts
PRELOAD = ["torch", "torch.distributed", "transformers", "asyncrl.launch", "asyncrl.trainer",
           "asyncrl.roles.warm", "asyncrl.train.fsdp", "asyncrl.train.pipeline", "asyncrl.rollout.engine",
           "daemons.worker", "matplotlib.figure", "tests.helpers.forked", "tests.helpers.gloo_ranks",
           "tests.helpers.vllm_warm"]


def context() -> Any:
    """The fork-server context, the server started with PRELOAD: the node daemons of this
    process fork their CPU workers from it too (`daemons.forking`)."""
    forking.start(PRELOAD)
    return multiprocessing.get_context("forkserver")


def _adopt(address: Any, env: dict[str, str]) -> None:
    """In a process forked from the server: fork from that server too (its node daemons' workers),
    not start one of its own. The server's other ends (its alive pipe, the resource tracker)
    came with the fork; its address and starting environment are what this process lacks."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    server.ensure_running = lambda: None  # it runs: this process did not start it, so has no pid to poll
    forking._state.update(env=env, imports=tuple(PRELOAD))


def launch(argv: list[str], *, env: Mapping[str, str], cwd: Path | str, timeout: float,
           command: str = "asyncrl-launch") -> subprocess.CompletedProcess:
    """`asyncrl-launch *argv` (or `command="asyncrl"`: the `asyncrl` command, e.g. `asyncrl replay`)
    as `subprocess.run(..., capture_output=True, text=True)` would run it, forked from the fork
    server: its own session (a timeout kills it and every process it started), environment and
    working directory; TimeoutExpired past `timeout`."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-launch-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        ctx = context()
        handoff = (multiprocessing.forkserver._forkserver._forkserver_address, forking.running())  # type: ignore[attr-defined]
        proc = ctx.Process(target=_launch_main, args=(list(argv), dict(env), str(cwd), str(out), str(err), handoff,
                                                      command))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        end_group(proc.pid, proc.is_alive, proc.join)  # the launch if it still runs, and all it left behind
        if timed_out:
            raise subprocess.TimeoutExpired([command, *argv], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess([command, *argv], proc.exitcode, out.read_text(), err.read_text())


def _launch_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, handoff: tuple,
                 command: str = "asyncrl-launch") -> None:
    """In the forked child: become what a fresh `asyncrl-launch` process would be, then run it."""
    os.setsid()
    _adopt(*handoff)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # what `python -m` would put first on sys.path: the working directory, then PYTHONPATH
    first = [cwd, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:0] = [p for p in dict.fromkeys(first) if p not in sys.path]
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.argv = [command, *argv]
    from daemons.proc import exit_now

    if command == "asyncrl":
        from asyncrl.cli import main
    else:
        from asyncrl.launch import main
    exit_now(main(argv))


def run(cmd: list[str], *, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, ...)` for `cmd` =
    `[sys.executable, "-m", "asyncrl.launch", *argv]`, through `launch`."""
    if cmd[:3] != [sys.executable, "-m", "asyncrl.launch"]:
        raise ValueError(f"forked.run runs `python -m asyncrl.launch ...`, not {cmd[:3]}")
    return launch(cmd[3:], env=os.environ if env is None else env, cwd=cwd or os.getcwd(), timeout=timeout)
