"""Run model-written Python in a sandbox: a child process per call, limited and cut off.

Each call gets a fresh temporary working directory (removed afterwards) and a new Python
interpreter (`-I`: no user site, no environment variables read) in a session of its own, which
before it runs the code:

- sets resource limits: CPU seconds, address space, file size, open files, no core dumps;
- leaves the network: a new network namespace (only a loopback that is down) where the kernel
  allows one (as root, or through a user namespace);
- gets a filesystem of its own in a new mount namespace (same condition): a root that holds the
  interpreter and the system libraries read-only, its directory at `/sandbox`, a private `/tmp`
  and `/dev`'s null, zero and urandom: no host `/tmp`, `/home`, `/proc`, `/dev/shm`, datasets or
  reward files to read (where the kernel refuses, it runs on the host's files and says so once);
- as root, becomes `nobody`, so the process-count limit applies and the rest of the disk is
  not writable;
- installs an audit hook (`sys.addaudithook`, which code cannot remove) refusing sockets,
  process creation (fork, exec, spawn, subprocess, os.system), ctypes, and writes, renames or
  deletions outside its directory.

The parent kills the whole session at the wall-clock limit, reads at most `output_bytes` of
stdout and stderr, and reports what happened as a `RunResult`; nothing the code does raises in
the caller. Code that breaks out of all of this would need a kernel or CPython escape: run the
daemon itself in a container or VM where the model's code is untrusted beyond that.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

NOBODY = 65534
log = logging.getLogger(__name__)
_MARK = "@@asyncrl-sandbox@@ "
# standard modules imported before the code runs (and before root is dropped, where the stdlib
# may sit in a directory `nobody` cannot read): what model-written maths and text code imports
PRELOAD = ("math", "cmath", "re", "json", "itertools", "functools", "collections", "fractions", "decimal",
           "statistics", "random", "string", "datetime", "heapq", "bisect", "operator", "typing",
           "dataclasses", "copy", "textwrap", "numbers", "array", "enum", "time")


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the run's whole process session is killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU): a busy loop ends here even if the wall limit is longer."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS), MiB: an allocation past it raises MemoryError in the code."""
    file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), MiB."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    processes: int = 8
    """Processes of the sandbox user (RLIMIT_NPROC; applies where the run drops root)."""
    output_bytes: int = 16384
    """stdout and stderr each kept up to this many bytes; the rest is dropped (and said)."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value!r}")


@dataclass
class RunResult:
    """What a sandboxed run did; `error` is None when it exited 0 in time."""

    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float
    timed_out: bool = False
    truncated: bool = False
    isolated_network: bool = False
    own_filesystem: bool = False
    """The code saw a root of its own (a mount namespace), not the host's files."""

    @property
    def error(self) -> str | None:
        if self.timed_out:
            return "TimeoutError: the code ran past its time limit and was stopped"
        if self.exit_code == 0:
            return None
        last = self.stderr.strip().splitlines()[-1:] or [f"exit code {self.exit_code}"]
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by signal {signal.Signals(-self.exit_code).name} ({last[0]})"
        return last[0]

    def observation(self) -> str:
        """What a tool returns to the model: the output, or the error."""
        text = self.stdout if self.error is None else f"{self.stdout}{self.error}"
        return text + ("\n[output truncated]" if self.truncated else "")


