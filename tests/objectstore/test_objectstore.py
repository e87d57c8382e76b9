"""Object store: refs, local/shm/TCP pulls, shards, refcounts, limits, lost owners, futures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from daemons.proc import kill_group
from objectstore import (
    ObjectLostError,
    ObjectNotFoundError,
    ObjectRef,
    ObjectStore,
    ObjectStoreFullError,
    ObjectTypeError,
    RowRange,
    ShardRangeError,
    list_segments,
    remove_stale_segments,
    shard_rows,
)
from objectstore.errors import from_remote
from objectstore.paths import PullKind, cuda_ipc
from objectstore.paths.base import PullRequest
from objectstore.ref import TENSOR, _ref_from_wire, _ref_to_wire
from transport import AuthenticationError, CurveConfig, RemoteError, RpcClient, codec
from transport.errors import CodecError

REPO = Path(__file__).resolve().parents[2]
FAST = dict(heartbeat_interval=0.1, heartbeat_timeout=1.0)

# A helper process: an object store plus a small control server the test drives.
WORKER = r"""
import asyncio, json, signal, sys, torch
from objectstore import ObjectStore
from transport import RpcServer
from transport.loop import run

async def main(node_id):
    store = ObjectStore(node_id=node_id, insecure=True, name="child",
                        heartbeat_interval=0.1, heartbeat_timeout=1.0)
    await store.start()
    ctl = RpcServer("tcp://127.0.0.1:0", insecure=True, name="ctl")
    def put(rows, cols):
        return store.put(torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols))
    def put_batch(rows):
        return store.put({"x": torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4),
                          "y": torch.arange(rows, dtype=torch.int64)})
    async def get(ref, rows=None, transport=None):
        return await store.get(ref, rows, transport=transport)
    def put_cuda(rows, cols):
        return store.put(torch.arange(rows * cols, dtype=torch.float32, device="cuda").reshape(rows, cols))
    async def local_sum(ref):
        return float((await store.get(ref)).sum())
    ctl.register("put", put)
    ctl.register("put_cuda", put_cuda)
    ctl.register("local_sum", local_sum)
    ctl.register("put_batch", put_batch)
    ctl.register("get", get)
    ctl.register("stats", store.stats)
    ep = await ctl.start()
    print(json.dumps({"ctl": ep, "store": store.endpoint}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await ctl.close()
        await store.close()

run(main(sys.argv[1]))
"""


class Child:
    """A helper process with its own store; always killed by the fixture."""

    def __init__(self, node_id: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, node_id], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("helper process failed to start")
        info = json.loads(line)
        self.store_endpoint = info["store"]
        self.ctl = RpcClient(info["ctl"], insecure=True, heartbeat_interval=0.1, heartbeat_timeout=2.0)

    async def call(self, method: str, *args, **kwargs):
        return await self.ctl.call(method, *args, timeout=20, **kwargs)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    async def stop(self) -> None:
        await self.ctl.close()
        kill_group(self.proc, grace_s=5)
        self.proc.stdout.close()


pytestmark = pytest.mark.alone  # every test ends checking that /dev/shm holds no store's segment


@pytest.fixture(autouse=True)
def no_leftover_segments():
    yield
    remove_stale_segments()  # segments of helpers we SIGKILLed on purpose
    assert list_segments() == [], "shared-memory segments left behind"


@pytest.fixture
async def stores():
    """Start stores on demand; all closed at the end."""
    started: list[ObjectStore] = []

    async def make(**kw) -> ObjectStore:
        kw.setdefault("insecure", "curve" not in kw)
        store = ObjectStore(**{**FAST, **kw})
        started.append(store)
        await store.start()
        return store

    try:
        yield make
    finally:
        for store in started:
            await store.close()


@pytest.fixture
async def child():
    made: list[Child] = []

    async def make(node_id: str) -> Child:
        c = await asyncio.get_running_loop().run_in_executor(None, Child, node_id)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            await c.stop()


def matrix(rows: int = 64, cols: int = 8) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


# refs and futures ---------------------------------------------------------------------------
def test_ref_roundtrips_through_codec():
    ref = ObjectRef("abc", "node0", "tcp://1.2.3.4:5", "1.2.3.4:6", "batch", "cpu", 96,
                    columns=(("x", "float32", (4, 4)), ("y", "int64", (4,))), num_rows=4)
    out = codec.decode(codec.encode({"refs": [ref], "rows": RowRange(0, 2)}))
    back = out["refs"][0]
    assert back == ref and back.columns == ref.columns and back.num_rows == 4
    assert back.column_specs == {"x": ("float32", (4, 4)), "y": ("int64", (4,))}
    assert RowRange(*out["rows"]) == RowRange(0, 2)


def test_shard_rows_split_evenly():
    assert [shard_rows(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ShardRangeError):
        shard_rows(10, 3, 3)


def test_remote_errors_become_typed():
    err = from_remote(RemoteError("objectstore.errors.ShardRangeError", "rows out"))
    assert isinstance(err, ShardRangeError) and "rows out" in str(err)
    other = RemoteError("builtins.ValueError", "x")
    assert from_remote(other) is other


# same process ---------------------------------------------------------------------------
async def test_same_process_get_returns_the_object(stores):
    store = await stores()
    t = matrix()
    ref = store.put(t)
    assert ref.kind == "tensor" and ref.shape == (64, 8) and ref.nbytes == t.nbytes
    assert await store.get(ref) is t
    part = await store.get(ref, (8, 16))
    assert part.data_ptr() == t[8:16].data_ptr()  # a view, no copy
    batch = {"x": t, "y": torch.arange(64)}
    bref = store.put(batch)
    assert bref.kind == "batch" and bref.num_rows == 64
    assert await store.get(bref) is batch
    vref = store.put({"step": 3, "loss": 0.5})
    assert await store.get(vref) == {"step": 3, "loss": 0.5}
    assert store.stats()["objects"] == 3


async def test_batch_with_unequal_rows_is_refused(stores):
    store = await stores()
    with pytest.raises(ObjectTypeError, match="share dim 0"):
        store.put({"x": torch.zeros(3, 2), "y": torch.zeros(4)})


# same node, shared memory ---------------------------------------------------------------------
async def test_shm_pull_between_stores(stores):
    owner, consumer = await stores(node_id="n"), await stores(node_id="n")
    t = matrix(4096, 16)
    ref = owner.put(t)
    got = await consumer.get(ref)
    assert torch.equal(got, t)
    assert consumer.stats()["pulls_shm"] == 1 and owner.stats()["shm_segments"] == 1
    part = await consumer.get(ref, (1000, 1100))
    assert torch.equal(part, t[1000:1100])
    # only the requested rows are mapped
    assert consumer.stats()["bytes_mapped_shm"] == t.nbytes + 100 * 16 * 4
    part[:] = -1  # copy-on-write: the owner's data is untouched
    assert torch.equal(await owner.get(ref, (1000, 1100)), t[1000:1100])
    await owner.free(ref)
    assert list_segments() == []


async def test_shm_pull_from_another_process(stores, child):
    helper = await child("n")
    store = await stores(node_id="n")
    ref = await helper.call("put", 1000, 32)
    assert ref.node_id == "n" and ref.endpoint == helper.store_endpoint
    assert torch.equal(await store.get(ref), matrix(1000, 32))
    bref = await helper.call("put_batch", 100)
    part = await store.get(bref, (50, 75))
    assert torch.equal(part["x"], matrix(100, 4)[50:75]) and torch.equal(part["y"], torch.arange(50, 75))
    # and the other way: the helper maps what we put
    mine = store.put(matrix(300, 4))
    assert torch.equal(await helper.call("get", mine, [10, 20]), matrix(300, 4)[10:20])
    assert store.stats()["shm_segments"] == 1
    assert (await helper.call("stats"))["pulls_shm"] == 1


# other node, TCP --------------------------------------------------------------------------------
async def test_tcp_pull_moves_only_the_rows(stores):
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    t = matrix(1000, 64)
    batch = {"x": t, "mask": torch.ones(1000, dtype=torch.bool)}
    ref = owner.put(batch)
    got = await consumer.get(ref)
    assert torch.equal(got["x"], t) and got["mask"].all()
    before = consumer.stats()["bytes_received_tcp"]
    rows = shard_rows(1000, 1, 2)
    part = await consumer.get(ref, rows)
    assert torch.equal(part["x"], t[500:])
    moved = consumer.stats()["bytes_received_tcp"] - before
    assert moved == ref.row_bytes(rows) == 500 * 64 * 4 + 500
    assert consumer.stats()["pulls_shm"] == 0 and owner.stats()["shm_segments"] == 0


async def test_tcp_pull_from_another_process(stores, child):
    helper = await child("other-node")
    store = await stores(node_id="n")
    ref = await helper.call("put", 2000, 16)
    assert torch.equal(await store.get(ref, (100, 300)), matrix(2000, 16)[100:300])
    assert store.stats()["pulls_tcp"] == 1
    # forcing the path works on one node too
    assert torch.equal(await store.get(ref, transport="tcp"), matrix(2000, 16))


async def test_bulk_port_rejects_unknown_tokens(stores):
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    ref = owner.put(matrix())
    host, port = owner.bulk_addr.rsplit(":", 1)

    def knock(payload: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            return s.recv(100)

    assert await asyncio.to_thread(knock, os.urandom(16)) == b"\x00"
    assert owner.stats()["bulk_rejected"] == 1
    assert torch.equal(await consumer.get(ref), matrix())  # still serving


async def test_bulk_port_refusals_are_logged_once_per_interval(stores, caplog):
    owner = await stores(node_id="a")
    host, port = owner.bulk_addr.rsplit(":", 1)

    def knock_many(n: int) -> None:
        for _ in range(n):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(os.urandom(16))
                s.recv(1)

    with caplog.at_level("WARNING"):
        await asyncio.to_thread(knock_many, 300)
    assert owner.stats()["bulk_rejected"] == 300
    lines = [r.getMessage() for r in caplog.records if "bulk" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "token" in lines[0], lines  # was one WARNING per connection


async def test_curve_authenticated_stores(stores):
    curve = CurveConfig.ephemeral()
    owner = await stores(node_id="a", curve=curve)
    consumer = await stores(node_id="b", curve=curve)
    same_node = await stores(node_id="a", curve=curve)
    ref = owner.put(matrix())
    assert torch.equal(await consumer.get(ref), matrix())
    assert torch.equal(await same_node.get(ref), matrix())


async def test_an_owner_that_drops_the_handshake_after_accepting_us_is_lost_not_a_key_error(stores):
    """An owner killed while its address still takes connections (a port another process holds
    on its node, a dying kernel socket): a reader that passed its handshake before gets
    ObjectLostError, so recovery starts; a reader meeting such an address first still gets the
    key error."""
    curve = CurveConfig.ephemeral()
    owner = await stores(node_id="a", curve=curve)
    reader, stranger = await stores(node_id="b", curve=curve), await stores(node_id="c", curve=curve)
    ref, other = owner.put(matrix()), owner.put(matrix(8, 8))
    assert torch.equal(await reader.get(ref, transport="tcp"), matrix())
    port = int(owner.endpoint.rsplit(":", 1)[1])
    await owner.close()

    async def hang_up(reader_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    for _ in range(100):  # zmq lets go of the port from its own thread
        try:
            server = await asyncio.start_server(hang_up, "127.0.0.1", port, reuse_address=True)
            break
        except OSError:
            await asyncio.sleep(0.05)
    try:
        for _ in range(2):  # the client that met it, then a new one after the store forgot it
            with pytest.raises(ObjectLostError):
                await asyncio.wait_for(reader.get(other, transport="tcp"), 20)
        with pytest.raises(AuthenticationError):
            await asyncio.wait_for(stranger.get(other, transport="tcp"), 20)
    finally:
        server.close()
        await server.wait_closed()


# reference counting and free -----------------------------------------------------------------
async def test_owner_frees_after_holders_release(stores):
    owner, holder = await stores(node_id="n"), await stores(node_id="n")
    ref = owner.put(matrix())
    await holder.incref(ref)
    await holder.get(ref)  # creates a segment
    await owner.decref(ref)  # the producer is done; the holder still holds it
    assert owner.stats()["objects"] == 1
    assert torch.equal(await holder.get(ref, (0, 4)), matrix()[:4])
    await holder.decref(ref)
    assert owner.stats()["objects"] == 0 and owner.stats()["bytes"] == 0
    assert list_segments() == []
    with pytest.raises(ObjectNotFoundError):
        await holder.get(ref)


async def test_free_then_get_is_not_found_and_store_keeps_serving(stores):
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    ref, keep = owner.put(matrix()), owner.put(matrix(8, 8))
    assert await consumer.free(ref) is True
    assert await owner.free(ref) is False
    with pytest.raises(ObjectNotFoundError, match="freed"):
        await owner.get(ref)
    for transport in ("tcp", "shm"):
        with pytest.raises(ObjectNotFoundError, match="freed"):
            await consumer.get(ref, transport=transport)
        assert torch.equal(await consumer.get(keep, transport=transport), matrix(8, 8))
    with pytest.raises(ObjectNotFoundError):
        await consumer.incref(ref)


async def test_free_many_frees_each_owners_objects_in_one_call(stores):
    a, b, driver = await stores(node_id="a"), await stores(node_id="b"), await stores(node_id="c")
    refs = [a.put(matrix()), a.put(matrix(8, 8)), b.put(matrix()), driver.put(matrix())]
    keep = b.put(matrix(4, 4))
    before = sum(c.requests["free_many"] for c in driver._clients.values())
    assert await driver.free_many(refs) == 4
    assert sum(c.requests["free_many"] for c in driver._clients.values()) - before == 2  # a and b
    assert await driver.free_many(refs) == 0  # gone already: nothing to free, no error
    assert [s.stats()["objects"] for s in (a, b, driver)] == [0, 1, 0]
    assert torch.equal(await driver.get(keep), matrix(4, 4))
    client = RpcClient(a.endpoint, insecure=True)
    try:
        with pytest.raises(RemoteError, match="free_many takes a list of object ids"):
            await client.call("free_many", "not-a-list")
    finally:
        await client.close()


# bad input --------------------------------------------------------------------------------------
async def test_out_of_range_rows(stores):
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    ref = owner.put(matrix(10, 2))
    for rows in [(0, 11), (-1, 3), (5, 4)]:
        with pytest.raises(ShardRangeError, match="out of bounds"):
            await consumer.get(ref, rows)
    # a ref claiming more rows than the owner has is caught by the owner
    forged = ObjectRef(ref.object_id, ref.node_id, ref.endpoint, ref.bulk_addr, "tensor", "cpu",
                       ref.nbytes, "float32", (20, 2), num_rows=20)
    with pytest.raises(ShardRangeError, match="out of bounds"):
        await consumer.get(forged, (0, 15))
    value = owner.put([1, 2, 3])
    with pytest.raises(ShardRangeError, match="without rows"):
        await consumer.get(value, (0, 1))
    assert torch.equal(await consumer.get(ref, (8, 10)), matrix(10, 2)[8:])


async def test_dtype_and_shape_mismatch(stores):
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    ref = owner.put(matrix(10, 2))
    with pytest.raises(ObjectTypeError, match="float32"):
        await consumer.get(ref, dtype=torch.int64)
    with pytest.raises(ObjectTypeError, match="shape"):
        await consumer.get(ref, shape=(10, 3))
    got = await consumer.get(ref, dtype=torch.float32, shape=(10, 2))
    assert torch.equal(got, matrix(10, 2))
    with pytest.raises(ObjectTypeError):
        await consumer.get("not a ref")
    with pytest.raises(ObjectTypeError):
        owner.put(object())


async def test_memory_limit(stores):
    store = await stores(memory_limit_bytes=10_000)
    a = store.put(torch.zeros(2000))  # 8000 bytes
    with pytest.raises(ObjectStoreFullError, match=r"7\.8 KiB of its 9\.8 KiB memory limit") as info:
        store.put(torch.zeros(1000))
    assert a.object_id in str(info.value) and "objectstore.memory_limit" in str(info.value)
    assert store.stats()["bytes"] == 8000 and store.stats()["limit"] == 10_000
    await store.free(a)
    store.put(torch.zeros(1000))


# lost owners ------------------------------------------------------------------------------------
async def test_owner_killed_gives_object_lost(stores, child):
    helper = await child("dead-node")
    store = await stores(node_id="n")
    ref = await helper.call("put", 100, 4)
    assert torch.equal(await store.get(ref), matrix(100, 4))
    helper.kill()
    start = time.monotonic()
    with pytest.raises(ObjectLostError) as info:
        await store.get(ref)
    assert time.monotonic() - start < 5
    assert info.value.node_id == "dead-node" and info.value.endpoint == helper.store_endpoint
    assert "dead-node" in str(info.value) and helper.store_endpoint in str(info.value)
    with pytest.raises(ObjectLostError):
        await store.get(ref, transport="tcp")
    # the consumer itself is fine
    mine = store.put(matrix())
    assert await store.get(mine) is not None


# GPU ------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.mark.gpu
@gpu
async def test_cuda_ipc_pull(stores, child):
    owner, consumer = await stores(node_id="n"), await stores(node_id="n")
    t = torch.arange(4096, device="cuda", dtype=torch.float32).reshape(64, 64)
    ref = owner.put(t)
    assert ref.device.startswith("cuda")
    # in one process CUDA IPC cannot open its own handle; the path is checked across stores via
    # a host copy fallback when IPC is refused
    got = await consumer.get(ref, (0, 32), transport="tcp")
    assert got.is_cuda and torch.equal(got, t[:32])  # a GPU object stays on a GPU


@pytest.mark.gpu
@gpu
async def test_cuda_ipc_pull_copies_unless_a_view_is_asked_for(stores, child):
    """Two processes on one GPU: a consumer's in-place write to a pulled GPU tensor leaves the
    owner's object as it was; `view=True` maps the owner's memory itself."""
    c = await child("n")
    consumer = await stores(node_id="n")
    ref = await c.call("put_cuda", 64, 64)
    got = await consumer.get(ref)
    assert got.is_cuda and consumer.stats()["pulls_cuda_ipc"] == 1
    before = await c.call("local_sum", ref)
    got.add_(1.0)
    assert await c.call("local_sum", ref) == before
    view = await consumer.get(ref, view=True)
    assert torch.equal(view, got - 1.0)


@pytest.mark.gpu
@gpu
async def test_gpu_object_over_tcp_to_device(stores):
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    t = torch.randn(128, 16, device="cuda")
    ref = owner.put(t)
    got = await consumer.get(ref, (64, 128), device="cuda", transport="tcp")
    assert got.is_cuda and torch.equal(got, t[64:])


@pytest.mark.gpu
@gpu
async def test_gpu_objects_of_another_node_fall_back_to_tcp_without_an_nccl_path(stores, caplog):
    """Two "nodes" on one GPU: NCCL refuses two ranks on one device (ncclInvalidUsage, seen on
    the first GPU run); the pull goes over TCP, says so once, and later pulls skip NCCL."""
    from objectstore.paths import nccl as nccl_path

    if not nccl_path.available():
        pytest.skip("cupy's NCCL bindings are not installed (pip install cupy-cuda12x)")
    owner, consumer = await stores(node_id="a"), await stores(node_id="b")
    t = torch.randn(128, 16, device="cuda")
    ref = owner.put(t)
    with caplog.at_level("WARNING"):
        got = await consumer.get(ref, (64, 128))
    assert got.is_cuda and torch.equal(got, t[64:])
    assert "over TCP from now on" in caplog.text
    assert consumer.choose_path(ref) == PullKind.TCP
    again = await consumer.get(ref)
    assert torch.equal(again, t)


async def test_shm_pool_segment_is_used_and_cleaned(stores):
    owner = await stores(node_id="n", shm_pool_bytes=64 * 1024)
    consumer = await stores(node_id="n")
    await owner.wait_shm_pool()
    assert owner.stats()["shm_pool_bytes_ready"] >= 64 * 1024
    ref = owner.put(matrix())
    assert torch.equal(await consumer.get(ref), matrix())
    await owner.wait_shm_pool()  # refilled off the critical path
    assert owner.stats()["shm_pool_bytes_ready"] >= 64 * 1024 and len(list_segments()) == 2


# pull paths ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport, counter", [("shm", "pulls_shm"), ("tcp", "pulls_tcp")])
async def test_each_cpu_pull_path_roundtrips(stores, transport, counter):
    from objectstore.paths import PullKind

    owner, consumer = await stores(node_id="n"), await stores(node_id="n")
    t, batch = matrix(40, 6), {"a": matrix(40, 3), "b": torch.arange(40)}
    ref, bref = owner.put(t), owner.put(batch)
    assert consumer.choose_path(ref, transport) is PullKind(transport)
    assert torch.equal(await consumer.get(ref, transport=transport), t)
    part = await consumer.get(bref, (5, 17), transport=transport)
    assert torch.equal(part["a"], batch["a"][5:17]) and torch.equal(part["b"], batch["b"][5:17])
    assert consumer.stats()[counter] == 2


async def test_local_and_inline_paths(stores):
    from objectstore.paths import PullKind

    owner, consumer = await stores(node_id="n"), await stores(node_id="m")
    vref, tref = owner.put({"score": 1.5, "tags": ["a"]}), owner.put(matrix())
    assert owner.choose_path(tref) is PullKind.LOCAL and consumer.choose_path(vref) is PullKind.INLINE
    assert await consumer.get(vref) == {"score": 1.5, "tags": ["a"]}
    assert consumer.stats()["pulls_value"] == 1
    assert (await owner.get(tref)) is (await owner.get(tref))  # the object itself


async def test_small_objects_travel_inside_their_refs(stores):
    """A store with inline_bytes puts each small host object's value in its ref: a reader on
    another store (the ref through the wire, as in a call) takes its rows without any pull;
    a larger object is pulled as before; a ref whose inline value is not what its kind holds
    is refused by the codec."""
    owner, consumer = await stores(node_id="n", inline_bytes=1024), await stores(node_id="n")
    small, big = owner.put({"a": torch.arange(12.0).reshape(6, 2), "b": torch.arange(6)}), owner.put(matrix())
    value, scalar = owner.put({"uid": ["p0", "p1"]}), owner.put(torch.tensor(3.0))
    assert small.inline is not None and big.inline is None and big.nbytes > 1024
    sref, vref, tref = codec.decode(codec.encode([small, value, scalar]))
    part = await consumer.get(sref, (2, 5))
    assert torch.equal(part["a"], small.inline["a"][2:5]) and torch.equal(part["b"], torch.arange(2, 5))
    part["a"].zero_()  # the reader's own copy
    assert torch.equal((await consumer.get(sref))["a"], torch.arange(12.0).reshape(6, 2))
    assert await consumer.get(vref) == {"uid": ["p0", "p1"]} and float(await consumer.get(tref)) == 3.0
    stats = consumer.stats()
    assert stats["pulls_inline"] == 4 and stats["pulls_shm"] == stats["pulls_value"] == stats["pulls_tcp"] == 0
    assert torch.equal(await consumer.get(big), matrix()) and consumer.stats()["pulls_shm"] == 1
    with pytest.raises(ShardRangeError):
        await consumer.get(sref, (4, 9))
    # a ref sent for some rows carries only those: others are pulled
    narrow = codec.decode(codec.encode(small.narrowed(2, 5)))
    assert len(narrow.inline["a"]) == 3 and narrow.inline_start == 2
    assert torch.equal((await consumer.get(narrow, (3, 5)))["b"], torch.arange(3, 5))
    assert consumer.stats()["pulls_shm"] == 1
    assert torch.equal((await consumer.get(narrow, (1, 3)))["b"], torch.arange(1, 3))
    assert consumer.stats()["pulls_shm"] == 2 and narrow.narrowed(0, 6).inline is None
    for bad in ("not tensors", {"a": torch.zeros(2, 2), "b": torch.zeros(3)}):
        wire = _ref_to_wire(small)
        wire[11] = bad
        with pytest.raises(CodecError, match="inline value"):
            _ref_from_wire(wire)


async def test_pull_endpoint_refuses_untyped_requests(stores):
    owner = await stores(node_id="n")
    ref = owner.put(matrix())
    client = RpcClient(owner.endpoint, insecure=True)
    try:
        with pytest.raises(RemoteError, match="takes a PullRequest"):
            await client.call("shm.pull", [ref.object_id, None], timeout=5)
    finally:
        await client.close()


def test_unknown_object_kind_on_the_wire_is_a_codec_error():
    import msgpack

    from transport import CodecError
    from transport.wire import Ext

    body = msgpack.packb(msgpack.ExtType(int(Ext.OBJECT_REF), msgpack.packb(
        ["id", "n", "tcp://x:1", "x:2", "blob", "cpu", 0, None, None, None, None])))
    with pytest.raises(CodecError, match="not an ObjectKind"):
        codec.decode([body])


# GPU paths' decisions, checked on CPU with the CUDA calls stood in for -------------------------
def _cuda_ref(store: ObjectStore, node_id: str) -> ObjectRef:
    return ObjectRef("obj-gpu", node_id, "tcp://127.0.0.1:1", "127.0.0.1:2", TENSOR, device="cuda:0",
                     nbytes=64, dtype="float32", shape=(4, 4))


async def test_same_node_gpu_pull_falls_back_to_tcp_without_peer_access(stores, monkeypatch):
    store = await stores(node_id="n")
    ipc = store.paths[PullKind.CUDA_IPC]
    ref = _cuda_ref(store, "n")
    monkeypatch.setattr(ipc, "usable", lambda ref: True)
    assert store.choose_path(ref) == PullKind.CUDA_IPC
    monkeypatch.setattr(ipc, "usable", lambda ref: False)
    assert store.choose_path(ref) == PullKind.TCP
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_ipc, "peer_access", lambda consumer, owner: False)
    assert not cuda_ipc.CudaIpcPath(store).usable(ref)
    monkeypatch.setattr(cuda_ipc, "peer_access", lambda consumer, owner: True)
    assert cuda_ipc.CudaIpcPath(store).usable(ref)


async def test_a_host_only_store_pulls_gpu_objects_over_tcp_without_touching_cuda(stores, monkeypatch):
    """The driver's store (host_only): GPU objects of its node or another come over TCP into host
    memory and nothing asks CUDA anything (no context in the controller; seen on an H100)."""
    def no_cuda(*a, **k):
        raise AssertionError("a host-only store asked CUDA")

    for name in ("is_available", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(cuda_ipc, "peer_access", no_cuda)
    store = await stores(node_id="n", host_only=True)
    assert store.choose_path(_cuda_ref(store, "n")) == PullKind.TCP
    assert store.choose_path(_cuda_ref(store, "other")) == PullKind.TCP
    assert store.choose_path(_cuda_ref(store, "n"), transport="cuda_ipc") == PullKind.TCP

    async def host_copy(ref, rows):
        return {None: torch.ones(4, 4)}

    monkeypatch.setattr(store.paths[PullKind.TCP], "fetch", host_copy)
    got = await store.get(_cuda_ref(store, "n"))
    assert got.device.type == "cpu"


async def test_cuda_ipc_fetch_copies_by_default_and_falls_back_when_a_handle_fails(stores, monkeypatch):
    store = await stores(node_id="n")
    ipc = cuda_ipc.CudaIpcPath(store)
    owners = torch.arange(6.0)

    async def reply(ref, rows):
        return cuda_ipc.CudaIpcReply((None,), ([],))

    monkeypatch.setattr(ipc, "request", reply)
    monkeypatch.setattr(cuda_ipc, "open_handle", lambda h: owners)
    copy = (await ipc.fetch(_cuda_ref(store, "n"), None))[None]
    copy.add_(1.0)
    assert torch.equal(owners, torch.arange(6.0))  # the owner's memory is untouched
    assert (await ipc.fetch(_cuda_ref(store, "n"), None, view=True))[None] is owners

    def refused(h):
        raise RuntimeError("invalid resource handle")

    monkeypatch.setattr(cuda_ipc, "open_handle", refused)
    with pytest.raises(cuda_ipc.CudaIpcUnavailable, match="invalid resource handle"):
        await ipc.fetch(_cuda_ref(store, "n"), None)
    assert ipc.broken and not ipc.usable(_cuda_ref(store, "n"))


async def test_nccl_channels_are_cached_per_peer_and_time_out(monkeypatch):
    """One communicator per consumer id on the owner's side, reused; a stuck transfer aborts
    and drops it with a TransferTimeoutError naming the peer."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from objectstore.errors import TransferTimeoutError
    from objectstore.paths import nccl

    io = ThreadPoolExecutor(2)
    path = nccl.NcclPath(SimpleNamespace(name="s", io=io, counters={}))
    calls, aborted = [], []
    monkeypatch.setattr(nccl.Channel, "transfer", lambda self, tensors: calls.append(id(self)) or 12)
    monkeypatch.setattr(nccl.Channel, "abort", lambda self: aborted.append(id(self)))
    entry = SimpleNamespace(ref=SimpleNamespace(object_id="o"), rows=lambda rows: {None: torch.zeros(3)})
    request = PullRequest("o", None, nccl_uid=(1, 2, 3))
    assert await path.serve(entry, None, request) == 12
    assert await path.serve(entry, None, request) == 12
    assert len(path.serving) == 1 and len(set(calls)) == 1 and len(calls) == 2
    await path.serve(entry, None, PullRequest("o", None, nccl_uid=(4, 5, 6)))
    assert len(path.serving) == 2
    monkeypatch.setattr(nccl.Channel, "transfer", lambda self, tensors: time.sleep(1.0))
    path.timeout_s = 0.1
    with pytest.raises(TransferTimeoutError, match="did not finish"):
        await path.serve(entry, None, request)
    assert (1, 2, 3) not in path.serving and aborted
    io.shutdown(wait=True)


def test_only_a_communicator_that_cannot_be_built_sends_an_owner_to_tcp():
    """A timeout or a freed object on an NCCL channel is retried over NCCL next time; only a
    communicator that could not be built (here or on the owner) refuses NCCL for that owner."""
    from objectstore.errors import TransferTimeoutError
    from objectstore.paths import nccl

    assert nccl._no_communicator(nccl.NcclUnavailable("ncclInvalidUsage"))
    assert nccl._no_communicator(RemoteError("objectstore.paths.nccl.NcclUnavailable", "ncclInvalidUsage"))
    assert not nccl._no_communicator(TransferTimeoutError("did not finish"))
    assert not nccl._no_communicator(RemoteError("objectstore.errors.ObjectNotFoundError", "freed"))
