"""transport/: codec, RPC, liveness, CurveZMQ and hostile input."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch
import zmq

from transport import (
    AuthenticationError,
    Blob,
    CodecError,
    ConnectionLost,
    CurveConfig,
    RemoteError,
    RpcClient,
    RpcServer,
    RpcTimeout,
    codec,
    expose,
    generate_keys,
    register_type,
)
from transport.peers import ServerLimits
from transport.rpc import CANCEL, PING, REQUEST, encode_request


# codec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_tensor_roundtrip_is_zero_copy(dtype):
    t = (torch.arange(4096) % 3).to(dtype).view(64, 64)
    frames = codec.encode({"t": t})
    assert len(frames) == 2, "a large tensor travels as its own frame"
    assert frames[1].nbytes == t.numel() * t.element_size()
    buf = bytearray(frames[1])
    out = codec.decode([frames[0], buf])["t"]
    assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)
    # zero-copy: the decoded tensor views the received buffer
    assert out.untyped_storage().data_ptr() == np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_codec_values():
    msg = {
        "small": torch.tensor([1.5, 2.5]),
        "noncontig": torch.arange(20000).view(100, 200).t(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.0),
        "arr": np.arange(12, dtype=np.int16).reshape(3, 4),
        "blob": Blob(b"x" * 100_000),
        "dtype": torch.bfloat16,
        "nested": [1, "two", None, {"k": (3, 4)}],
    }
    out = codec.decode(codec.encode(msg))
    assert torch.equal(out["small"], msg["small"])
    assert torch.equal(out["noncontig"], msg["noncontig"])
    assert out["empty"].shape == (0, 3)
    assert out["scalar"].item() == 3.0
    assert np.array_equal(out["arr"], msg["arr"])
    assert bytes(out["blob"]) == b"x" * 100_000
    assert out["dtype"] is torch.bfloat16
    assert out["nested"] == [1, "two", None, {"k": [3, 4]}]


def test_codec_refuses_unknown_types_instead_of_pickling():
    class Thing:
        pass

    with pytest.raises(CodecError, match="register_type"):
        codec.encode({"x": Thing()})
    with pytest.raises(CodecError, match="object arrays"):
        codec.encode(np.array([object()], dtype=object))


def test_codec_registered_type():
    class Point:
        def __init__(self, x, t):
            self.x, self.t = x, t

    register_type(Point, 120, lambda p: [p.x, p.t], lambda v: Point(*v))
    out = codec.decode(codec.encode([Point(3, torch.ones(1000))]))[0]
    assert isinstance(out, Point) and out.x == 3 and out.t.sum().item() == 1000


@pytest.mark.parametrize("frames", [
    [b"\xc1"],                                       # never-used msgpack byte
    [msgpack.packb(msgpack.ExtType(1, b"junk"))],    # bad tensor record
    [msgpack.packb(msgpack.ExtType(1, msgpack.packb(["float32", [10], 5])))],  # missing frame
    [msgpack.packb(msgpack.ExtType(1, msgpack.packb(["float32", [10], 1]))), b"1234"],  # size mismatch
    [msgpack.packb(msgpack.ExtType(1, msgpack.packb(["evil", [1], 1]))), b"1234"],
    [msgpack.packb(msgpack.ExtType(2, msgpack.packb(["|O", [1], 1]))), b"12345678"],
    [msgpack.packb(msgpack.ExtType(99, b""))],
])
def test_codec_rejects_malformed(frames):
    with pytest.raises(CodecError):
        codec.decode(frames)


# RPC --------------------------------------------------------------------------------------
class Calc:
    def __init__(self):
        self.seen = []

    @expose
    def add(self, a, b):
        return a + b

    @expose
    async def slow(self, seconds):
        await asyncio.sleep(seconds)
        return seconds

    @expose(blocking=True)
    def sleepy(self, seconds):
        time.sleep(seconds)
        return "woke"

    @expose
    def fail(self):
        raise KeyError("no such thing")

    @expose
    def record(self, value):
        self.seen.append(value)

    def hidden(self):
        return "not exposed"


@pytest.fixture
async def calc_server():
    calc = Calc()
    server = RpcServer("tcp://127.0.0.1:0", insecure=True, limits=ServerLimits(max_message_bytes=1 << 20),
                       name="calc")
    server.register_object(calc)
    await server.start()
    server.calc = calc
    yield server
    await server.close()


@pytest.fixture
async def client(calc_server):
    c = RpcClient(calc_server.endpoint, insecure=True, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    await c.connect()
    yield c
    await c.close()


async def test_call_sync_async_blocking_and_tensors(client):
    assert await client.call("add", 2, 3) == 5
    t = torch.randn(300, 300)
    assert torch.equal(await client.call("add", t, t), t + t)
    assert await client.call("slow", 0.01) == 0.01
    assert await client.call("sleepy", 0.05) == "woke"


async def test_many_concurrent_calls_match_by_id(client):
    results = await asyncio.gather(*[client.call("add", i, i) for i in range(500)])
    assert results == [2 * i for i in range(500)]
    # slow and fast calls interleave: replies arrive out of order and still match
    slow = asyncio.ensure_future(client.call("slow", 0.2))
    assert await client.call("add", 1, 1) == 2
    assert not slow.done()
    assert await slow == 0.2


async def test_remote_exception_carries_type_message_traceback(client):
    with pytest.raises(RemoteError) as info:
        await client.call("fail")
    assert info.value.remote_type == "builtins.KeyError"
    assert "no such thing" in info.value.remote_message
    assert "def fail" in info.value.remote_traceback or "raise KeyError" in info.value.remote_traceback


async def test_unknown_method_and_unexposed_method(client):
    with pytest.raises(RemoteError, match="no method 'hidden'") as info:
        await client.call("hidden")
    assert info.value.remote_type == "transport.MethodNotFound"
    assert "add" in info.value.remote_message  # lists what it does serve


async def test_timeout_and_cancellation_reach_the_server(client, calc_server):
    with pytest.raises(RpcTimeout):
        await client.call("slow", 5, timeout=0.1)
    task = asyncio.ensure_future(client.call("slow", 5))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert calc_server.stats["cancels"] >= 2
    assert not calc_server._inflight, "cancelled handlers are no longer running"
    assert await client.call("add", 1, 2) == 3


async def test_send_to_hands_replies_and_failures_to_a_sink(client, calc_server):
    """RpcClient.send_to (a group call's fast path): the reply, an error reply and a dropped
    client reach the sink by key; withdraw tells the server to cancel."""
    got = {}
    sink = SimpleNamespace(reply=lambda key, value: got.setdefault(key, value),
                           fail=lambda key, exc: got.setdefault(key, exc))
    for key, (method, args) in {"sum": ("add", [2, 3]), "error": ("fail", [])}.items():
        client.send_to(*encode_request(method, args), sink, key)
    req_id, frames = encode_request("slow", [5])
    client.send_to(req_id, frames, sink, "slow")
    for _ in range(100):
        if len(got) == 2:
            break
        await asyncio.sleep(0.02)
    assert got["sum"] == 5 and isinstance(got["error"], RemoteError) and "slow" not in got
    assert client.withdraw(req_id) and not client.withdraw(req_id)
    await asyncio.sleep(0.05)
    assert calc_server.stats["cancels"] >= 1 and not calc_server._inflight
    client.send_to(*encode_request("slow", [5]), sink, "closed")
    await client.close()
    assert isinstance(got["closed"], ConnectionLost)


async def test_notifications(client, calc_server):
    client.notify("record", 42)
    client.notify("no_such_method", 1)
    assert await client.call("add", 0, 0) == 0  # ordered after the notifications
    assert calc_server.calc.seen == [42]
    assert calc_server.stats["unknown_method"] == 1


async def test_oversized_message_gets_error_and_server_survives(client, calc_server):
    big = torch.zeros(375_000)  # two 1.5 MB tensors: above the 1 MiB limit
    with pytest.raises(RemoteError, match="exceeds") as info:
        await client.call("add", big, big)
    assert info.value.remote_type == "transport.MessageTooLarge"
    assert "cluster.max_message_bytes" in info.value.remote_message
    assert calc_server.stats["too_large"] >= 1
    assert await client.call("add", 1, 1) == 2
    # below the message limit, a tensor above the frame limit arrives (whole, without keys)
    mid = torch.arange(200_000, dtype=torch.float32)  # 800 kB > codec.FRAME_BYTES
    assert torch.equal(await client.call("add", mid, 1, timeout=10), mid + 1)


def test_large_frames_are_cut_into_chunks_and_joined():
    t = torch.arange(3 * codec.FRAME_BYTES // 4 + 5, dtype=torch.float32)
    body = {"t": t, "xs": list(range(100_000))}  # the body itself is above FRAME_BYTES too
    frames = codec.encode(body)
    assert max(len(f) for f in frames) <= codec.FRAME_BYTES
    out = codec.decode([bytes(f) for f in frames])
    assert torch.equal(out["t"], t) and out["xs"] == body["xs"]
    with pytest.raises(CodecError, match="chunk header"):
        codec.decode(frames[:-1])  # a chunk missing


async def test_chunked_messages_are_received_into_one_buffer_and_bad_chunking_is_survived(calc_server, client):
    """A chunked request arrives through recv_into, one buffer per logical frame (its tensor a
    view of that buffer); headers that lie about their chunks (too many, too few, a short middle
    chunk, more than the server's size limit) get a malformed-message error or are dropped, and
    the server keeps answering."""
    n = 3 * codec.FRAME_BYTES // 4 + 5
    t = torch.arange(n, dtype=torch.float32)
    assert torch.equal(await client.call("add", t, 1, timeout=10), t + 1)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(calc_server.endpoint)
    frames = [bytes(f) for f in codec.encode([REQUEST, 41, "add", [t, 1], {}])]
    header, chunks = frames[0], frames[1:]
    counts = msgpack.unpackb(header[1:])
    lies = {"too many": [bytes([0xC1]) + msgpack.packb([counts[0], counts[1] + 1]), *chunks],
            "too few": [header, *chunks[:-1]],
            "short middle chunk": [header, chunks[0], chunks[1][:100], *chunks[2:]],
            "extra frames": [header, *chunks, b"x", b"y"],
            "beyond the limit": [bytes([0xC1]) + msgpack.packb([1, 1 << 40]), *chunks]}
    before = calc_server.stats["malformed"]
    for bad in lies.values():
        raw.send_multipart(bad)
    raw.send_multipart(frames)  # well-formed: answered
    reply = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, raw.recv_multipart), 10)
    raw.close(0)
    assert codec.decode(reply)[:2] == [2, 41], codec.decode(reply)
    assert calc_server.stats["malformed"] >= before + len(lies)
    assert await client.call("add", 1, 2) == 3


async def test_malformed_cancel_and_ping_log_one_line_without_traceback(calc_server, client, caplog):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(calc_server.endpoint)
    with caplog.at_level("WARNING"):
        for _ in range(50):
            raw.send_multipart([msgpack.packb([CANCEL, [1, 2]])])
            raw.send_multipart([msgpack.packb([PING, {"a": 1}])])
            raw.send_multipart([msgpack.packb([CANCEL])])
        assert await client.call("add", 1, 2) == 3  # ordered after the garbage
        await asyncio.sleep(0.1)
    raw.close(0)
    assert calc_server.stats["malformed"] >= 150 and calc_server.stats["dropped"] == 0
    lines = [r for r in caplog.records if "calc" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # rate-limited: one line, not 150
    assert lines[0].exc_info is None and "malformed" in lines[0].getMessage()


async def test_garbage_from_raw_sockets_is_survived(calc_server, client):
    rng = random.Random(0)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(calc_server.endpoint)
    for _ in range(200):
        frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
        raw.send_multipart(frames)
    # structurally valid msgpack but wrong shapes, with a readable request id
    raw.send_multipart([msgpack.packb([REQUEST, 7, 123, "notalist", 5])])
    raw.send_multipart([msgpack.packb([REQUEST, 8, "add", [1], {}])])  # wrong arity
    # raw TCP bytes that are not even ZMTP
    host, port = calc_server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    for _ in range(5):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(rng.randbytes(512))
    await asyncio.sleep(0.3)
    replies = []
    while raw.poll(100):
        replies.append(codec.decode(raw.recv_multipart()))
    raw.close(0)
    by_id = {r[1]: r for r in replies}
    assert by_id[7][2][0] == "transport.MalformedMessage"
    assert by_id[8][2][0] == "builtins.TypeError"
    assert calc_server.stats["malformed"] > 0
    # the well-behaved client was never disturbed
    assert await client.call("add", 20, 22) == 42


async def test_unencodable_result_is_an_error_not_a_hang():
    server = RpcServer("tcp://127.0.0.1:0", insecure=True)
    server.register("weird", lambda: object())
    await server.start()
    try:
        async with RpcClient(server.endpoint, insecure=True) as c:
            with pytest.raises(RemoteError, match="cannot be sent"):
                await c.call("weird", timeout=5)
    finally:
        await server.close()


async def test_ipc_endpoint(tmp_path):
    path = tmp_path / "rpc.sock"
    server = RpcServer(f"ipc://{path}", insecure=True)
    server.register("echo", lambda x: x)
    await server.start()
    async with RpcClient(f"ipc://{path}", insecure=True) as c:
        t = torch.arange(100_000)
        assert torch.equal(await c.call("echo", t), t)
    await server.close()
    assert not path.exists(), "the ipc socket file is removed on close"


def test_security_is_required_by_default():
    with pytest.raises(AuthenticationError, match="insecure=True"):
        RpcServer("tcp://127.0.0.1:0")
    with pytest.raises(AuthenticationError, match="keys generate"):
        RpcClient("tcp://127.0.0.1:1")


# liveness ---------------------------------------------------------------------------------
_SERVER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from transport import RpcServer
    from transport.loop import run
    async def main():
        s = RpcServer("tcp://127.0.0.1:0", insecure=True)
        async def hang():
            await asyncio.sleep(3600)
        s.register("hang", hang)
        s.register("ping", lambda: "pong")
        print(await s.start(), flush=True)
        await asyncio.Event().wait()
    run(main())
""")


async def test_dead_server_gives_connection_lost_not_a_hang():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        endpoint = proc.stdout.readline().strip()
        c = RpcClient(endpoint, insecure=True, heartbeat_interval=0.1, heartbeat_timeout=0.5)
        assert await c.call("ping") == "pong"
        pending = asyncio.ensure_future(c.call("hang"))
        await asyncio.sleep(0.2)
        os.killpg(proc.pid, 9)
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost, match="dropped|probably dead"):
            await asyncio.wait_for(pending, 5)
        assert time.monotonic() - t0 < 2
        await c.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()


