"""A bounded keyless flood against a live CurveZMQ RPC server on localhost.

    python -m benchmarks.chaos_net [--big-conns 32] [--big-mib 16] [--held-conns 512]

The server (`RpcServer` with CurveZMQ keys, in its own process) is attacked by a client that
holds no key, in three rounds, while its resident memory is sampled every 10 ms:

  big     `--big-conns` connections each declare one 1 GiB frame during the handshake and
          stream up to `--big-mib` MiB of it (what a keyless client did to workers before the
          frame limit: ~1 GiB held per connection);
  held    `--held-conns` connections each send the largest frame the server admits minus one
          byte and hold it open (the per-peer connection cap and the handshake timeout bound
          this one);
  garbage random bytes and random ZMTP frames.

Then an authorized client must still get an answer. The limit it is measured against is the
issue's 64 MiB above the server's baseline. The last line printed is one JSON object:
`preauth_peak_mib` (peak RSS growth), `frames_sent`, `daemon_crashes` (0/1), and with a `net_`
prefix: `limit_mib`, `peak_over_limit` (the ratio), the server's `refused_connections`, its
baseline RSS, the frame limit and the seconds each round took. Measured on a 2-core VM: 512.7 MiB before the frame limit, ~40 MiB after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from daemons.proc import kill_group
from transport import CurveConfig, RpcClient, RpcServer
from transport.loop import run as run_loop

LIMIT_MIB = 64
_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00")
             + b"\x00" + b"\x00" * 31)


# the server (a child process) -----------------------------------------------------------------
async def _serve() -> None:
    server = RpcServer("tcp://127.0.0.1:0", curve=CurveConfig.from_env(), name="chaos")
    server.register("ping", lambda: "pong")
    print(await server.start(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    print(json.dumps({"refused_connections": server.refused_connections, **server.stats}), flush=True)
    await server.close()


def _start_server(keys: CurveConfig) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, **keys.to_env()}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.chaos_net", "--serve"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith("tcp://"):
        kill_group(proc, grace_s=1)
        raise RuntimeError("the chaos server did not start")
    return proc, endpoint


# measuring ----------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Samples a process's RSS every `interval` seconds in a thread; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except OSError:
                return
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


# the attacks --------------------------------------------------------------------------------
def _frame_header(size: int, command: bool = True) -> bytes:
    return bytes([0x02 | (0x04 if command else 0)]) + struct.pack(">Q", size)


def _open(addr: tuple[str, int]) -> socket.socket | None:
    try:
        s = socket.create_connection(addr, timeout=2)
    except OSError:
        return None
    s.setblocking(False)
    return s


def _push(conns: list[socket.socket], budget: dict[socket.socket, int], deadline: float) -> None:
    """Write zeros into every connection until each budget is spent, the peer closes, or time is up."""
    chunk = memoryview(bytes(1 << 16))
    by_fd = {s.fileno(): s for s in conns if budget.get(s, 0) > 0}
    poller = select.poll()  # not select(): more than 1024 descriptors
    for fd in by_fd:
        poller.register(fd, select.POLLOUT)
    while by_fd and time.monotonic() < deadline:
        for fd, _ in poller.poll(50):
            s = by_fd[fd]
            try:
                n = s.send(chunk[:min(len(chunk), budget[s])])
            except OSError:
                n, budget[s] = 0, 0
            budget[s] -= n
            if budget[s] <= 0:
                poller.unregister(fd)
                del by_fd[fd]


def big_frames(addr: tuple[str, int], conns: int, mib: int, deadline: float) -> int:
    socks = [s for s in (_open(addr) for _ in range(conns)) if s is not None]
    for s in socks:
        try:
            s.send(_GREETING + _frame_header(1 << 30))
        except OSError:
            pass
    _push(socks, {s: mib << 20 for s in socks}, deadline)
    time.sleep(0.3)  # let the server read what is in flight
    for s in socks:
        s.close()
    return len(socks)


def held_frames(addr: tuple[str, int], conns: int, frame_bytes: int, deadline: float) -> int:
    socks = []
    for _ in range(conns):
        s = _open(addr)
        if s is None:
            continue
        try:
            s.send(_GREETING + _frame_header(frame_bytes - 1))
        except OSError:
            pass
        socks.append(s)
    _push(socks, {s: frame_bytes - 2 for s in socks}, deadline)
    time.sleep(0.5)  # held: the frames never complete
    for s in socks:
        s.close()
    return len(socks)


def garbage(addr: tuple[str, int], count: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    sent = 0
    for i in range(count):
        s = _open(addr)
        if s is None:
            continue
        try:
            if i % 2:
                s.send(rng.randbytes(rng.randint(1, 512)))
            else:
                s.send(_GREETING + _frame_header(rng.randint(0, 300)) + rng.randbytes(rng.randint(0, 300)))
            sent += 1
        except OSError:
            pass
        s.close()
    return sent


async def _alive(endpoint: str, keys: CurveConfig) -> bool:
    client = RpcClient(endpoint, curve=keys, name="chaos-check")
    try:
        return await client.call("ping", timeout=10) == "pong"
    except Exception:
        return False
    finally:
        await client.close()


def _server_stats(proc: subprocess.Popen) -> dict:
    """The server's counters, printed as it shuts down when its stdin closes."""
    proc.stdin.close()
    try:
        line = proc.stdout.readline()
        proc.wait(timeout=5)
        return json.loads(line)
    except (ValueError, subprocess.TimeoutExpired):
        return {}


