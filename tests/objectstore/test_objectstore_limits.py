"""Object-store limits: the memory limit in real jobs, a small /dev/shm, segment ownership that does
not rely on pids, and cleanup of a killed worker's segments by its node daemon."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from daemons.cluster import ClusterConfig, ClusterSpec, HeadNode
from daemons.proc import kill_group
from objectstore import (
    ObjectStore,
    ObjectStoreFullError,
    list_segments,
    memory,
    remove_stale_segments,
    segments,
)
from transport import RemoteError, RpcClient
from transport.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]
FAST = dict(heartbeat_interval=0.1, heartbeat_timeout=1.0, insecure=True)

# A store in its own process, driven over a small control server.
OWNER = r"""
import asyncio, json, os, signal, sys, torch
from objectstore import ObjectStore
from transport import RpcServer
from transport.loop import run

async def main(node_id, shm_dir):
    store = ObjectStore(node_id=node_id, insecure=True, name="owner", shm_dir=shm_dir,
                        heartbeat_interval=0.1, heartbeat_timeout=1.0)
    await store.start()
    ctl = RpcServer("tcp://127.0.0.1:0", insecure=True, name="ctl")
    ctl.register("put", lambda n: store.put(torch.arange(n, dtype=torch.float32)))
    ctl.register("stats", store.stats)
    ep = await ctl.start()
    print(json.dumps({"ctl": ep, "store": store.endpoint, "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await ctl.close()
        await store.close()

run(main(sys.argv[1], sys.argv[2]))
"""


class Owner:
    """A store in a helper process; always stopped by the fixture."""

    def __init__(self, node_id: str, shm_dir: str, wrap: tuple[str, ...] = ()) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([*wrap, sys.executable, "-c", OWNER, node_id, shm_dir], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("helper process failed to start")
        info = json.loads(line)
        self.pid = info["pid"]  # as its own PID namespace numbers it
        self.ctl = RpcClient(info["ctl"], insecure=True, heartbeat_interval=0.1, heartbeat_timeout=2.0)

    async def call(self, method: str, *args):
        return await self.ctl.call(method, *args, timeout=20)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    async def stop(self) -> None:
        await self.ctl.close()
        kill_group(self.proc, grace_s=5)
        self.proc.stdout.close()


@pytest.fixture
async def stores():
    started: list[ObjectStore] = []

    async def make(**kw) -> ObjectStore:
        store = ObjectStore(**{**FAST, **kw})
        started.append(store)
        await store.start()
        return store

    yield make
    for store in started:
        await store.close()


@pytest.fixture
async def owner():
    started: list[Owner] = []

    async def make(node_id: str = "n", shm_dir: str = segments.SHM_DIR, wrap: tuple[str, ...] = ()) -> Owner:
        started.append(Owner(node_id, shm_dir, wrap))
        return started[-1]

    yield make
    for helper in started:
        await helper.stop()


@pytest.fixture
def small_tmpfs():
    """A real 8 MiB tmpfs, standing in for Docker's default 64 MiB /dev/shm (root only)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        reason = "mounting a small tmpfs needs root and mount(8)"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    path = tempfile.mkdtemp(prefix="asyncrl-small-shm-")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], capture_output=True, text=True)
    if res.returncode != 0:
        os.rmdir(path)
        reason = f"cannot mount a tmpfs here: {res.stderr.strip()}"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def _own_leftovers(before: set[str]) -> set[str]:
    return set(list_segments()) - before


# memory limit ----------------------------------------------------------------------------------
async def test_full_store_names_its_biggest_holders(stores):
    owner = await stores(node_id="n", memory_limit_bytes=1 << 20, name="store-w0")
    holder = await stores(node_id="m", name="store-w1")
    big = owner.put(torch.zeros(128 * 1024))  # 512 KiB
    small = owner.put(torch.zeros(1024))  # 4 KiB
    await holder.incref(big)
    with pytest.raises(ObjectStoreFullError) as info:
        owner.put(torch.zeros(200 * 1024))  # 800 KiB more
    msg = str(info.value)
    assert "store-w0" in msg and "800.0 KiB" in msg and "1.0 MiB" in msg
    assert big.object_id[:12] in msg and "512.0 KiB" in msg and "store-w1" in msg
    assert msg.index(big.object_id[:12]) < msg.index(small.object_id[:12])  # biggest first
    assert "objectstore.memory_limit" in msg and "free" in msg
    with pytest.raises(ObjectStoreFullError, match="that alone is over its 1.0 MiB memory limit"):
        owner.put(torch.zeros(1 << 20))
    await holder.decref(big)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
async def test_gpu_objects_do_not_count_against_the_host_limit(stores):
    store = await stores(memory_limit_bytes=10_000)
    store.put(torch.zeros(1 << 20, device="cuda"))  # 4 MiB on the device: its allocator's business
    assert store.stats()["host_bytes"] == 0 and store.stats()["bytes"] == 4 << 20
    store.put(torch.zeros(2000))
    with pytest.raises(ObjectStoreFullError):
        store.put(torch.zeros(1000))


def test_default_limit_is_a_fraction_of_the_node_memory():
    total = memory.node_memory_bytes()
    assert 0 < total <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.resolve_memory_limit(None, stores_on_node=3) == int(memory.DEFAULT_MEMORY_FRACTION * total / 3)
    assert memory.resolve_memory_limit(12345, stores_on_node=3) == 12345


def test_memory_limit_config_key_is_typed():
    from asyncrl.config import RLConfig
    from asyncrl.single_controller.config import LaunchConfig
    from asyncrl.single_controller.schema import typed

    assert typed(LaunchConfig, {}).objectstore.memory_limit is None
    assert typed(RLConfig, {"objectstore": {"memory_limit": 1 << 30}}).objectstore.memory_limit == 1 << 30
    with pytest.raises(ConfigError, match="did you mean objectstore.memory_limit"):
        typed(LaunchConfig, {"objectstore": {"memory_limt": 5}})
    with pytest.raises(ConfigError, match="objectstore.memory_limit"):
        typed(LaunchConfig, {"objectstore": {"memory_limit": -1}})
    with pytest.raises(ConfigError, match="objectstore.memory_limit"):
        typed(LaunchConfig, {"objectstore": {"memory_limit": "lots"}})


def test_launch_passes_the_memory_limit_to_the_node():
    from omegaconf import OmegaConf

    from asyncrl.jobs.nodes import cluster_spec

    cfg = OmegaConf.create({"cluster": {"coordinator": None, "port": 0, "node_rank": 0, "nnodes": 1, "host": None,
                                        "cpu_devices": 1, "key_dir": None, "insecure": True, "log_dir": "x",
                                        "heartbeat_interval_s": 1.0, "node_timeout_s": 5.0, "shm_pool_bytes": 0},
                            "objectstore": {"memory_limit": 7 << 20}})
    spec = cluster_spec(cfg)
    assert spec.store_memory_limit == 7 << 20
    assert spec.node_daemon("tcp://127.0.0.1:1").store_memory_limit == 7 << 20


async def test_worker_and_driver_stores_have_limits(tmp_path):
    from asyncrl.single_controller.context import JobContext

    spec = ClusterSpec(ClusterConfig(cpu_devices=1, insecure=True, log_dir=str(tmp_path / "logs"),
                                     heartbeat_interval_s=0.5, allowed_packages=["tests"]),
                       store_memory_limit=4 << 20)
    async with HeadNode.start(spec) as head:
        (worker,) = await head.coordinator.spawn_workers(head.coordinator.create_pool("p"))
        assert (await worker.call("store_stats", timeout=5))["limit"] == 4 << 20
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            await worker.run("tests.helpers.store_workers:fill_store", 1 << 20, timeout=30)
        assert time.monotonic() - t0 < 10
        assert info.value.remote_type.endswith("ObjectStoreFullError")
        assert "objectstore.memory_limit" in str(info.value) and "4.0 MiB" in str(info.value)
        # the driver's store: the configured limit, else the node's default share
        ctx = await JobContext(head.coordinator, {"objectstore": {"memory_limit": 3 << 20}}).open()
        try:
            assert ctx.store.memory_limit_bytes == 3 << 20
        finally:
            await ctx.close()
        ctx = await JobContext(head.coordinator, None).open()
        try:
            assert ctx.store.memory_limit_bytes == memory.resolve_memory_limit(None, stores_on_node=2)
        finally:
            await ctx.close()


# a small /dev/shm ----------------------------------------------------------------------------
async def test_pull_bigger_than_free_shm_goes_over_tcp(stores, caplog):
    before = set(list_segments())
    small = lambda shm_dir: 256 << 10  # noqa: E731  (a simulated 256 KiB /dev/shm)
    owner = await stores(node_id="n", shm_free_bytes=small)
    consumer = await stores(node_id="n")
    big = torch.arange(128 << 10, dtype=torch.float32)  # 512 KiB
    ref = owner.put(big)
    with caplog.at_level(logging.WARNING, logger="objectstore"):
        for _ in range(3):
            assert torch.equal(await consumer.get(ref), big)
    warnings = [r for r in caplog.records if "/dev/shm" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, "the fallback warns once per store"
    assert "--shm-size" in warnings[0].getMessage()
    assert consumer.stats()["pulls_tcp"] == 3 and consumer.stats()["pulls_shm"] == 0
    assert owner.stats()["shm_fallbacks"] == 3 and owner.stats()["shm_segments"] == 0
    # a small object still fits and goes through shared memory
    ref2 = owner.put(torch.ones(1024))
    assert torch.equal(await consumer.get(ref2), torch.ones(1024))
    assert consumer.stats()["pulls_shm"] == 1
    await owner.free(ref2)
    assert _own_leftovers(before) == set()


async def test_spare_segment_that_does_not_fit_is_skipped(stores):
    before = set(list_segments())
    owner = await stores(node_id="n", shm_pool_bytes=1 << 20, shm_free_bytes=lambda shm_dir: 512 << 10)
    consumer = await stores(node_id="n")
    await owner.wait_shm_pool()
    assert owner.stats()["shm_pool_bytes_ready"] == 0
    small, big = torch.ones(1024), torch.ones(256 << 10)  # 4 KiB fits, 1 MiB does not
    assert torch.equal(await consumer.get(owner.put(small)), small)
    assert torch.equal(await consumer.get(owner.put(big)), big)
    assert consumer.stats()["pulls_shm"] == 1 and consumer.stats()["pulls_tcp"] == 1
    await owner.close()
    assert _own_leftovers(before) == set()


async def test_pull_bigger_than_a_real_small_shm_keeps_the_owner_alive(small_tmpfs, stores, owner):
    """Before: the owner died of SIGBUS and a segment filled the tmpfs."""
    helper = await owner("n", small_tmpfs)
    consumer = await stores(node_id="n", shm_dir=small_tmpfs)
    ref = await helper.call("put", 3 << 20)  # 12 MiB into an 8 MiB tmpfs
    got = await consumer.get(ref)
    assert torch.equal(got, torch.arange(3 << 20, dtype=torch.float32))
    assert helper.proc.poll() is None
    assert (await helper.call("stats"))["shm_fallbacks"] == 1
    assert [n for n in os.listdir(small_tmpfs) if n.startswith(segments.SEGMENT_PREFIX)] == []
    small_ref = await helper.call("put", 1024)
    assert torch.equal(await consumer.get(small_ref), torch.arange(1024, dtype=torch.float32))
    assert (await helper.call("stats"))["shm_segments"] == 1


def test_segment_creation_on_a_full_tmpfs_fails_cleanly(small_tmpfs):
    """Even when the capacity check passes (another process filled the tmpfs since), creating a
    segment reserves its pages at once: an error now, not a SIGBUS later, and nothing left behind."""
    with pytest.raises(segments.ShmFullError):
        segments.Segment.create(16 << 20, "big", small_tmpfs, owner="o" + "0" * 15)
    assert os.listdir(small_tmpfs) == []


# segment ownership ---------------------------------------------------------------------------
def _no_pid_is_visible(pid: int, sig: int) -> None:
    raise ProcessLookupError(pid)  # the owner runs in another PID namespace


def _every_pid_is_alive(pid: int, sig: int) -> None:
    return None  # the dead owner's pid was reused


async def _segments_of_helper(helper: Owner, consumer: ObjectStore) -> set[str]:
    before = set(list_segments())
    ref = await helper.call("put", 4096)
    assert torch.equal(await consumer.get(ref), torch.arange(4096, dtype=torch.float32))
    made = set(list_segments()) - before
    assert made, "the same-node pull made no segment"
    return made


async def test_sweep_keeps_a_live_segment_whose_pid_is_not_visible(stores, owner, monkeypatch):
    helper = await owner("n")
    consumer = await stores(node_id="n")
    made = await _segments_of_helper(helper, consumer)
    with monkeypatch.context() as m:
        m.setattr(os, "kill", _no_pid_is_visible)
        removed = remove_stale_segments()
    assert not made & set(removed)
    assert made <= set(list_segments())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_store_in_another_pid_namespace_keeps_its_segments(stores, owner):
    """The real case: a job in another PID namespace shares /dev/shm (`--ipc=host`) and its owner's
    pid, as that namespace numbers it, is no process here. The old pid-based sweep deleted its live
    segment and the next pull was ObjectLostError."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        reason = "a PID namespace needs root and unshare(1)"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    pid = next(p for p in range(pid_max - 10, 300, -1) if not _pid_alive(p))
    # the namespace's shell forks the owner as its next pid: `pid`, dead in our namespace
    wrap = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
            f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$0" "$@"; exit $?')
    helper = await owner("n", wrap=wrap)
    if helper.pid != pid:
        pytest.skip(f"could not choose the owner's pid in its namespace (got {helper.pid}, wanted {pid})")
    assert not _pid_alive(helper.pid)
    consumer = await stores(node_id="n")
    before = set(list_segments())
    ref = await helper.call("put", 4096)
    assert torch.equal(await consumer.get(ref), torch.arange(4096, dtype=torch.float32))
    made = set(list_segments()) - before
    assert made
    removed = remove_stale_segments()
    assert not made & set(removed) and made <= set(list_segments())
    assert torch.equal(await consumer.get(ref, (10, 20)), torch.arange(10, 20, dtype=torch.float32))


async def test_sweep_removes_a_killed_stores_segments_even_if_its_pid_is_reused(stores, owner, monkeypatch):
    helper = await owner("n")
    consumer = await stores(node_id="n")
    made = await _segments_of_helper(helper, consumer)
    helper.kill()
    with monkeypatch.context() as m:
        m.setattr(os, "kill", _every_pid_is_alive)
        removed = remove_stale_segments()
    assert made <= set(removed)
    assert not made & set(list_segments())
    assert not [n for n in os.listdir(segments.SHM_DIR) if n.startswith(segments.OWNER_PREFIX)
                and n.split(".")[0].removeprefix(segments.OWNER_PREFIX) in "".join(made)]


async def test_closed_store_leaves_no_lock_file(stores):
    store = await stores()
    lock = store.stats()["shm_owner"]
    assert any(lock in n for n in os.listdir(segments.SHM_DIR))
    await store.close()
    assert not any(lock in n for n in os.listdir(segments.SHM_DIR))


async def test_node_daemon_removes_a_killed_workers_segments(tmp_path, stores):
    spec = ClusterSpec(ClusterConfig(cpu_devices=2, insecure=True, log_dir=str(tmp_path / "logs"),
                                     heartbeat_interval_s=0.5, allowed_packages=["tests"]))
    async with HeadNode.start(spec) as head:
        (worker,) = await head.coordinator.spawn_workers(head.coordinator.create_pool("p", world_size=1))
        stats = await worker.call("store_stats", timeout=5)
        # nothing configured: the default share (two workers' stores and the driver's on this node)
        assert stats["limit"] == memory.resolve_memory_limit(None, stores_on_node=3)
        token = stats["shm_owner"]
        consumer = await stores(node_id=head.node.node_id)
        ref = await worker.run("tests.helpers.store_workers:put_rows", 256, timeout=10)
        assert (await consumer.get(ref)).shape == (256, 4)
        assert [n for n in list_segments() if token in n]
        os.kill(worker.info.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(token in n for n in os.listdir(segments.SHM_DIR)):
            await asyncio.sleep(0.1)
        assert not any(token in n for n in os.listdir(segments.SHM_DIR)), "the node left the segments"


# the benchmark -------------------------------------------------------------------------------
@pytest.mark.slow
def test_chaos_store_benchmark():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "benchmarks.chaos_store"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["store_full_error"] is True and out["small_shm_ok"] is True
    assert out["leftover_shm_segments"] == 0 and out["seconds"] < 30