async def test_frozen_server_fails_by_heartbeat_timeout():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        endpoint = proc.stdout.readline().strip()
        c = RpcClient(endpoint, insecure=True, heartbeat_interval=0.1, heartbeat_timeout=0.5)
        assert await c.call("ping") == "pong"
        os.killpg(proc.pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost, match="probably dead"):
            await asyncio.wait_for(c.call("ping"), 5)
        assert time.monotonic() - t0 < 2
        await c.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_server_busy_in_async_handler_still_answers_heartbeats(client):
    # a 1.5 s async handler with a 1 s heartbeat timeout must not be declared dead
    assert await client.call("slow", 1.5) == 1.5


async def test_connect_times_out_when_nobody_listens():
    c = RpcClient("tcp://127.0.0.1:1", insecure=True)
    with pytest.raises(RpcTimeout, match="is the server running"):
        await c.connect(timeout=0.3)
    await c.close()


# CurveZMQ ---------------------------------------------------------------------------------
async def test_curve_accepts_authorized_and_refuses_others(tmp_path):
    generate_keys(tmp_path)
    generate_keys(tmp_path, name="alice")
    cluster = CurveConfig.load(tmp_path)
    alice = CurveConfig.load(tmp_path, name="alice")
    assert alice.public_key in cluster.authorized_keys
    server = RpcServer("tcp://127.0.0.1:0", curve=cluster, name="secure")
    server.register("add", lambda a, b: a + b)
    await server.start()
    try:
        for cfg in (cluster, alice):
            async with RpcClient(server.endpoint, curve=cfg) as c:
                assert await c.call("add", 1, 2, timeout=5) == 3
        stranger = CurveConfig.ephemeral()
        stranger = CurveConfig(stranger.public_key, stranger.secret_key, cluster.server_key)
        async with RpcClient(server.endpoint, curve=stranger) as c:
            with pytest.raises(AuthenticationError, match="authorized"):
                await c.call("add", 1, 2, timeout=5)
        # a plaintext client cannot talk to a CURVE server either
        async with RpcClient(server.endpoint, insecure=True) as c:
            with pytest.raises(AuthenticationError, match="security settings differ"):
                await c.call("add", 1, 2, timeout=5)
    finally:
        await server.close()