def run(big_conns: int = 32, big_mib: int = 16, held_conns: int = 512, garbage_conns: int = 300,
        time_budget_s: float = 20.0) -> dict:
    """The floods against a fresh server; returns the measurements (see the module docstring)."""
    from transport.codec import FRAME_BYTES

    keys = CurveConfig.ephemeral()
    proc, endpoint = _start_server(keys)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    addr = (host, int(port))
    t_start = time.monotonic()
    try:
        run_loop(_alive(endpoint, keys))  # warm: the handshake's own allocations are baseline
        time.sleep(0.2)
        baseline = rss_bytes(proc.pid)
        deadline = t_start + time_budget_s
        timings = {}
        with RssSampler(proc.pid) as sampler:
            t0 = time.monotonic()
            frames = big_frames(addr, big_conns, big_mib, min(deadline, t0 + time_budget_s / 2))
            timings["net_big_s"] = round(time.monotonic() - t0, 2)
            t0 = time.monotonic()
            frames += held_frames(addr, held_conns, FRAME_BYTES, deadline)
            timings["net_held_s"] = round(time.monotonic() - t0, 2)
            t0 = time.monotonic()
            frames += garbage(addr, garbage_conns)
            timings["net_garbage_s"] = round(time.monotonic() - t0, 2)
        alive = proc.poll() is None and run_loop(_alive(endpoint, keys))
        peak_mib = max(0, sampler.peak - baseline) / 2**20
        server_stats = _server_stats(proc) if alive else {}
        return {"preauth_peak_mib": round(peak_mib, 1), "frames_sent": frames,
                "daemon_crashes": 0 if alive else 1, "net_limit_mib": LIMIT_MIB,
                "net_peak_over_limit": round(peak_mib / LIMIT_MIB, 3),
                "net_refused_connections": server_stats.get("refused_connections"),
                "net_baseline_rss_mib": round(baseline / 2**20, 1), "net_frame_limit_bytes": FRAME_BYTES,
                "net_wall_s": round(time.monotonic() - t_start, 2), **timings}
    finally:
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        kill_group(proc, grace_s=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--big-conns", type=int, default=32)
    ap.add_argument("--big-mib", type=int, default=16)
    ap.add_argument("--held-conns", type=int, default=512)
    args = ap.parse_args()
    if args.serve:
        run_loop(_serve())
        return
    print(json.dumps(run(args.big_conns, args.big_mib, args.held_conns)))


if __name__ == "__main__":
    main()
