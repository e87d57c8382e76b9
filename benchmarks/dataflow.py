"""The programming model's costs, measured against their peers in the same run.

    python -m benchmarks.dataflow [--large-mib 1024] [--reps 50]

- controller bytes: one DP_PROTO chain, a producer group of 2 ranks makes a batch (1 MiB, then
  1 GiB) and a consumer group of 4 ranks reduces it; the driver counts every byte it sends or
  serves: RPC to and from workers, its store's RPC, and what its store serves of the data it
  `put` (RPC replies, bulk TCP, shared memory). A controller-centric design (gather to the
  driver, scatter to consumers) would move the batch twice: `naive_controller_bytes_large`.
- overlap: two groups on disjoint single-rank pools each run the same fixed compute (float32
  matmuls, one torch thread per worker); issued back to back vs. one after the other (both
  measured here). On a machine with fewer than 2 free cores the ceiling is below 2.
- call overhead: p50 of a no-op ONE_TO_ALL call on a 4-rank group of worker processes vs. p50 of
  one raw RPC round trip to one of those workers (`call_overhead_ratio`: the workers' own work
  included, a thread hop each for a plain method, 4 processes on this machine's cores).
- group calls at 4, 16 and 64 ranks, the controller's side (`call_ratio_N`): the driver's real
  `WorkerGroup` and `WorkerHandle`s over RPC clients to N lightweight ranks, the N endpoints of
  one ROUTER socket in a separate process that decodes each request and answers it as a worker
  answers a no-op (`[None, None, []]`); against one raw round trip to the same server. The
  driver's CPU per call (`call_cpu_us_N`, ZeroMQ's I/O thread included) is its side alone; on a
  2-core machine the stand-in ranks' own work (one process for all N) also bounds the wall time.
  The floor of that shape, same server, same run: bare pyzmq, one DEALER socket and reader
  callback per rank, nothing but a send and a decoded reply each (`raw_fan_out_ratio_N` against
  the round trip, `call_vs_raw_fan_out_N` = the group call / that floor).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import zmq

from asyncrl import DP_PROTO, ONE_TO_ALL, Batch, Worker, register
from asyncrl.single_controller.context import local_cluster
from transport import codec
from transport.loop import run
from transport.rpc import PING, PONG, REPLY, encode_request

MIB = 1 << 20
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class Producer(Worker):
    @register(DP_PROTO)
    def make(self, spec: Batch, cols: int) -> Batch:
        """This rank's rows of a float32 batch with `cols` columns (values = row index)."""
        idx = spec["idx"]
        x = torch.empty(len(idx), cols, dtype=torch.float32)
        x.copy_(idx.float().unsqueeze(1).expand(-1, cols))
        return Batch({"idx": idx.clone(), "x": x})


class Consumer(Worker):
    @register(DP_PROTO)
    def reduce(self, batch: Batch) -> Batch:
        return Batch({"idx": batch["idx"], "mean": batch["x"].mean(dim=1)})

    @register(ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(ONE_TO_ALL)
    def matmuls(self, count: int, size: int) -> float:
        """`count` float32 `size`×`size` matmuls on one thread; returns a checksum."""
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=g) / size**0.5
        x = torch.randn(size, size, generator=g)
        for _ in range(count):
            x = a @ x
        return float(x.norm())