async def test_frames_travel_in_chunks_under_curve_and_whole_without_keys(monkeypatch):
    """Under CurveZMQ both sides cut a large frame into FRAME_BYTES chunks (the server's frame cap
    is what a keyless peer meets in the handshake); without keys a frame travels whole, with no
    cap and no join copy: the reply's tensor views the received ZeroMQ frame."""
    import transport.socket as socket_mod

    cut = []  # every message cut into chunks
    split = codec.split_frames

    def spy(frames):
        out = split(frames)
        if len(out) != len(frames):
            cut.append(out)
        return out

    monkeypatch.setattr(socket_mod.codec, "split_frames", spy)
    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: nine chunks
    for keys in (CurveConfig.ephemeral(), None):
        server = RpcServer("tcp://127.0.0.1:0", curve=keys, insecure=keys is None, name="bulk")
        server.register("same", lambda t: t)
        await server.start()
        try:
            async with RpcClient(server.endpoint, curve=keys, insecure=keys is None) as c:
                cut.clear()
                back = await c.call("same", big, timeout=10)
                assert torch.equal(back, big)
                caps = {server._sock.sock.maxmsgsize, c._sock.sock.maxmsgsize}
                if keys is not None:
                    assert len(cut) == 2 and all(max(len(f) for f in m) <= codec.FRAME_BYTES for m in cut)
                    assert caps == {codec.FRAME_BYTES + 1024}
                else:
                    assert cut == [] and caps == {-1}
        finally:
            await server.close()


