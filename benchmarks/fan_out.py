"""How fast can one Python controller reach N ranks? The floors of three designs, same run.

    python -m benchmarks.fan_out [--ranks 64] [--per-node 8 16] [--reps 300]

`benchmarks.dataflow` compares the group call with its own design's floor (`raw_fan_out_ratio_N`:
one socket per rank from the driver). This measures, in bare pyzmq and before anything is built,
whether a call relayed through each node, or broadcast, would do better:

- `flat_ratio`: the driver sends a no-op request to each of the N ranks (one DEALER socket and
  reader callback each, the request encoded once) and decodes every reply;
- `relayed_ratio_K`: the driver sends it to one relay per node of K ranks (N/K relays); a relay
  decodes it, forwards it to its K ranks, decodes their replies and answers with one message
  holding all K. Two hops instead of one, N/K driver messages instead of N;
- `broadcast_ratio_K`: the driver publishes the request once (a PUB socket: ZeroMQ's I/O thread
  copies it to every rank's SUB socket) and gathers the N replies on one ROUTER socket, drained
  in one callback. One driver send instead of N, one descriptor instead of N.

The ranks are stand-ins that answer as a worker answers a no-op (`benchmarks.dataflow.serve_ranks`;
`serve_subscribers` for the broadcast), one process per node of K ranks; each relay is a process
of its own, as a node daemon would be. Ratios are against one round trip to one rank over the same
kind of socket (`round_trip_us`). Where the machine has fewer cores than processes, the relays and
stand-ins share the driver's cores and a relay cannot win. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import zmq

from benchmarks.dataflow import RawFanOut, median_us
from daemons.proc import kill_group
from transport import codec
from transport.rpc import REPLY, encode_request

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def serve_relay(endpoint: str, ranks: list[str]) -> None:
    """A node's relay: each request from the driver goes to every rank, and one reply holding all
    of theirs goes back (one call in flight at a time, as the measurement makes them)."""
    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.linger = back.linger = 0
    front.bind(endpoint)
    ids = [b"rank%d" % r for r in range(len(ranks))]
    for rid, rank in zip(ids, ranks, strict=True):
        back.connect_rid = rid  # address each rank by name on one socket
        back.connect(rank)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    print("ready", flush=True)
    caller, req_id, replies = b"", 0, []
    while True:
        for sock, _ in poller.poll():
            while sock.getsockopt(_EVENTS) & _POLLIN:
                peer, frame = sock.recv_multipart(_NOBLOCK)
                if sock is front:
                    caller, req_id, replies = peer, codec.decode([frame])[1], []
                    for rid in ids:
                        back.send_multipart([rid, frame])
                    continue
                replies.append(codec.decode([frame])[2])
                if len(replies) == len(ids):
                    front.send_multipart([caller, *codec.encode([REPLY, req_id, replies], split=False)])


def serve_subscribers(k: int, pub: str, gather: str, first: int) -> None:
    """A node's K ranks for the broadcast: each a SUB socket on the driver's PUB and a DEALER socket
    to its gather ROUTER (named by rank), answering each request as a worker answers a no-op."""
    ctx = zmq.Context.instance()
    poller, replies = zmq.Poller(), {}
    for r in range(first, first + k):
        sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        sub.linger = dealer.linger = 0
        sub.connect(pub)
        sub.subscribe(b"")
        dealer.routing_id = b"rank%d" % r
        dealer.connect(gather)
        dealer.send(b"subscribed")  # the driver publishes once every rank said so
        poller.register(sub, zmq.POLLIN)
        replies[sub] = dealer
    print("ready", flush=True)
    while True:
        for sub, _ in poller.poll():
            while sub.getsockopt(_EVENTS) & _POLLIN:
                req_id = codec.decode([sub.recv(_NOBLOCK)])[1]
                replies[sub].send_multipart(codec.encode([REPLY, req_id, [None, None, []]], split=False))


class Broadcast:
    """The driver's side of the broadcast: one PUB socket out, one ROUTER socket in."""

    def __init__(self, tmp: str, n: int) -> None:
        ctx = zmq.Context.instance()
        # XPUB: each rank's subscription arrives as a message once it is in force (verbose: all n
        # of them, not only the first of a topic), so the wait below needs no sleep
        self.pub, self.gather = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.linger = self.gather.linger = 0
        self.pub.sndhwm = 0
        self.pub_endpoint, self.gather_endpoint = f"ipc://{tmp}/pub.sock", f"ipc://{tmp}/gather.sock"
        self.pub.bind(self.pub_endpoint)
        self.gather.bind(self.gather_endpoint)
        self.n, self.left, self.done = n, 0, None

    def wait_subscribed(self, timeout_ms: int = 30_000) -> None:
        """Until every rank's subscription is in force at the PUB socket and its DEALER is connected."""
        for sock in (self.pub, self.gather):
            for _ in range(self.n):
                if not sock.poll(timeout_ms):
                    raise TimeoutError("a stand-in rank did not subscribe")
                sock.recv_multipart()

    def _drain(self) -> None:
        while self.gather.getsockopt(_EVENTS) & _POLLIN:
            _, body = self.gather.recv_multipart(_NOBLOCK, copy=False)
            codec.decode([body.buffer])
            self.left -= 1
            if not self.left:
                self.done.set_result(None)

    async def call(self) -> None:
        self.left, self.done = self.n, asyncio.get_running_loop().create_future()
        _, (frame,) = encode_request("call_instance", ["light", "noop", [], {}])
        self.pub.send(frame)
        if self.gather.getsockopt(_EVENTS) & _POLLIN:  # edge-triggered, as in RawFanOut
            asyncio.get_running_loop().call_soon(self._drain)
        await self.done

    async def median_us(self, reps: int) -> float:
        loop = asyncio.get_running_loop()
        fd = self.gather.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        try:
            try:
                await asyncio.wait_for(self.call(), 30)
            except TimeoutError:
                raise RuntimeError("a published request was lost: a subscription had not reached the "
                                   "PUB socket yet") from None
            return await median_us(self.call, reps)
        finally:
            loop.remove_reader(fd)

    def close(self) -> None:
        self.pub.close()
        self.gather.close()


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """This module in a new process group serving what `args` say; its first line (ready)."""
    root = str(Path(__file__).resolve().parents[1])  # the checkout holding benchmarks/, from any directory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.fan_out", *args], stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    return proc, proc.stdout.readline()


