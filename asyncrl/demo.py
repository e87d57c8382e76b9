"""A small end-to-end demo of the RPC layer (the `make run` job until the RL quickstart lands).

Starts two worker processes on CurveZMQ-authenticated ipc sockets, splits a batch between
them, has each compute a least-squares fit on its half, and checks the merged answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from daemons.proc import kill_group
from transport import CurveConfig, RpcClient, RpcServer
from transport.loop import run


async def _worker(endpoint: str) -> None:
    server = RpcServer(endpoint, curve=CurveConfig.from_env(), name=f"worker-{os.getpid()}")

    def normal_equations(x: torch.Tensor, y: torch.Tensor) -> dict:
        return {"xtx": x.T @ x, "xty": x.T @ y, "rows": x.shape[0]}

    server.register("normal_equations", normal_equations, blocking=True)
    server.register("pid", os.getpid)
    await server.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()


async def _driver(endpoints: list[str], curve: CurveConfig) -> dict:
    torch.manual_seed(0)
    true_w = torch.randn(64, 1)
    x = torch.randn(200_000, 64)
    y = x @ true_w + 0.01 * torch.randn(200_000, 1)
    clients = [RpcClient(ep, curve=curve, name="driver") for ep in endpoints]
    t0 = time.perf_counter()
    shards = zip(x.chunk(len(clients)), y.chunk(len(clients)), strict=True)
    parts = await asyncio.gather(*[c.call("normal_equations", xs, ys, timeout=60)
                                   for c, (xs, ys) in zip(clients, shards, strict=True)])
    xtx = sum(p["xtx"] for p in parts)
    xty = sum(p["xty"] for p in parts)
    w = torch.linalg.solve(xtx, xty)
    elapsed = time.perf_counter() - t0
    pids = await asyncio.gather(*[c.call("pid") for c in clients])
    sent, received = map(sum, zip(*(c.bytes_transferred for c in clients), strict=True))
    for c in clients:
        await c.close()
    return {"workers": len(clients), "worker_pids": pids, "rows": sum(p["rows"] for p in parts),
            "max_abs_error": float((w - true_w).abs().max()), "wall_s": round(elapsed, 3),
            "bytes_sent": sent, "bytes_received": received}


def main() -> int:
    curve = CurveConfig.ephemeral()
    env = {**os.environ, **curve.to_env()}
    tmp = tempfile.mkdtemp(prefix="asyncrl-demo-")
    endpoints = [f"ipc://{tmp}/worker{i}.sock" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "asyncrl.demo", "--worker", ep], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
             for ep in endpoints]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a demo worker failed to start; see its output above")
        result = run(_driver(endpoints, curve))
    finally:
        for proc in procs:
            kill_group(proc, grace_s=10)
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    print(f"2 workers fitted {result['rows']} rows; max |w - w_true| = {result['max_abs_error']:.2e}")
    print(json.dumps(result))
    return 0 if result["max_abs_error"] < 1e-2 else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        run(_worker(sys.argv[2]))
    else:
        sys.exit(main())