async def chain_bytes(ctx, producers, consumers, nbytes: int, rows: int = 1024) -> tuple[int, float]:
    """Controller bytes and seconds for producer.make -> consumer.reduce over `nbytes`."""
    cols = nbytes // (rows * 4)
    before = ctx.controller_bytes()
    t0 = time.perf_counter()
    spec = ctx.put(Batch({"idx": torch.arange(rows)}))
    made = producers.make(spec, cols)
    reduced = await consumers.reduce(made)
    elapsed = time.perf_counter() - t0
    moved = ctx.controller_bytes() - before
    check = await reduced.fetch()  # outside the measured window: 8 KiB of row means
    assert torch.allclose(check["mean"], torch.arange(rows, dtype=torch.float32)), "wrong rows"
    del made, reduced
    return moved, elapsed


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as logs:
        async with local_cluster(cpu_devices=8, log_dir=logs, allowed_packages=("benchmarks",)) as ctx:
            producers = await ctx.spawn_group(ctx.create_pool("producers", world_size=2), Producer)
            consumers = await ctx.spawn_group(ctx.create_pool("consumers", world_size=4), Consumer)
            await chain_bytes(ctx, producers, consumers, MIB)  # warm up connections
            small, t_small = await chain_bytes(ctx, producers, consumers, MIB)
            large, t_large = await chain_bytes(ctx, producers, consumers, args.large_mib * MIB)

            noop, ping = [], []
            handle = consumers.handles[0]
            for _ in range(args.reps):
                t0 = time.perf_counter()
                await consumers.noop()
                noop.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await handle.call("ping")
                ping.append(time.perf_counter() - t0)

            pair = await ctx.spawn(ctx.create_pool("left", world_size=1), left=Consumer)
            pair.update(await ctx.spawn(ctx.create_pool("right", world_size=1), right=Consumer))
            work = (args.matmuls, args.matmul_size)
            await pair.left.matmuls(2, args.matmul_size)  # warm up both workers
            await pair.right.matmuls(2, args.matmul_size)
            t0 = time.perf_counter()
            want = await pair.left.matmuls(*work)
            assert await pair.right.matmuls(*work) == want
            serial = time.perf_counter() - t0
            t0 = time.perf_counter()
            a, b = pair.left.matmuls(*work), pair.right.matmuls(*work)
            assert await a == want and await b == want
            overlapped = time.perf_counter() - t0

    noop_us = statistics.median(noop) * 1e6
    ping_us = statistics.median(ping) * 1e6
    return {
        "controller_bytes_small": small,
        "controller_bytes_large": large,
        "controller_growth": round(large / small, 3),
        "batch_bytes_small": MIB,
        "batch_bytes_large": args.large_mib * MIB,
        "naive_controller_bytes_large": 2 * args.large_mib * MIB,
        "chain_s_small": round(t_small, 3),
        "chain_s_large": round(t_large, 3),
        "overlap_serial_s": round(serial, 3),
        "overlap_measured_s": round(overlapped, 3),
        "overlap_speedup": round(serial / overlapped, 3),
        "call_overhead_us": round(noop_us, 1),
        "rpc_round_trip_us": round(ping_us, 1),
        "call_overhead_ratio": round(noop_us / ping_us, 2),
    }