def test_key_files(tmp_path):
    secret = generate_keys(tmp_path / "keys")
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        generate_keys(tmp_path / "keys")
    with pytest.raises(AuthenticationError, match="asyncrl keys generate"):
        CurveConfig.load(tmp_path / "missing")
    cfg = CurveConfig.load(tmp_path / "keys")
    assert CurveConfig.from_env(cfg.to_env()) == cfg


async def test_wrong_arguments_to_an_async_handler_get_an_error_reply():
    server = RpcServer("tcp://127.0.0.1:0", insecure=True)

    async def two(a, b):
        return a + b

    server.register("two", two)
    await server.start()
    try:
        async with RpcClient(server.endpoint, insecure=True) as c:
            with pytest.raises(RemoteError, match="TypeError"):
                await c.call("two", 1, timeout=5)
            assert await c.call("two", 1, 2, timeout=5) == 3
    finally:
        await server.close()


# typed messages and the extension-code table ---------------------------------------------------
def test_every_extension_code_is_listed_once():
    from transport.wire import Ext

    values = [int(e) for e in Ext]
    assert len(values) == len(set(values))
    assert all(1 <= v <= 127 for v in values)
    import asyncrl.single_controller.batch
    import asyncrl.single_controller.distbatch

    assert asyncrl.single_controller.batch.EXT_BATCH == Ext.BATCH and asyncrl.single_controller.distbatch.EXT_DIST_BATCH == Ext.DIST_BATCH


