"""benchmarks.fan_out: its relay and its broadcast reach every rank and bring back each reply."""

from __future__ import annotations

import json
import tempfile

import zmq

from benchmarks.fan_out import Broadcast, _start
from daemons.proc import kill_group
from transport import codec
from transport.rpc import REPLY, encode_request


def test_a_relay_answers_with_all_its_ranks_replies() -> None:
    procs = []
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger, sock.rcvtimeo = 0, 20_000
    with tempfile.TemporaryDirectory(prefix="asyncrl-fanout-") as tmp:
        try:
            proc, line = _start(["--serve-ranks", "3", "--sockdir", tmp])
            procs.append(proc)
            relay = f"ipc://{tmp}/relay.sock"
            procs.append(_start(["--serve-relay", relay, "--relay-ranks", line.strip()])[0])
            sock.connect(relay)
            for _ in range(2):  # one call after another, as the benchmark makes them
                req_id, frames = encode_request("call_instance", ["light", "noop", [], {}])
                sock.send_multipart(frames)
                assert codec.decode(sock.recv_multipart()) == [REPLY, req_id, [[None, None, []]] * 3]
        finally:
            sock.close()
            for proc in procs:
                kill_group(proc, grace_s=1)
    assert json.loads(line) and all(p.poll() is not None for p in procs)


def test_a_broadcast_reaches_every_subscribed_rank_once() -> None:
    procs = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-fanout-") as tmp:
        cast = Broadcast(tmp, 4)
        try:
            for first in (0, 2):  # two nodes of two ranks
                procs.append(_start(["--serve-subscribers", "2", "--pub", cast.pub_endpoint, "--gather",
                                     cast.gather_endpoint, "--first-rank", str(first)])[0])
            cast.wait_subscribed()  # every subscription in force: no sleep
            req_id, (frame,) = encode_request("call_instance", ["light", "noop", [], {}])
            cast.pub.send(frame)
            got = {}
            while len(got) < 4 and cast.gather.poll(20_000):
                rank, body = cast.gather.recv_multipart()
                got[rank] = codec.decode([body])
        finally:
            cast.close()
            for proc in procs:
                kill_group(proc, grace_s=1)
    assert got == {b"rank%d" % r: [REPLY, req_id, [None, None, []]] for r in range(4)}