# lightweight ranks ---------------------------------------------------------------------------
def serve_ranks(n: int, sockdir: str) -> None:
    """N rank endpoints on one ROUTER socket: each request decoded and answered as a worker
    answers a no-op call (`call_instance` -> [output, layouts, warnings]) or a ping."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger, sock.rcvhwm, sock.sndhwm = 0, 0, 0
    endpoints = [f"ipc://{sockdir}/rank{r}.sock" for r in range(n)]
    for endpoint in endpoints:
        sock.bind(endpoint)
    print(json.dumps(endpoints), flush=True)
    while True:
        identity, *body = sock.recv_multipart(copy=False)
        msg = codec.decode([f.buffer for f in body])
        if msg[0] == PING:
            reply = [PONG, msg[1]]
        else:
            reply = [REPLY, msg[1], [None, None, []] if msg[2] == "call_instance" else "pong"]
        sock.send_multipart([identity, *codec.encode(reply)], copy=False)


async def median_us(call: Callable[[], Awaitable[Any]], reps: int, warmup: int = 20) -> float:
    """The median wall time of `await call()` in µs over `reps` calls after `warmup` others."""
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        await call()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class RawFanOut:
    """The floor of a group call over one socket per rank: bare pyzmq DEALER sockets, one reader
    callback each, the request encoded once, each reply decoded, no futures, ids or errors."""

    def __init__(self, endpoints: list[str]) -> None:
        self.loop = asyncio.get_running_loop()
        self.socks = [zmq.Context.instance().socket(zmq.DEALER) for _ in endpoints]
        for sock, endpoint in zip(self.socks, endpoints, strict=True):
            sock.linger = 0
            sock.connect(endpoint)
            self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain, sock)
        self.left, self.done = 0, None

    def _drain(self, sock) -> None:
        while sock.getsockopt(_EVENTS) & _POLLIN:
            codec.decode([f.buffer for f in sock.recv_multipart(_NOBLOCK, copy=False)])
            self.left -= 1
            if not self.left:
                self.done.set_result(None)

    async def call(self) -> None:
        self.left, self.done = len(self.socks), self.loop.create_future()
        _, (frame,) = encode_request("call_instance", ["light", "noop", [], {}])
        for sock in self.socks:
            sock.send(frame, _NOBLOCK)
            if sock.getsockopt(_EVENTS) & _POLLIN:  # the descriptor is edge-triggered
                self.loop.call_soon(self._drain, sock)
        await self.done

    async def median_us(self, reps: int) -> float:
        try:
            return await median_us(self.call, reps)
        finally:
            for sock in self.socks:
                self.loop.remove_reader(sock.getsockopt(zmq.FD))
                sock.close()


class _Directory:
    """What a WorkerHandle asks of its coordinator after a successful call: note the refs."""

    def __init__(self) -> None:
        from daemons.coordinator import Coordinator

        self.objects: dict = {}
        self.note_refs = Coordinator.note_refs.__get__(self)


async def light_group_calls(n: int, reps: int) -> dict[str, float]:
    import subprocess
    import sys

    from asyncrl.single_controller.group import ProcessSet, WorkerGroup
    from daemons.coordinator import ResourcePool, WorkerInfo
    from daemons.messages import WorkerState
    from daemons.proc import kill_group
    from daemons.worker_client import WorkerHandle
    from transport import RpcClient

    with tempfile.TemporaryDirectory(prefix="asyncrl-ranks-") as sockdir:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.dataflow", "--serve-ranks", str(n),
                                 "--sockdir", sockdir], stdout=subprocess.PIPE, text=True, start_new_session=True)
        clients: list = []
        try:
            endpoints = json.loads(proc.stdout.readline())
            clients = [RpcClient(e, insecure=True, name=f"rank{r}") for r, e in enumerate(endpoints)]
            for c in clients:
                await c.connect()
            directory = _Directory()
            handles = [WorkerHandle(directory, WorkerInfo(f"light-{r}", "bench", r, "light", "cpu",
                                                          WorkerState.READY), c) for r, c in enumerate(clients)]
            group = WorkerGroup("light", Consumer, ProcessSet(ResourcePool("light", [("bench", "cpu")] * n), handles))
            noop, ping, noop_cpu, ping_cpu = [], [], 0.0, 0.0
            for i in range(reps + 20):
                t0, c0 = time.perf_counter(), time.process_time()
                await group.noop()
                t1, c1 = time.perf_counter(), time.process_time()
                await clients[i % n].call("ping")
                t2, c2 = time.perf_counter(), time.process_time()
                if i >= 20:  # warm-up
                    noop.append(t1 - t0)
                    ping.append(t2 - t1)
                    noop_cpu, ping_cpu = noop_cpu + c1 - c0, ping_cpu + c2 - c1
            raw = await RawFanOut(endpoints).median_us(reps)
        finally:
            for c in clients:
                await c.close()
            kill_group(proc, grace_s=2)
    noop_us, ping_us = statistics.median(noop) * 1e6, statistics.median(ping) * 1e6
    return {f"call_us_{n}": round(noop_us, 1), f"round_trip_us_{n}": round(ping_us, 1),
            f"call_ratio_{n}": round(noop_us / ping_us, 2),
            # the floor of a fan-out over one socket per rank in Python, to the same server
            f"raw_fan_out_us_{n}": round(raw, 1), f"raw_fan_out_ratio_{n}": round(raw / ping_us, 2),
            f"call_vs_raw_fan_out_{n}": round(noop_us / raw, 2),
            # the driver process's CPU (its ZeroMQ I/O thread included) per group call and per rank
            f"call_cpu_us_{n}": round(noop_cpu / reps * 1e6, 1), f"call_cpu_us_per_rank_{n}": round(noop_cpu / reps / n * 1e6, 1),
            f"round_trip_cpu_us_{n}": round(ping_cpu / reps * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--matmuls", type=int, default=300, help="matmuls per overlap task")
    ap.add_argument("--matmul-size", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="*", default=[4, 16, 64], help="lightweight group sizes")
    ap.add_argument("--only-group-calls", action="store_true", help="skip the worker-process measurements")
    ap.add_argument("--serve-ranks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sockdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_ranks:
        serve_ranks(args.serve_ranks, args.sockdir)
        return
    result = {} if args.only_group_calls else run(main_async(args))
    for n in args.ranks:
        result.update(run(light_group_calls(n, args.reps)))
    for k, v in result.items():
        print(f"{k:>30}: {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