def test_typed_message_roundtrip_and_unknown_enum_value():
    import msgpack

    from daemons.messages import WorkerState, WorkerStatus
    from transport.wire import Ext

    msg = WorkerStatus("w-0", "g", 0, "n", "cpu:0", 42, WorkerState.READY, "")
    back = codec.decode(codec.encode({"w": msg}))["w"]
    assert back == msg and back.state is WorkerState.READY
    # a peer that sends a state this version does not know gets a typed error, not a string
    body = msgpack.packb(msgpack.ExtType(int(Ext.WORKER_STATUS), msgpack.packb(
        ["w-0", "g", 0, "n", "cpu:0", 42, "zombie", "", ""])))
    with pytest.raises(CodecError, match="zombie.*WorkerState"):
        codec.decode([body])
    short = msgpack.packb(msgpack.ExtType(int(Ext.WORKER_STATUS), msgpack.packb(["w-0"])))
    with pytest.raises(CodecError, match="WorkerStatus has 9 fields"):
        codec.decode([short])


def test_message_must_be_a_frozen_dataclass():
    from dataclasses import dataclass

    from transport.codec import message
    from transport.wire import Ext

    @dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="frozen dataclass"):
        message(Ext.WORKER_SPEC)(Mutable)


def test_dtype_names_are_one_table():
    from transport.dtypes import dtype_name, element_size, torch_dtype

    assert torch_dtype(dtype_name(torch.bfloat16)) is torch.bfloat16 and element_size("int16") == 2
    with pytest.raises(CodecError, match="unknown tensor dtype"):
        torch_dtype("Tensor")  # a torch attribute, but not a dtype: refused


