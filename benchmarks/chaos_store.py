"""Object-store chaos: a full store, a small /dev/shm and killed owners, on this machine (< 30 s).

    python -m benchmarks.chaos_store

- `store_full_error`: a worker whose store has a 16 MiB limit (`ClusterSpec(store_memory_limit=)`,
  what `objectstore.memory_limit` sets) puts 4 MiB objects until its store refuses one. True when
  the call fails with ObjectStoreFullError naming the biggest object and the limit, within 10 s,
  and the worker still answers: not a kernel OOM kill. `default_limit_mib` is the limit a worker
  gets when nothing is configured.
- `small_shm_ok`: a same-node pull of a 96 MiB object from an owner process whose shared memory
  is a 64 MiB tmpfs (Docker's default /dev/shm; mounted for the run when this runs as root, else
  simulated through the store's `shm_free_bytes`, see `small_shm_mode`). True when every byte
  arrives (over the TCP fallback), the owner lives and no segment is left in the tmpfs.
  `small_shm_vs_shm` is that pull's time over the same pull through shared memory from an owner
  on the real /dev/shm: what a small /dev/shm costs.
- `leftover_shm_segments`: segments and owner files, in /dev/shm and the tmpfs, of the stores
  the scenarios started (a SIGKILLed worker and a SIGKILLed store among them) that are still
  there at the end. The killed worker's are removed by its node daemon, the killed store's by
  the sweep that every store runs when it starts.

The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from daemons.cluster import ClusterConfig, ClusterSpec, HeadNode
from daemons.proc import kill_group
from objectstore import ObjectStore, segments
from objectstore.memory import resolve_memory_limit
from transport import RemoteError, RpcClient
from transport.loop import run as run_loop

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
STORE_LIMIT = 16 * MIB
FILL_CHUNK = 4 * MIB
SMALL_SHM = 64 * MIB
BIG_OBJECT = 96 * MIB

OWNER = r"""
import asyncio, json, signal, sys, torch
from objectstore import ObjectStore
from transport import RpcServer
from transport.loop import run

async def main(shm_dir, simulated_free):
    kw = {"shm_free_bytes": lambda d: simulated_free} if simulated_free else {}
    store = ObjectStore(node_id="chaos", insecure=True, name="chaos-owner", shm_dir=shm_dir, **kw)
    await store.start()
    ctl = RpcServer("tcp://127.0.0.1:0", insecure=True, name="ctl")
    ctl.register("put", lambda n: store.put(torch.arange(n, dtype=torch.int32)))
    ctl.register("stats", store.stats)
    print(json.dumps({"ctl": await ctl.start(), "token": store.stats()["shm_owner"]}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await ctl.close()
        await store.close()

run(main(sys.argv[1], int(sys.argv[2])))
"""


# run inside the worker -------------------------------------------------------------------------
def fill(chunk_bytes: int, runtime) -> None:
    """Put `chunk_bytes` objects until the worker's store refuses one."""
    held = []
    while True:
        held.append(runtime.store.put(torch.zeros(chunk_bytes // 4)))


def put_rows(rows: int, runtime):
    return runtime.store.put(torch.arange(rows * 4, dtype=torch.int32).reshape(rows, 4))


# helpers ---------------------------------------------------------------------------------------
class Owner:
    """A store in its own process (shared memory in `shm_dir`)."""

    def __init__(self, shm_dir: str, simulated_free: int = 0) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, shm_dir, str(simulated_free)], cwd=REPO,
                                     env=env, stdout=subprocess.PIPE, start_new_session=True)
        info = json.loads(self.proc.stdout.readline() or "{}")
        if not info:
            raise RuntimeError("the owner process failed to start")
        self.token = info["token"]
        self.ctl = RpcClient(info["ctl"], insecure=True)

    async def call(self, method: str, *args):
        return await self.ctl.call(method, *args, timeout=30)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    async def stop(self) -> None:
        await self.ctl.close()
        kill_group(self.proc, grace_s=5)
        self.proc.stdout.close()


@contextlib.contextmanager
def small_tmpfs():
    """A real 64 MiB tmpfs when this runs as root (yields its path), else None."""
    path = tempfile.mkdtemp(prefix="asyncrl-chaos-shm-")
    mounted = False
    try:
        if os.geteuid() == 0 and shutil.which("mount"):
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_SHM}", "tmpfs", path],
                                     capture_output=True).returncode == 0
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def _ours(shm_dir: str, tokens: set[str]) -> list[str]:
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith((segments.SEGMENT_PREFIX, segments.OWNER_PREFIX))
            and any(t in n for t in tokens)]