async def measure(n: int, per_node: list[int], reps: int) -> dict[str, float]:
    out: dict[str, float] = {"ranks": n}
    for k in per_node:
        procs: list[subprocess.Popen] = []
        with tempfile.TemporaryDirectory(prefix="asyncrl-fanout-") as tmp:
            try:
                ranks, relays, broadcast = [], [], Broadcast(tmp, n)
                for node in range(n // k):
                    sockdir = os.path.join(tmp, f"node{node}")
                    os.mkdir(sockdir)
                    proc, line = _start(["--serve-ranks", str(k), "--sockdir", sockdir])
                    procs.append(proc)
                    mine = json.loads(line)
                    relay = f"ipc://{sockdir}/relay.sock"
                    proc, _ = _start(["--serve-relay", relay, "--relay-ranks", json.dumps(mine)])
                    procs.append(proc)
                    ranks += mine
                    relays.append(relay)
                    procs.append(_start(["--serve-subscribers", str(k), "--pub", broadcast.pub_endpoint, "--gather",
                                         broadcast.gather_endpoint, "--first-rank", str(node * k)])[0])
                broadcast.wait_subscribed()
                await asyncio.sleep(0.5)  # every connection made
                rtt = min([await RawFanOut(ranks[:1]).median_us(reps) for _ in range(2)])
                flat = min([await RawFanOut(ranks).median_us(reps) for _ in range(2)])
                relayed = min([await RawFanOut(relays).median_us(reps) for _ in range(2)])
                cast = min([await broadcast.median_us(reps) for _ in range(2)])
            finally:
                broadcast.close()
                for proc in procs:
                    kill_group(proc, grace_s=1)
        out.update({f"round_trip_us_{k}": round(rtt, 1), f"flat_us_{k}": round(flat, 1),
                    f"relayed_us_{k}": round(relayed, 1), f"flat_ratio_{k}": round(flat / rtt, 2),
                    f"relayed_ratio_{k}": round(relayed / rtt, 2), f"broadcast_us_{k}": round(cast, 1),
                    f"broadcast_ratio_{k}": round(cast / rtt, 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--per-node", type=int, nargs="*", default=[8, 16], help="ranks per node (relay)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--serve-ranks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sockdir", help=argparse.SUPPRESS)
    ap.add_argument("--serve-relay", help=argparse.SUPPRESS)
    ap.add_argument("--relay-ranks", help=argparse.SUPPRESS)
    ap.add_argument("--serve-subscribers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pub", help=argparse.SUPPRESS)
    ap.add_argument("--gather", help=argparse.SUPPRESS)
    ap.add_argument("--first-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_ranks:
        from benchmarks.dataflow import serve_ranks
        return serve_ranks(args.serve_ranks, args.sockdir)
    if args.serve_subscribers:
        return serve_subscribers(args.serve_subscribers, args.pub, args.gather, args.first_rank)
    if args.serve_relay:
        return serve_relay(args.serve_relay, json.loads(args.relay_ranks))
    if any(args.ranks % k for k in args.per_node):
        ap.error(f"--ranks {args.ranks} is not a multiple of every --per-node {args.per_node}")
    result = asyncio.run(measure(args.ranks, args.per_node, args.reps))
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