# hostile peers before authentication ---------------------------------------------------------
def test_keyless_flood_leaves_server_memory_bounded():
    from benchmarks.chaos_net import run

    # before the frame limit, 8 connections x 16 MiB of one declared 1 GiB frame held 128 MiB
    out = run(big_conns=8, big_mib=16, held_conns=300, garbage_conns=50, time_budget_s=10)
    assert out["daemon_crashes"] == 0
    assert out["preauth_peak_mib"] < 64, out


async def test_connections_above_the_per_peer_cap_are_closed_and_logged_once(caplog):
    keys = CurveConfig.ephemeral()
    server = RpcServer("tcp://127.0.0.1:0", curve=keys, limits=ServerLimits(max_connections_per_peer=4),
                       name="capped")
    server.register("ping", lambda: "pong")
    await server.start()
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    socks = []
    try:
        with caplog.at_level("WARNING"):
            socks = [socket.create_connection((host, int(port))) for _ in range(30)]
            deadline = time.monotonic() + 5
            while server.refused_connections < 26 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        assert server.refused_connections == 26
        closed = 0
        for s in socks:
            s.settimeout(0.3)
            try:
                while s.recv(4096):  # libzmq's greeting, then the hang-up
                    pass
                closed += 1
            except (TimeoutError, OSError):
                pass
        assert closed >= 26
        lines = [r.getMessage() for r in caplog.records
                 if "capped: refused" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(lines) == 1 and "max_connections_per_peer" in lines[0]
    finally:
        for s in socks:
            s.close()
    try:
        await asyncio.sleep(0.2)  # the held ones are gone: a keyed client gets in again
        async with RpcClient(server.endpoint, curve=keys) as c:
            assert await c.call("ping", timeout=5) == "pong"
    finally:
        await server.close()


def test_a_process_without_torch_sends_messages_and_imports_it_for_a_tensor():
    """The command line's RPC (`asyncrl status`, `stop`, `shutdown`) loads no torch (2.6 s of
    imports on the 2-core machine): messages encode and decode without it, and a tensor that
    arrives imports it then."""
    code = textwrap.dedent("""
        import sys
        import daemons.messages, transport.loop
        from transport.codec import decode, encode
        assert decode(encode({"a": (1, 2), "b": b"x", "c": [1.5]})) == {"a": [1, 2], "b": b"x", "c": [1.5]}
        assert "torch" not in sys.modules
        frames = [bytes(f) for f in FRAMES]
        t = decode(frames)["t"]
        assert "torch" in sys.modules and t.dtype is sys.modules["torch"].bfloat16 and t.shape == (300, 2)
        print("ok")
    """).replace("FRAMES", repr([bytes(f) for f in codec.encode({"t": torch.ones(300, 2, dtype=torch.bfloat16)})]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
