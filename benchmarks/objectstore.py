"""Object-store pulls against their limits, measured in the same run.

    python -m benchmarks.objectstore [--mib 256] [--reps 3]

- same node: `put` of a float32 tensor in this process until another process has pulled it by
  ref (shared memory) and read every byte (an exact checksum), vs. a plain copy followed by the
  same checksum (`memcpy`). The owner store is configured as a worker's store is
  (`ObjectStore(shm_pool_bytes=daemons.node.DEFAULT_SHM_POOL_BYTES)`, what the node daemon
  passes), so `same_node_gbps` is what users get; `same_node_pooled_gbps` is the same pull with a
  pre-faulted spare segment (`shm_pool_bytes` = the tensor's size) against a copy into
  already-touched memory, `same_node_cold_gbps` without one against a copy into fresh memory;
- cross node: the same tensor pulled over the bulk TCP path on loopback, vs. a plain Python
  socket sendall/recv_into between the same two processes (`raw_tcp`), both checksummed;
- controller traffic: a controller passes refs between a producer of a 1 GiB batch and two
  consumers that each pull their half (a DP-local shard); it counts its own RPC bytes.
- with a GPU: CUDA IPC pull vs. a device-to-device copy.

The pre-faulted pool is not the workers' default (`cluster.shm_pool_bytes`, default
`DEFAULT_SHM_POOL_BYTES = 0`): once the consumer reads every byte, a quiet 256 MiB run on the
2-core dev VM (2026-11-22) measured same_node_ratio 0.75 without the pool and 0.78 with it (0.63
vs 0.73 GB/s): not worth 256 MiB of /dev/shm per worker (twice that while it refills). Turn it
on with `cluster.shm_pool_bytes=N` (or `ClusterSpec(ClusterConfig(shm_pool_bytes=N))`).

GB/s = 1e9 bytes/s; medians over `--reps`. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

from daemons.node import DEFAULT_SHM_POOL_BYTES
from daemons.proc import kill_group
from objectstore import ObjectStore, list_segments, remove_stale_segments, shard_rows
from transport import RpcClient, RpcServer
from transport.loop import run

GB = 1e9


def checksum(t: torch.Tensor) -> int:
    """An exact, order-independent sum over every byte of `t` (as int32 words)."""
    return int(t.reshape(-1).view(torch.int32).sum(dtype=torch.int64))


# worker process ------------------------------------------------------------------------------
async def _worker(node_id: str) -> None:
    store = ObjectStore(node_id=node_id, insecure=True, name=f"bench-{os.getpid()}")
    await store.start()
    ctl = RpcServer("tcp://127.0.0.1:0", insecure=True, name="bench-ctl")

    async def pull(ref, rows=None, transport=None):
        t = await store.get(ref, rows, transport=transport)
        total = checksum(t)  # the consumer reads every byte it pulled
        return {"end": time.perf_counter(), "checksum": total}

    def raw_recv(port: int, nbytes: int) -> dict:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        mv = memoryview(buf.numpy())
        with socket.create_connection(("127.0.0.1", port)) as sock:
            pos = 0
            while pos < nbytes:
                n = sock.recv_into(mv[pos:], nbytes - pos)
                if n == 0:
                    raise ConnectionError("raw sender closed early")
                pos += n
        total = checksum(buf)
        return {"end": time.perf_counter(), "checksum": total}

    def make_batch(nbytes: int):
        rows = 1 << 16
        cols = nbytes // 2 // rows // 8
        batch = {
            "ids": torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols),
            "logp": torch.ones(rows, cols * 2, dtype=torch.float32),
        }
        return store.put(batch)

    async def consume(ref, rank: int, world: int):
        rows = shard_rows(ref.num_rows, rank, world)
        shard = await store.get(ref, rows)
        cols = shard["ids"].shape[1]
        first, last = rows.start * cols, rows.stop * cols - 1
        ok = int(shard["ids"].sum()) == (first + last) * (last - first + 1) // 2  # every id read
        return {"rows": rows.num_rows, "ok": ok and int(shard["logp"].sum()) == shard["logp"].numel()}

    async def free(ref):
        return await store.free(ref)

    async def pull_cuda(ref):
        t = await store.get(ref, transport="cuda_ipc")
        total = float(t.sum())  # reads every element on the device
        return {"end": time.perf_counter(), "checksum": total}

    ctl.register("pull", pull)
    ctl.register("raw_recv", raw_recv, blocking=True)
    ctl.register("make_batch", make_batch)
    ctl.register("consume", consume)
    ctl.register("free", free)
    ctl.register("pull_cuda", pull_cuda)
    ctl.register("stats", store.stats)
    endpoint = await ctl.start()
    print(json.dumps({"ctl": endpoint}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await ctl.close()
        await store.close()


class _Child:
    def __init__(self, node_id: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.objectstore", "--worker", node_id],
            stdout=subprocess.PIPE, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("benchmark worker failed to start")
        self.client = RpcClient(json.loads(line)["ctl"], insecure=True)

    async def call(self, method: str, *args):
        return await self.client.call(method, *args, timeout=120)

    async def stop(self) -> None:
        await self.client.close()
        kill_group(self.proc, grace_s=10)
        self.proc.stdout.close()


# measurements --------------------------------------------------------------------------------
def _memcpy_gbps(src: torch.Tensor, reps: int) -> tuple[float, float]:
    """(copy into fresh memory, copy into already-touched memory) GB/s, each followed by the
    consumer's checksum over every byte."""
    fresh, warm = [], []
    dst = torch.empty_like(src)
    expect = checksum(src)
    for _ in range(reps):
        t0 = time.perf_counter()
        out = torch.empty_like(src).copy_(src)
        ok = checksum(out) == expect
        fresh.append(time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        dst.copy_(src)
        ok = ok and checksum(dst) == expect
        warm.append(time.perf_counter() - t0)
        if not ok:
            raise AssertionError("memcpy checksum differs")
    return src.nbytes / statistics.median(fresh) / GB, src.nbytes / statistics.median(warm) / GB


async def _pull_gbps(store: ObjectStore, child: _Child, src: torch.Tensor, reps: int,
                     transport: str | None) -> float:
    times = []
    expect = checksum(src)
    for _ in range(reps):
        await store.wait_shm_pool()  # steady state: a spare segment is made between pulls
        t0 = time.perf_counter()
        ref = store.put(src)
        reply = await child.call("pull", ref, None, transport)
        times.append(reply["end"] - t0)
        if reply["checksum"] != expect:
            raise AssertionError(f"pulled tensor differs: checksum {reply['checksum']} != {expect}")
        await store.free(ref)
    return src.nbytes / statistics.median(times) / GB


async def _raw_tcp_gbps(child: _Child, src: torch.Tensor, reps: int) -> float:
    times = []
    payload = memoryview(src.reshape(-1).view(torch.uint8).numpy())
    for _ in range(reps):
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def send(listener: socket.socket = listener) -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(payload)
            listener.close()

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        t0 = time.perf_counter()
        reply = await child.call("raw_recv", port, src.nbytes)
        times.append(reply["end"] - t0)
        sender.join()
        if reply["checksum"] != checksum(src):
            raise AssertionError("raw TCP checksum differs")
    return src.nbytes / statistics.median(times) / GB


async def _controller_bytes(producer: _Child, consumers: list[_Child], nbytes: int) -> tuple[int, bool]:
    # Fresh clients, so only this scenario's traffic is counted.
    clients = [RpcClient(c.client.endpoint, insecure=True) for c in (producer, *consumers)]
    try:
        ref = await clients[0].call("make_batch", nbytes, timeout=120)
        results = await asyncio.gather(*(
            c.call("consume", ref, rank, len(consumers), timeout=120)
            for rank, c in enumerate(clients[1:])))
        await clients[0].call("free", ref, timeout=30)
        total = sum(sum(c.bytes_transferred) for c in clients)
        ok = all(r["ok"] for r in results) and sum(r["rows"] for r in results) == ref.num_rows
        return total, ok
    finally:
        for c in clients:
            await c.close()


async def _gpu_fields(store: ObjectStore, child: _Child, mib: int, reps: int) -> dict:
    if not torch.cuda.is_available():
        return {"gpu": False}
    src = torch.rand(mib << 18, device="cuda")
    d2d = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        float(src.clone().sum())  # the same full read as the IPC consumer
        torch.cuda.synchronize()
        d2d.append(time.perf_counter() - t0)
    ipc = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ref = store.put(src)
        reply = await child.call("pull_cuda", ref)
        ipc.append(reply["end"] - t0)
        await store.free(ref)
    d2d_gbps = src.nbytes / statistics.median(d2d) / GB
    ipc_gbps = src.nbytes / statistics.median(ipc) / GB
    return {"gpu": True, "cuda_ipc_gbps": round(ipc_gbps, 2), "d2d_copy_gbps": round(d2d_gbps, 2),
            "cuda_ipc_ratio": round(ipc_gbps / d2d_gbps, 3)}


async def bench(mib: int, reps: int, controller_gib: float) -> dict:
    nbytes = mib << 20
    # the owner configured as a worker's store is (see daemons.worker / daemons.node)
    store = ObjectStore(node_id="bench-node", insecure=True, name="bench-worker-config",
                        shm_pool_bytes=DEFAULT_SHM_POOL_BYTES)
    pooled_store = ObjectStore(node_id="bench-node", insecure=True, name="bench-pooled",
                               shm_pool_bytes=nbytes)
    cold_store = ObjectStore(node_id="bench-node", insecure=True, name="bench-cold")
    stores = (store, pooled_store, cold_store)
    for s in stores:
        await s.start()
    children: list[_Child] = []
    try:
        loop = asyncio.get_running_loop()
        children = list(await asyncio.gather(*(
            loop.run_in_executor(None, _Child, "bench-node") for _ in range(3))))
        consumer = children[0]
        src = torch.rand(mib << 18)  # float32: 4 bytes per element
        memcpy_fresh, memcpy_warm = _memcpy_gbps(src, reps)
        same_node = await _pull_gbps(store, consumer, src, reps, None)
        pooled = await _pull_gbps(pooled_store, consumer, src, reps, None)
        cold = await _pull_gbps(cold_store, consumer, src, reps, None)
        tcp = await _pull_gbps(store, consumer, src, reps, "tcp")
        raw_tcp = await _raw_tcp_gbps(consumer, src, reps)
        del src
        ctl_bytes, ctl_ok = await _controller_bytes(children[0], children[1:],
                                                    int(controller_gib * (1 << 30)))
        # the peer pays for fresh pages exactly when the worker configuration does
        memcpy = memcpy_warm if DEFAULT_SHM_POOL_BYTES >= nbytes else memcpy_fresh
        result = {
            "mib": mib, "reps": reps, "worker_shm_pool_bytes": DEFAULT_SHM_POOL_BYTES,
            "same_node_gbps": round(same_node, 2), "memcpy_gbps": round(memcpy, 2),
            "same_node_ratio": round(same_node / memcpy, 3),
            "same_node_cold_gbps": round(cold, 2), "memcpy_fresh_gbps": round(memcpy_fresh, 2),
            "same_node_cold_ratio": round(cold / memcpy_fresh, 3),
            "same_node_pooled_gbps": round(pooled, 2), "memcpy_warm_gbps": round(memcpy_warm, 2),
            "same_node_pooled_ratio": round(pooled / memcpy_warm, 3),
            "tcp_pull_gbps": round(tcp, 2), "raw_tcp_gbps": round(raw_tcp, 2),
            "tcp_ratio": round(tcp / raw_tcp, 3),
            "controller_bytes_1gib": ctl_bytes, "controller_shards_ok": ctl_ok,
        }
        result.update(await _gpu_fields(store, consumer, mib, reps))
        return result
    finally:
        for child in children:
            await child.stop()
        for s in stores:
            await s.close()
        remove_stale_segments()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--controller-gib", type=float, default=1.0)
    parser.add_argument("--worker", metavar="NODE_ID", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run(_worker(args.worker))
        return
    result = run(bench(args.mib, args.reps, args.controller_gib))
    result["shm_leftovers"] = len(list_segments())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
