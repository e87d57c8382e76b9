"""RPC round trip, pipelined throughput and bulk payload, against raw pyzmq in the same run.

    python -m benchmarks.rpc [--calls 5000] [--payload-mib 64] [--curve]

Each side's server runs in its own process on the same event-loop kind (uvloop), the client
here. The raw-pyzmq peer is an asyncio DEALER/ROUTER echo with zero-copy frames: the limit of
this stack. `*_gbps` figures are GB/s (1e9 bytes/s) of payload moved, both directions counted.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import zmq
import zmq.asyncio

from daemons.proc import kill_group
from transport import CurveConfig, RpcClient, RpcServer
from transport.auth import secure_client_socket, secure_server_socket
from transport.loop import run


# servers (run in a child process) ---------------------------------------------------------
async def _serve_asyncrl(endpoint: str, curve: CurveConfig | None) -> None:
    server = RpcServer(endpoint, curve=curve, insecure=curve is None, name="bench")
    server.register("ping", lambda: None)
    server.register("echo", lambda x: x)
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _serve_zmq(endpoint: str, curve: CurveConfig | None) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    if curve is not None:
        secure_server_socket(sock, curve, domain="bench-zmq")
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        frames = await sock.recv_multipart(copy=False)
        await sock.send_multipart(frames, copy=False)


def _start_server(kind: str, endpoint: str, curve: bool) -> subprocess.Popen:
    env = dict(os.environ)
    if curve:
        env.update(_BENCH_KEYS.to_env())
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.rpc", "--serve", kind, "--endpoint", endpoint]
        + (["--curve"] if curve else []),
        stdout=subprocess.PIPE, env=env, start_new_session=True, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{kind} server failed to start")
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    kill_group(proc, grace_s=5)


_BENCH_KEYS = CurveConfig.from_env() or CurveConfig.ephemeral()


# clients ------------------------------------------------------------------------------------
class _AsyncrlSide:
    def __init__(self, endpoint: str, curve: bool) -> None:
        self.client = RpcClient(endpoint, curve=_BENCH_KEYS if curve else None, insecure=not curve)

    async def open(self) -> None:
        await self.client.connect()

    async def ping(self) -> None:
        await self.client.call("ping")

    async def pipelined(self, window: int) -> None:
        await asyncio.gather(*[self.client.call("ping") for _ in range(window)])

    async def echo(self, payload: torch.Tensor) -> None:
        out = await self.client.call("echo", payload)
        assert out.shape == payload.shape and out[-1].item() == payload[-1].item()

    async def close(self) -> None:
        await self.client.close()


class _ZmqSide:
    def __init__(self, endpoint: str, curve: bool) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        if curve:
            secure_client_socket(self.sock, _BENCH_KEYS)
        self.sock.connect(endpoint)

    async def open(self) -> None:
        await self.ping()

    async def ping(self) -> None:
        await self.sock.send(b"ping")
        await self.sock.recv()

    async def pipelined(self, window: int) -> None:
        for _ in range(window):
            await self.sock.send(b"ping")
        for _ in range(window):
            await self.sock.recv()

    async def echo(self, payload: torch.Tensor) -> None:
        await self.sock.send(payload.numpy(), copy=False)
        frame = await self.sock.recv(copy=False)
        assert len(frame) == payload.nbytes

    async def close(self) -> None:
        self.sock.close(0)


async def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    await fn(*args)
    return time.perf_counter() - t0


async def _measure(endpoints: dict[str, str], curve: bool, calls: int, payload: torch.Tensor,
                   echoes: int, warmup_s: float) -> dict:
    """Alternate between the two stacks so both see the same machine noise."""
    sides = {"zmq": _ZmqSide(endpoints["zmq"], curve), "asyncrl": _AsyncrlSide(endpoints["asyncrl"], curve)}
    for side in sides.values():
        await side.open()
    # Warm up for a while: the first seconds of a process's calls run measurably slower
    # (interpreter specialisation, scheduler placement), for both stacks alike.
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        for side in sides.values():
            for _ in range(50):
                await side.ping()
    rtts: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(calls // 50):
        for name, side in sides.items():
            for _ in range(50):
                rtts[name].append(await _timed(side.ping))
    window, rounds = 256, max(1, calls * 4 // 256)
    pipelined: dict[str, float] = dict.fromkeys(sides, 0.0)
    for _ in range(rounds):
        for name, side in sides.items():
            pipelined[name] += await _timed(side.pipelined, window)
    echo: dict[str, list[float]] = {k: [] for k in sides}
    for side in sides.values():
        await side.echo(payload)  # warm up: first-touch page faults of the receive buffers
    for _ in range(echoes):
        for name, side in sides.items():
            echo[name].append(await _timed(side.echo, payload))
    for side in sides.values():
        await side.close()
    return {name: {"rtt_p50": statistics.median(rtts[name]),
                   "calls_per_s": rounds * window / pipelined[name],
                   "payload_s": statistics.median(echo[name])} for name in sides}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--payload-mib", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--echoes", type=int, default=9, help="payload echoes per stack")
    ap.add_argument("--curve", action="store_true", help="CurveZMQ-encrypt both sides")
    ap.add_argument("--serve", choices=["asyncrl", "zmq"], help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = ap.parse_args()
    curve = _BENCH_KEYS if args.curve else None
    if args.serve == "asyncrl":
        run(_serve_asyncrl(args.endpoint, curve))
        return
    if args.serve == "zmq":
        run(_serve_zmq(args.endpoint, curve))
        return

    payload = torch.arange(args.payload_mib * (1 << 20) // 4, dtype=torch.float32)
    per_transport = {}
    for transport in ("tcp", "ipc"):
        if transport == "ipc":
            endpoints = {k: f"ipc://{tempfile.gettempdir()}/asyncrl-bench-{os.getpid()}-{k}.sock"
                         for k in ("zmq", "asyncrl")}
        else:
            endpoints = {k: f"tcp://127.0.0.1:{_free_port()}" for k in ("zmq", "asyncrl")}
        procs = []
        try:
            for kind, endpoint in endpoints.items():
                procs.append(_start_server(kind, endpoint, args.curve))
            per_transport[transport] = run(_measure(endpoints, args.curve, args.calls, payload, args.echoes, args.warmup_s))
        finally:
            for proc in procs:
                _stop(proc)
            for endpoint in endpoints.values():
                if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
                    os.unlink(endpoint[6:])
    moved = 2 * payload.nbytes / 1e9
    ours, peer = per_transport["ipc"]["asyncrl"], per_transport["ipc"]["zmq"]
    tcp_ours, tcp_peer = per_transport["tcp"]["asyncrl"], per_transport["tcp"]["zmq"]
    out = {
        "transport": "ipc (tcp-loopback in tcp_* fields)",
        "curve": args.curve,
        "loop": "uvloop",
        "asyncrl_rtt_us_p50": round(ours["rtt_p50"] * 1e6, 1),
        "zmq_rtt_us_p50": round(peer["rtt_p50"] * 1e6, 1),
        "ratio": round(ours["rtt_p50"] / peer["rtt_p50"], 3),
        "calls_per_s": round(ours["calls_per_s"]),
        "zmq_msgs_per_s": round(peer["calls_per_s"]),
        "payload_mib": args.payload_mib,
        "payload_gbps": round(moved / ours["payload_s"], 3),
        "zmq_payload_gbps": round(moved / peer["payload_s"], 3),
        "payload_ratio": round(peer["payload_s"] / ours["payload_s"], 3),
        "tcp_asyncrl_rtt_us_p50": round(tcp_ours["rtt_p50"] * 1e6, 1),
        "tcp_zmq_rtt_us_p50": round(tcp_peer["rtt_p50"] * 1e6, 1),
        "tcp_ratio": round(tcp_ours["rtt_p50"] / tcp_peer["rtt_p50"], 3),
        "tcp_calls_per_s": round(tcp_ours["calls_per_s"]),
        "tcp_payload_gbps": round(moved / tcp_ours["payload_s"], 3),
        "tcp_zmq_payload_gbps": round(moved / tcp_peer["payload_s"], 3),
        "tcp_payload_ratio": round(tcp_peer["payload_s"] / tcp_ours["payload_s"], 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