# Runs in the child before the model's code: limits, network namespace, user, audit hook.
_PRELUDE = r"""
import ctypes, json, os, resource, sys
limits, code_path, MARK, PRELOAD, NOBODY = json.loads(sys.argv[1]), *sys.argv[2:4], sys.argv[4].split(","), int(sys.argv[5])
for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_mb"] << 20),
                    ("RLIMIT_FSIZE", limits["file_mb"] << 20), ("RLIMIT_NOFILE", limits["open_files"]),
                    ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", limits["processes"])):
    resource.setrlimit(getattr(resource, name), (value, value))
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode()):
        raise OSError(ctypes.get_errno(), "mount " + dst)
def bind(src, root, writable=False):
    dst = root + src
    os.makedirs(dst, exist_ok=True) if os.path.isdir(src) else (os.makedirs(os.path.dirname(dst), exist_ok=True), open(dst, "a").close())
    mount(src, dst, None, MS_BIND | MS_REC)
    if not writable:
        mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
def own_root(root, work):
    # a root of its own: the interpreter and the system libraries read-only, the run's directory
    # at /sandbox, a private /tmp, /dev's null, zero and urandom; no /proc, /home, /dev/shm or host /tmp
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=755")
    os.makedirs(root + "/tmp"); mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
    bound = []
    for path in ("/usr", "/lib", "/lib64", "/bin", sys.base_prefix, sys.prefix, sys.exec_prefix):
        real = os.path.realpath(path)
        if os.path.isdir(real) and not any(real == b or real.startswith(b + "/") for b in bound):
            bind(real, root); bound.append(real)
        if os.path.isdir(real) and real != path and not os.path.lexists(root + path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True); os.symlink(real, root + path)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
        bind(dev, root, writable=True)
    os.makedirs(root + "/sandbox"); mount(work, root + "/sandbox", None, MS_BIND)
    mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    os.chroot(root); os.chdir("/sandbox")
work, root = os.getcwd(), os.path.join(os.path.dirname(os.getcwd()), "root")
own_fs = libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET) == 0
isolated = own_fs or libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
if own_fs:
    try:
        own_root(root, work)
        code_path = os.path.join("/sandbox", os.path.basename(code_path))
    except OSError:
        own_fs = False
        os.chdir(work)
for name in PRELOAD:  # importable after the user change even where the stdlib is not readable by nobody
    __import__(name)
if os.getuid() == 0:
    os.setgroups([]); os.setgid(NOBODY); os.setuid(NOBODY)
import posix  # in a user namespace the code keeps CAP_SYS_CHROOT there: no chroot to climb out with
del posix.chroot, os.chroot
home = os.path.realpath(os.getcwd())
sys.stderr.write(MARK + json.dumps({"isolated_network": isolated, "own_filesystem": own_fs}) + "\n"); sys.stderr.flush()
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else home)
    except (TypeError, ValueError):
        return False
    return p == home or p.startswith(home + os.sep)
def hook(event, args):
    if event.startswith(("socket.", "ctypes.")) or event in (
            "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit",
            "resource.prlimit", "sys.addaudithook"):
        raise PermissionError(f"{event} is not allowed in the sandbox")
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1] or "", args[2] or 0
        writing = any(c in str(mode) for c in "wax+") or bool(flags & WRITE_FLAGS)
        if writing and not inside(path):
            raise PermissionError(f"writing {path!r} outside the sandbox directory is not allowed")
    elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                   "os.utime", "os.symlink", "os.link", "os.rename", "shutil.rmtree"):
        paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
        if not all(inside(p) for p in paths):
            raise PermissionError(f"{event} outside the sandbox directory is not allowed")
source = open(code_path).read()
del libc, ctypes
sys.addaudithook(hook)
sys.argv = ["main.py"]
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


async def run_python(code: str, limits: SandboxLimits | None = None) -> RunResult:
    """Run `code` in a sandbox (see the module docstring); never raises for what the code does."""
    limits = limits or SandboxLimits()
    base = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    workdir = os.path.join(base, "work")  # the run's directory; base/root: its own root's mount point
    os.mkdir(workdir)
    os.mkdir(os.path.join(base, "root"))
    t0 = time.monotonic()
    try:
        if os.getuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        code_path = os.path.join(workdir, "main.py")
        with open(code_path, "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _PRELUDE, json.dumps(asdict(limits)), code_path, _MARK, ",".join(PRELOAD), str(NOBODY),
            cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        return await _collect(proc, limits, t0)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def _collect(proc: asyncio.subprocess.Process, limits: SandboxLimits, t0: float) -> RunResult:
    """Wait for the run within the wall limit, reading capped output; kill its session after."""
    reads = [asyncio.create_task(_read_capped(s, limits.output_bytes)) for s in (proc.stdout, proc.stderr)]
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), limits.wall_s)
    except TimeoutError:
        timed_out = True
    finally:
        _kill_session(proc.pid)
        await proc.wait()
    (out, cut_out), (err, cut_err) = [await r for r in reads]
    said: dict = {}
    if err.startswith(_MARK):  # the prelude's first line, written before the code ran
        line, _, err = err[len(_MARK):].partition("\n")
        said = json.loads(line)
    _say_once(bool(said.get("own_filesystem")))
    return RunResult(out, err, None if timed_out else proc.returncode, time.monotonic() - t0,
                     timed_out, cut_out or cut_err, bool(said.get("isolated_network")),
                     bool(said.get("own_filesystem")))


_said: set[bool] = set()


def _say_once(own_filesystem: bool) -> None:
    """Where the kernel refused a mount namespace, warn once what the code can still read."""
    if not own_filesystem and not _said:
        log.warning("the sandbox could not give model code a filesystem of its own (no mount namespace: "
                    "run as root or allow user namespaces); it can read every world-readable file "
                    "(datasets, reward files, /tmp, /proc), though it still cannot write outside its directory")
    _said.add(own_filesystem)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[str, bool]:
    """Up to `cap` bytes of `stream` as text, then drain (and drop) the rest; (text, truncated)."""
    data = b""
    while len(data) < cap:
        chunk = await stream.read(cap - len(data))
        if not chunk:
            return data.decode(errors="replace"), False
        data += chunk
    dropped = False
    while await stream.read(1 << 16):
        dropped = True
    return data.decode(errors="replace"), dropped


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the run and anything it started, by its session's group
    except (ProcessLookupError, PermissionError):
        pass
