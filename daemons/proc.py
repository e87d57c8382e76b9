"""Child-process helpers: no orphans, signals by process group, readable exit reasons."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

_PR_SET_PDEATHSIG = 1

# How asyncrl's processes allocate CPU memory, read as a process starts (a value the user set is
# kept; ASYNCRL_ALLOCATOR=system keeps torch's and glibc's own defaults): torch asks the kernel
# for transparent huge pages for its blocks of 2 MiB and more, and glibc serves every block from
# its heap, never a fresh mapping, so a freed block is reused rather than unmapped and faulted in
# again (glibc 2.36 ignores a trim threshold above 2**31 - 1 given in the environment, keeping its
# 128 KiB default: probed) (`asyncrl.single_controller.memory.release_host_memory` gives the free pages back after an update
# and before each phase a worker measures).
# The 0.5B shape's update on 2 cores, in micro-batches of 2 rows: 36.8 s and 7.0 M page faults
# with the defaults, 23.6 s and 20 K with these (`python -m benchmarks.training`).
ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
ALLOCATOR_CHOICE_ENV = "ASYNCRL_ALLOCATOR"


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def with_allocator_settings(env: dict[str, str]) -> dict[str, str]:
    """`env` (changed in place) with ALLOCATOR_ENV's settings where it has none of its own."""
    if env.get(ALLOCATOR_CHOICE_ENV) != "system":
        for key, value in ALLOCATOR_ENV.items():
            env.setdefault(key, value)
    return env


def use_allocator_settings() -> None:
    """This process and its children allocate with ALLOCATOR_ENV's settings: glibc's through
    mallopt (it read the environment as the process started), torch's through the environment
    (call before torch first allocates)."""
    env = with_allocator_settings(os.environ)  # type: ignore[arg-type]
    try:
        libc = ctypes.CDLL("libc.so.6")
        for key, param in (("MALLOC_MMAP_MAX_", _M_MMAP_MAX), ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD)):
            if key in env:  # mallopt takes an int
                libc.mallopt(param, ctypes.c_int(min(int(env[key]), 2**31 - 1)))
    except (OSError, AttributeError, ValueError):  # not glibc: its settings do not apply
        pass


def lock_progress_bars_by_thread() -> None:
    """tqdm's bars in this process lock with a thread lock instead of its default multiprocessing
    lock: in a process forked from a fork server that is a named semaphore in /dev/shm, which a
    worker killed (kill -9) together with its resource tracker leaves behind. A worker's bars
    (transformers draws one as it loads weights) share their lock with no other process."""
    try:
        from tqdm import tqdm
    except ImportError:  # no bars to lock
        return
    tqdm.set_lock(threading.RLock())


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the spawning thread's process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def die_with(pid: int) -> None:
    """This process gets SIGKILL when process `pid` (not its parent) ends: a thread waits on a
    pidfd of it. Already gone: SIGKILL now."""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()


def exit_now(code: int) -> None:
    """End this process with `code` once its own threads and exit handlers have run, skipping
    the interpreter's teardown of every module (about 1 s with torch loaded, measured on the
    2-core machine, per launch and per worker). Call it last, after everything is closed."""
    import atexit
    import logging
    import sys
    import threading

    if threading.current_thread() is threading.main_thread():
        # what a normal exit does first: thread pools told to stop, non-daemon threads waited for
        threading._shutdown()
    atexit._run_exitfuncs()  # weakref finalizers, libraries' teardowns (verifiers' environments)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a reader that went away
            pass
    os._exit(code)


def exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`, and reap the child."""
    end_group(proc.pid, lambda: proc.poll() is None, proc.wait, grace_s)


def end_group(pid: int, alive: Callable[[], bool], reap: Callable[[], Any], grace_s: float = 5.0) -> None:
    """`kill_group` for any child whose group `pid` leads: `alive()` says whether the leader
    runs, `reap()` waits for it (a `multiprocessing.Process`: `is_alive`, `join`)."""
    if alive():
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers in the group, even if the leader exited
    except (ProcessLookupError, PermissionError):
        pass
    reap()


def run_spawned(target: Any, args_per_process: list[tuple], timeout_s: float,
                start_method: str = "spawn") -> list[int | None]:
    """Run `target(*args)` in one spawned process per entry of `args_per_process` and wait until
    all have ended, one has failed (its peers would wait in a collective forever) or `timeout_s`
    passed; the survivors are killed and every process is reaped. Returns the exit codes.

    `start_method="forkserver"` forks each process from multiprocessing's fork server, which
    imports its preload list (`multiprocessing.set_forkserver_preload`) once: a caller that
    starts many short rank groups skips their imports."""
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_per_process]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [p.exitcode for p in procs]


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LISTEN_PORTS = (20000, 32768)  # below Linux's default ephemeral range


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free on `host` now, for a listener that binds it a little later.

    A port from bind(0) comes from the kernel's ephemeral range, the range outgoing connections
    take their local ports from: on a busy host one of them can take it before the listener
    binds (EADDRINUSE in a rendezvous). So the port is drawn outside that range where there is
    room, skipping `avoid` (ports handed out but perhaps not bound yet).
    """
    span = _outside_ephemeral()
    for _ in range(200 if span else 0):
        port = random.randrange(*span)
        if port not in avoid and _bindable(host, port):
            return port
    for _ in range(20):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free port on {host} outside {sorted(avoid)[:5]}…")


def _outside_ephemeral() -> tuple[int, int] | None:
    """(low, high) for listener ports below the ephemeral range; None where it leaves no room."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LISTEN_PORTS
    high = min(first, _LISTEN_PORTS[1])
    return (_LISTEN_PORTS[0], high) if high - _LISTEN_PORTS[0] >= 1000 else None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def route_ip(peer_host: str, peer_port: int = 9) -> str:
    """The local address this machine uses to reach `peer_host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, peer_port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


def interface_for(ip: str) -> str | None:
    """Name of the network interface that carries IPv4 address `ip` (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None