async def _wait_gone(shm_dir: str, tokens: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _ours(shm_dir, tokens) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


# scenarios -------------------------------------------------------------------------------------
async def store_full(tokens: set[str], log_dir: str) -> dict:
    """A worker fills its limited store; then it is SIGKILLed with a segment out."""
    spec = ClusterSpec(ClusterConfig(cpu_devices=1, insecure=True, log_dir=str(log_dir), heartbeat_interval_s=0.5,
                                     allowed_packages=["benchmarks"]), store_memory_limit=STORE_LIMIT)
    async with HeadNode.start(spec) as head:
        (worker,) = await head.coordinator.spawn_workers(head.coordinator.create_pool("chaos"))
        tokens.add((await worker.call("store_stats", timeout=10))["shm_owner"])
        # a same-node pull gives the worker a segment that its death must not leak
        consumer = ObjectStore(node_id=head.node.node_id, insecure=True, name="chaos-consumer")
        await consumer.start()
        tokens.add(consumer.shm_owner.token)
        try:
            ref = await worker.run("benchmarks.chaos_store:put_rows", 4096, timeout=30)
            assert (await consumer.get(ref)).shape == (4096, 4)
            t0 = time.monotonic()
            try:
                await worker.run("benchmarks.chaos_store:fill", FILL_CHUNK, timeout=30)
                error = ""
            except RemoteError as e:
                error = e.remote_type + ": " + str(e)
            seconds = time.monotonic() - t0
            alive = await worker.call("ping", timeout=10) == worker.info.worker_id
            ok = ("ObjectStoreFullError" in error and "16.0 MiB" in error and "4.0 MiB" in error
                  and "objectstore.memory_limit" in error and seconds < 10 and alive)
            os.kill(worker.info.pid, signal.SIGKILL)
            await _wait_gone(segments.SHM_DIR, tokens - {consumer.shm_owner.token}, 10)
        finally:
            await consumer.close()
    return {"store_full_error": ok, "store_full_s": round(seconds, 2),
            "default_limit_mib": resolve_memory_limit(None, stores_on_node=2) // MIB}


async def small_shm(tokens: set[str]) -> dict:
    """A 96 MiB same-node pull from an owner with a 64 MiB /dev/shm, against one with a big one."""
    with small_tmpfs() as tmpfs:
        shm_dir = tmpfs or tempfile.mkdtemp(prefix="asyncrl-chaos-sim-")
        small = Owner(shm_dir, simulated_free=0 if tmpfs else SMALL_SHM)
        big = Owner(segments.SHM_DIR)
        tokens.update({small.token, big.token})
        consumer = ObjectStore(node_id="chaos", insecure=True, name="chaos-consumer", shm_dir=shm_dir)
        local = ObjectStore(node_id="chaos", insecure=True, name="chaos-consumer-shm")
        try:
            await consumer.start()
            await local.start()
            tokens.update({consumer.shm_owner.token, local.shm_owner.token})
            n = BIG_OBJECT // 4
            want = torch.arange(n, dtype=torch.int32)

            ref = await small.call("put", n)
            t0 = time.monotonic()
            got = await consumer.get(ref)
            small_s = time.monotonic() - t0
            stats = await small.call("stats")
            ok = (torch.equal(got, want) and small.proc.poll() is None and stats["shm_fallbacks"] == 1
                  and not segments.list_segments(shm_dir))
            del got

            ref = await big.call("put", n)
            t0 = time.monotonic()
            got = await local.get(ref)
            shm_s = time.monotonic() - t0
            ok = ok and torch.equal(got, want)
            del got
            # the big owner dies with its segment out: the next store's start sweeps it
            big.kill()
            sweeper = ObjectStore(insecure=True, name="chaos-sweeper")
            await sweeper.start()
            tokens.add(sweeper.shm_owner.token)
            await sweeper.close()
        finally:
            await consumer.close()
            await local.close()
            await small.stop()
            await big.stop()
        leftover = len(_ours(shm_dir, tokens))
        if not tmpfs:
            shutil.rmtree(shm_dir, ignore_errors=True)
    return {"small_shm_ok": bool(ok), "small_shm_mode": "tmpfs" if tmpfs else "simulated",
            "small_shm_pull_s": round(small_s, 3), "shm_pull_s": round(shm_s, 3),
            "small_shm_vs_shm": round(small_s / shm_s, 2), "leftover_small_shm": leftover}


async def main_async() -> dict:
    tokens: set[str] = set()
    t0 = time.monotonic()
    log_dir = tempfile.mkdtemp(prefix="asyncrl-chaos-logs-")
    try:
        out = await store_full(tokens, log_dir)
        out.update(await small_shm(tokens))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    out["leftover_shm_segments"] = len(_ours(segments.SHM_DIR, tokens)) + out.pop("leftover_small_shm")
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def run() -> dict:
    """Run every scenario; {"store_full_error", "small_shm_ok", "leftover_shm_segments", …}."""
    return run_loop(main_async())


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
