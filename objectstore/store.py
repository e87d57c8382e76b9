"""`ObjectStore`: one per worker process; holds the objects the process produced and pulls
objects other stores own.

Objects live where they were produced (CPU memory, or GPU memory on a GPU worker). A consumer
pulls straight from the owner, by the cheapest path its locality allows:

    owner is this store          the object itself (no copy)
    same node, CPU               shared memory: the owner copies the object once into a
                                 /dev/shm segment (on the first same-node pull) and every
                                 consumer maps just the pages of its rows
    same node, GPU               CUDA IPC (device memory shared, no copy)
    other node, CPU              bulk TCP stream, gated by a one-time token from the RPC
    other node, GPU              NCCL point-to-point (cupy), else TCP through host memory

Reference counting: `put` gives the producer one local reference; other stores register as
holders with `incref` and release with `decref`. The owner drops the object when its local
count and all holders reach zero. An explicit `free` drops it at once. A full store raises
`ObjectStoreFullError` rather than spilling: RL objects are short-lived, so a full store means
refs are leaking, and spilling would hide that behind slow disk I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from objectstore import bulk, gpu, shm
from objectstore.errors import (
    ObjectLostError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreFullError,
    ObjectTypeError,
    ShardRangeError,
    from_remote,
)
from objectstore.ref import BATCH, TENSOR, VALUE, ObjectRef, RowRange, dtype_name
from transport import (
    ConnectionLost,
    CurveConfig,
    RemoteError,
    RpcClient,
    RpcServer,
    RpcTimeout,
    codec,
)

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "local", "shm", "tcp", "cuda_ipc", "nccl")


def default_node_id() -> str:
    """This machine's id: stores with equal node ids pull through shared memory."""
    return socket.gethostname()


@dataclass
class _Entry:
    ref: ObjectRef
    value: Any
    local_refs: int = 1
    holders: dict[str, int] = field(default_factory=dict)
    segment: shm.Segment | None = None
    offsets: dict[str | None, int] = field(default_factory=dict)
    shm_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def tensors(self) -> dict[str | None, torch.Tensor]:
        return {None: self.value} if self.ref.kind == TENSOR else dict(self.value)


def _slice(value: Any, kind: str, rows: RowRange | None) -> Any:
    if rows is None or kind == VALUE:
        return value
    if kind == TENSOR:
        return value[rows.start:rows.stop]
    return {k: t[rows.start:rows.stop] for k, t in value.items()}


def _to_device(value: Any, kind: str, device: str | torch.device | None) -> Any:
    if device is None or kind == VALUE:
        return value
    if kind == TENSOR:
        return value.to(device)
    return {k: t.to(device) for k, t in value.items()}


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size() if t.dim() else 0


class ObjectStore:
    """One process's object store: owns what the process `put`s and pulls what others own."""

    def __init__(
        self,
        *,
        node_id: str | None = None,
        endpoint: str = "tcp://127.0.0.1:0",
        bulk_host: str = "127.0.0.1",
        bulk_port: int = 0,
        curve: CurveConfig | None = None,
        insecure: bool = False,
        memory_limit_bytes: int | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        bulk_timeout: float = 60.0,
        transport: str = "auto",
        io_threads: int = 4,
        name: str = "store",
        shm_dir: str = shm.SHM_DIR,
        shm_pool_bytes: int = 0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self.node_id = node_id or default_node_id()
        self.store_id = uuid.uuid4().hex
        self.name = name
        self.curve, self.insecure = curve, insecure
        self.memory_limit_bytes = memory_limit_bytes
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.bulk_timeout = bulk_timeout
        self.default_transport = transport
        self.shm_dir = shm_dir
        # Spare, pre-faulted segments: allocating and zeroing fresh pages costs more than the
        # copy itself, so it is done ahead of time, off the pull's critical path. Segments
        # are never reused after a consumer could have mapped them.
        self.shm_pool_bytes = shm_pool_bytes
        self._shm_pool: list[shm.Segment] = []
        self._pool_refill: asyncio.Task | None = None
        self._server = RpcServer(endpoint, curve=curve, insecure=insecure, name=name)
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"{name}-io")
        self._bulk = bulk.BulkServer(bulk_host, bulk_port, self._io, name=f"{name}-bulk")
        self.endpoint = ""
        self.bulk_addr = ""
        self._objects: dict[str, _Entry] = {}
        self._clients: dict[str, RpcClient] = {}
        self._bytes_used = 0
        self._started = False
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets_local", "pulls_shm", "pulls_tcp", "pulls_cuda_ipc", "pulls_nccl",
             "pulls_value", "bytes_mapped_shm", "bytes_received_tcp", "bytes_received_gpu",
             "shm_bytes_written", "frees"), 0)

    # lifecycle --------------------------------------------------------------------------
    async def start(self) -> str:
        """Start serving pulls; returns this store's RPC endpoint."""
        shm.remove_stale_segments(self.shm_dir)
        for method in ("meta", "pull_value", "pull_shm", "pull_tcp", "pull_cuda_ipc",
                       "pull_nccl", "incref", "decref", "free", "release_holder"):
            self._server.register(method, getattr(self, f"_rpc_{method}"))
        self.endpoint = await self._server.start()
        try:
            self.bulk_addr = await self._bulk.start()
        except BaseException:
            await self._server.close()
            raise
        self._started = True
        self._refill_pool()
        log.info("%s: object store on node %s serving %s (bulk %s)", self.name, self.node_id,
                 self.endpoint, self.bulk_addr)
        return self.endpoint

    async def close(self) -> None:
        """Stop serving, drop every object and unlink every shared-memory segment."""
        try:
            if self._pool_refill is not None:
                self._pool_refill.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._pool_refill
            await self._bulk.close()
            await self._server.close()
            for client in list(self._clients.values()):
                await client.close()
            self._clients.clear()
        finally:
            for entry in self._objects.values():
                if entry.segment is not None:
                    entry.segment.unlink()
            for segment in self._shm_pool:
                segment.unlink()
            self._shm_pool.clear()
            self._objects.clear()
            self._bytes_used = 0
            self._io.shutdown(wait=False, cancel_futures=True)
            self._started = False

    async def __aenter__(self) -> ObjectStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # shared-memory pool ------------------------------------------------------------------
    def _refill_pool(self) -> None:
        if self.shm_pool_bytes <= 0 or self._shm_pool or (
                self._pool_refill is not None and not self._pool_refill.done()):
            return

        def make() -> shm.Segment:
            segment = shm.Segment.create(shm.align_up(self.shm_pool_bytes), "pool", self.shm_dir)
            # A first write still costs a fault per page even after MAP_POPULATE; pay it here.
            segment.view(0, segment.size).zero_()
            return segment

        async def refill() -> None:
            segment = await asyncio.get_running_loop().run_in_executor(self._io, make)
            if self._started:
                self._shm_pool.append(segment)
            else:
                segment.unlink()

        self._pool_refill = asyncio.get_running_loop().create_task(refill())

    async def wait_shm_pool(self) -> None:
        """Wait until the spare shared-memory segment is ready (tests and benchmarks)."""
        if self._pool_refill is not None:
            await self._pool_refill

    async def _new_segment(self, size: int, tag: str) -> shm.Segment:
        for segment in self._shm_pool:
            if segment.size >= size:
                self._shm_pool.remove(segment)
                return segment  # refilled after the copy, so the two don't share the CPU
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, shm.Segment.create, size, tag, self.shm_dir)

    # producing --------------------------------------------------------------------------
    def put(self, value: Any) -> ObjectRef:
        """Store `value` (a tensor, a dict of tensors sharing dim 0, or an msgpack value).

        The store keeps a reference, not a copy: do not modify a tensor after putting it.
        """
        if not self._started:
            raise ObjectStoreError(f"{self.name} is not started; await store.start() first")
        object_id = uuid.uuid4().hex
        common = dict(object_id=object_id, node_id=self.node_id, endpoint=self.endpoint,
                      bulk_addr=self.bulk_addr)
        if isinstance(value, torch.Tensor):
            value = _storable(value)
            nbytes = value.numel() * value.element_size()
            ref = ObjectRef(kind=TENSOR, device=str(value.device), nbytes=nbytes,
                            dtype=dtype_name(value.dtype), shape=tuple(value.shape),
                            num_rows=value.shape[0] if value.dim() else None, **common)
        elif isinstance(value, dict) and value and all(
                isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in value.items()):
            if any(_storable(t) is not t for t in value.values()):
                value = {k: _storable(t) for k, t in value.items()}
            rows = {t.shape[0] if t.dim() else None for t in value.values()}
            devices = {str(t.device) for t in value.values()}
            if len(rows) != 1 or None in rows:
                raise ObjectTypeError(
                    "a batch's tensors must all have at least one dimension and share dim 0 "
                    f"(rows); got shapes { {k: list(t.shape) for k, t in value.items()} }")
            if len(devices) != 1:
                raise ObjectTypeError(f"a batch's tensors must be on one device, got {sorted(devices)}")
            nbytes = sum(t.numel() * t.element_size() for t in value.values())
            ref = ObjectRef(kind=BATCH, device=devices.pop(), nbytes=nbytes,
                            columns=tuple((k, dtype_name(t.dtype), tuple(t.shape))
                                          for k, t in value.items()),
                            num_rows=rows.pop(), **common)
        else:
            try:
                frames = codec.encode(value)
            except Exception as e:
                raise ObjectTypeError(f"cannot store a {type(value).__qualname__}: {e}") from e
            nbytes = sum(memoryview(f).nbytes for f in frames)
            ref = ObjectRef(kind=VALUE, nbytes=nbytes, **common)
        self._reserve(nbytes)
        self._objects[object_id] = _Entry(ref, value)
        self.counters["puts"] += 1
        return ref

    def _reserve(self, nbytes: int) -> None:
        limit = self.memory_limit_bytes
        if limit is not None and self._bytes_used + nbytes > limit:
            raise ObjectStoreFullError(
                f"store {self.name} on {self.node_id} cannot take {nbytes} more bytes: "
                f"{self._bytes_used} of its {limit}-byte memory limit are used by "
                f"{len(self._objects)} objects; free refs you no longer need (free/decref) "
                "or raise memory_limit_bytes")
        self._bytes_used += nbytes

    # reference counting -----------------------------------------------------------------
    def owns(self, ref: ObjectRef) -> bool:
        return ref.endpoint == self.endpoint and ref.object_id in self._objects

    def _drop(self, object_id: str) -> bool:
        entry = self._objects.pop(object_id, None)
        if entry is None:
            return False
        self._bytes_used -= entry.ref.nbytes
        if entry.segment is not None:
            entry.segment.unlink()
        self.counters["frees"] += 1
        return True

    async def free(self, ref: ObjectRef) -> bool:
        """Drop the object now, whatever its counts; False when it was already gone."""
        if ref.endpoint == self.endpoint:
            return self._drop(ref.object_id)
        return await self._call(ref, "free", ref.object_id)

    async def incref(self, ref: ObjectRef) -> None:
        """Hold `ref`: its owner keeps the object until the matching `decref`."""
        if ref.endpoint == self.endpoint:
            self._entry(ref.object_id).local_refs += 1
        else:
            await self._call(ref, "incref", ref.object_id, self.store_id)

    async def decref(self, ref: ObjectRef) -> None:
        """Release one hold on `ref`; the owner frees the object once nobody holds it."""
        if ref.endpoint == self.endpoint:
            entry = self._entry(ref.object_id)
            entry.local_refs -= 1
            self._maybe_drop(entry)
        else:
            await self._call(ref, "decref", ref.object_id, self.store_id)

    def _maybe_drop(self, entry: _Entry) -> None:
        if entry.local_refs <= 0 and not entry.holders:
            self._drop(entry.ref.object_id)

    def _entry(self, object_id: str) -> _Entry:
        entry = self._objects.get(object_id)
        if entry is None:
            raise ObjectNotFoundError(
                f"object {object_id} is not in store {self.name} on {self.node_id}: it was freed "
                "or never existed; keep a reference (incref) until every consumer has pulled it")
        return entry

    def stats(self) -> dict[str, Any]:
        """Objects held, bytes used, the limit, shared memory and transfer counters."""
        segments = [e.segment for e in self._objects.values() if e.segment is not None]
        return {
            "objects": len(self._objects), "bytes": self._bytes_used,
            "limit": self.memory_limit_bytes, "shm_segments": len(segments),
            "shm_bytes": sum(s.size for s in segments),
            "shm_pool_bytes_ready": sum(s.size for s in self._shm_pool),
            "bulk_bytes_sent": self._bulk.stats["bytes_sent"],
            "bulk_rejected": self._bulk.stats["rejected"], **self.counters,
        }

    # consuming --------------------------------------------------------------------------
    async def get(
        self,
        ref: ObjectRef,
        rows: tuple[int, int] | RowRange | None = None,
        *,
        device: str | torch.device | None = None,
        transport: str | None = None,
        dtype: torch.dtype | str | None = None,
        shape: tuple[int, ...] | list[int] | None = None,
    ) -> Any:
        """The object `ref` names, or only its rows [start, stop) when `rows` is given.

        `dtype`/`shape` state what the caller expects (a tensor's full shape; a batch's dtype
        applies to every column) and raise ObjectTypeError on a mismatch before any transfer.
        `transport` forces a path ("shm", "tcp", …); by default locality picks it.
        """
        if not isinstance(ref, ObjectRef):
            raise ObjectTypeError(f"get() takes an ObjectRef, got a {type(ref).__qualname__}")
        rng = self._check_rows(ref, rows)
        _check_expectations(ref, dtype, shape)
        path = self._choose_path(ref, transport or self.default_transport)
        if path == "local":
            entry = self._entry(ref.object_id)
            self.counters["gets_local"] += 1
            return _to_device(_slice(entry.value, ref.kind, rng), ref.kind, device)
        try:
            if ref.kind == VALUE:
                self.counters["pulls_value"] += 1
                return await self._call(ref, "pull_value", ref.object_id)
            pull = {"shm": self._pull_shm, "tcp": self._pull_tcp,
                    "cuda_ipc": self._pull_cuda_ipc, "nccl": self._pull_nccl}[path]
            tensors = await pull(ref, rng)
        except (OSError, EOFError) as e:
            self._forget_client(ref.endpoint)
            raise ObjectLostError.for_owner(ref.object_id, ref.node_id, ref.endpoint, e) from e
        value = tensors[None] if ref.kind == TENSOR else tensors
        return _to_device(value, ref.kind, device)

    def _check_rows(self, ref: ObjectRef, rows: Any) -> RowRange | None:
        if rows is None:
            return None
        if ref.kind == VALUE or ref.num_rows is None:
            raise ShardRangeError(f"object {ref.object_id} is a {ref.kind} without rows; "
                                  "pull it whole (rows=None)")
        try:
            rng = RowRange(*rows)
        except TypeError as e:
            raise ShardRangeError(f"rows must be (start, stop), got {rows!r}") from e
        return rng.check(ref.num_rows, ref.object_id)

    def _choose_path(self, ref: ObjectRef, transport: str) -> str:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if ref.endpoint == self.endpoint:
            return "local"
        if transport != "auto":
            return "tcp" if transport == "local" else transport
        is_cuda = ref.device.startswith("cuda")
        if ref.node_id == self.node_id:
            return "cuda_ipc" if is_cuda else "shm"
        if is_cuda and gpu.nccl_available():
            return "nccl"
        return "tcp"

    def _client(self, endpoint: str) -> RpcClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = RpcClient(endpoint, curve=self.curve, insecure=self.insecure,
                               heartbeat_interval=self.heartbeat_interval,
                               heartbeat_timeout=self.heartbeat_timeout, name=f"{self.name}-pull")
            self._clients[endpoint] = client
        return client

    def _forget_client(self, endpoint: str) -> None:
        client = self._clients.pop(endpoint, None)
        if client is not None:
            asyncio.get_running_loop().create_task(client.close())

    @property
    def bytes_transferred(self) -> tuple[int, int]:
        """RPC bytes (sent, received) by this store's clients: control traffic, not bulk data."""
        sent = sum(c.bytes_transferred[0] for c in self._clients.values())
        return sent, sum(c.bytes_transferred[1] for c in self._clients.values())

    @property
    def bytes_served(self) -> int:
        """Bytes this store has served to others: RPC replies (incl. values), bulk TCP sent, and
        objects written to shared memory for same-node readers."""
        return (self._server.bytes_transferred[0] + self._bulk.stats["bytes_sent"]
                + self.counters["shm_bytes_written"])

    async def _call(self, ref: ObjectRef, method: str, *args: Any, timeout: float | None = None) -> Any:
        try:
            return await self._client(ref.endpoint).call(method, *args, timeout=timeout)
        except RemoteError as e:
            raise from_remote(e) from None
        except (ConnectionLost, RpcTimeout) as e:
            self._forget_client(ref.endpoint)
            raise ObjectLostError.for_owner(ref.object_id, ref.node_id, ref.endpoint, e) from e

    async def _pull_shm(self, ref: ObjectRef, rows: RowRange | None) -> dict[str | None, torch.Tensor]:
        reply = await self._call(ref, "pull_shm", ref.object_id, _wire_rows(rows))
        path = f"{self.shm_dir}/{reply['segment']}"
        out = {}
        for name, offset, nbytes, dt, shp in reply["regions"]:
            buf = await _maybe_thread(self._io, nbytes, shm.map_region, path, offset, nbytes)
            out[name] = _tensor_over(buf, dt, shp)
            self.counters["bytes_mapped_shm"] += nbytes
        self.counters["pulls_shm"] += 1
        return out

    async def _pull_tcp(self, ref: ObjectRef, rows: RowRange | None) -> dict[str | None, torch.Tensor]:
        reply = await self._call(ref, "pull_tcp", ref.object_id, _wire_rows(rows))
        out = {name: torch.empty(tuple(shp), dtype=_dtype(dt)) for name, dt, shp in reply["regions"]}
        dests = [_writable_bytes(t) for t in out.values()]
        loop = asyncio.get_running_loop()
        n = await loop.run_in_executor(self._io, bulk.fetch, ref.bulk_addr, reply["token"], dests,
                                       self.bulk_timeout)
        self.counters["bytes_received_tcp"] += n
        self.counters["pulls_tcp"] += 1
        return out

    async def _pull_cuda_ipc(self, ref: ObjectRef, rows: RowRange | None) -> dict[str | None, torch.Tensor]:
        handles = await self._call(ref, "pull_cuda_ipc", ref.object_id, _wire_rows(rows))
        out = {name: gpu.cuda_ipc_import(h) for name, h in handles}
        self.counters["pulls_cuda_ipc"] += 1
        return out

    async def _pull_nccl(self, ref: ObjectRef, rows: RowRange | None) -> dict[str | None, torch.Tensor]:
        device = torch.device("cuda", torch.cuda.current_device())
        out = {}
        for name, (dt, shp) in ref.tensor_specs().items():
            shp = (rows.num_rows, *shp[1:]) if rows is not None else shp
            out[name] = torch.empty(tuple(shp), dtype=_dtype(dt), device=device)
        uid = gpu.nccl_unique_id()
        loop = asyncio.get_running_loop()
        recv = loop.run_in_executor(self._io, gpu.nccl_recv, uid, list(out.values()))
        await asyncio.gather(self._call(ref, "pull_nccl", ref.object_id, _wire_rows(rows), uid), recv)
        self.counters["bytes_received_gpu"] += ref.row_bytes(rows)
        self.counters["pulls_nccl"] += 1
        return out

    # owner side (RPC handlers) ----------------------------------------------------------
    def _request(self, object_id: Any, rows: Any) -> tuple[_Entry, RowRange | None]:
        if not isinstance(object_id, str):
            raise ObjectNotFoundError(f"bad object id {object_id!r}")
        entry = self._entry(object_id)
        return entry, self._check_rows(entry.ref, rows)

    def _rpc_meta(self, object_id: str) -> ObjectRef:
        return self._entry(object_id).ref

    def _rpc_pull_value(self, object_id: str) -> Any:
        entry = self._entry(object_id)
        if entry.ref.kind != VALUE:
            raise ObjectTypeError(f"object {object_id} is a {entry.ref.kind}; pull it with get()")
        return entry.value

    async def _rpc_pull_shm(self, object_id: str, rows: Any = None) -> dict[str, Any]:
        entry, rng = self._request(object_id, rows)
        if entry.ref.device != "cpu":
            raise ObjectTypeError(f"object {object_id} lives on {entry.ref.device}; pull it with CUDA IPC")
        async with entry.shm_lock:
            if entry.segment is None:
                await self._to_shm(entry)
        if object_id not in self._objects:
            raise ObjectNotFoundError(f"object {object_id} was freed during the pull")
        regions = []
        for name, t in entry.tensors().items():
            rb = _row_bytes(t)
            start, count = (rng.start, rng.num_rows) if rng is not None else (0, t.shape[0] if t.dim() else 1)
            shp = [count, *t.shape[1:]] if t.dim() else []
            regions.append([name, entry.offsets[name] + start * rb,
                            count * rb if t.dim() else t.element_size(), dtype_name(t.dtype), shp])
        return {"segment": entry.segment.name, "regions": regions}

    async def _to_shm(self, entry: _Entry) -> None:
        """Copy the object into a new segment once; its tensors then live there."""
        tensors = entry.tensors()
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        offsets, size = shm.layout(sizes)
        loop = asyncio.get_running_loop()
        segment = await self._new_segment(size, entry.ref.object_id[:8])
        try:
            def copy() -> dict[str | None, torch.Tensor]:
                moved = {}
                for (name, t), off, n in zip(tensors.items(), offsets, sizes, strict=True):
                    dst = segment.view(off, n)
                    if n:
                        dst.copy_(t.reshape(-1).view(torch.uint8))
                    moved[name] = dst.view(t.dtype).view(t.shape) if n else t
                return moved
            moved = await loop.run_in_executor(self._io, copy)
        except BaseException:
            segment.unlink()
            raise
        finally:
            self._refill_pool()
        if entry.ref.object_id not in self._objects:  # freed while we copied
            segment.unlink()
            return
        # The segment now holds the object: drop the private copy so memory is held once.
        entry.value = moved[None] if entry.ref.kind == TENSOR else moved
        entry.segment = segment
        entry.offsets = dict(zip(tensors, offsets, strict=True))
        self.counters["shm_bytes_written"] += sum(sizes)

    def _rpc_pull_tcp(self, object_id: str, rows: Any = None) -> dict[str, Any]:
        entry, rng = self._request(object_id, rows)
        if entry.ref.kind == VALUE:
            raise ObjectTypeError(f"object {object_id} is a value; pull it with get()")
        parts = _slice(entry.value, entry.ref.kind, rng)
        tensors = {None: parts} if entry.ref.kind == TENSOR else parts
        # Host staging for GPU objects when NCCL is not available.
        tensors = {k: t.cpu() for k, t in tensors.items()}
        views = [codec.tensor_bytes(t) for t in tensors.values()]
        token = self._bulk.offer(views)
        return {"token": token,
                "regions": [[k, dtype_name(t.dtype), list(t.shape)] for k, t in tensors.items()]}

    def _rpc_pull_cuda_ipc(self, object_id: str, rows: Any = None) -> list[Any]:
        entry, rng = self._request(object_id, rows)
        if not entry.ref.device.startswith("cuda"):
            raise ObjectTypeError(f"object {object_id} lives on {entry.ref.device}, not a GPU")
        parts = _slice(entry.value, entry.ref.kind, rng)
        tensors = {None: parts} if entry.ref.kind == TENSOR else parts
        return [[k, gpu.cuda_ipc_export(t)] for k, t in tensors.items()]

    async def _rpc_pull_nccl(self, object_id: str, rows: Any, uid: list[int]) -> int:
        entry, rng = self._request(object_id, rows)
        parts = _slice(entry.value, entry.ref.kind, rng)
        tensors = [parts] if entry.ref.kind == TENSOR else list(parts.values())
        tensors = [t.contiguous() for t in tensors]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, gpu.nccl_send, uid, tensors)

    def _rpc_incref(self, object_id: str, holder: str) -> None:
        entry = self._entry(object_id)
        entry.holders[holder] = entry.holders.get(holder, 0) + 1

    def _rpc_decref(self, object_id: str, holder: str) -> None:
        entry = self._entry(object_id)
        count = entry.holders.get(holder, 0) - 1
        if count > 0:
            entry.holders[holder] = count
        else:
            entry.holders.pop(holder, None)
        self._maybe_drop(entry)

    def _rpc_free(self, object_id: str) -> bool:
        return self._drop(object_id)

    def _rpc_release_holder(self, holder: str) -> int:
        """Drop every hold of a store that died (called by whoever noticed it)."""
        released = 0
        for entry in list(self._objects.values()):
            if entry.holders.pop(holder, None) is not None:
                released += 1
                self._maybe_drop(entry)
        return released


def _storable(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it can be stored as is (so a same-process get returns it), else a
    detached contiguous version (pulls send raw bytes, and must not drag autograd along)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _wire_rows(rows: RowRange | None) -> list[int] | None:
    return None if rows is None else [rows.start, rows.stop]


def _dtype(name: str) -> torch.dtype:
    from objectstore.ref import torch_dtype

    return torch_dtype(name)


def _writable_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _tensor_over(buf: memoryview, dt: str, shape: list[int]) -> torch.Tensor:
    dtype = _dtype(dt)
    if buf.nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(tuple(shape))


async def _maybe_thread(executor: ThreadPoolExecutor, nbytes: int, fn: Any, *args: Any) -> Any:
    # mmap is a syscall of a few microseconds; a thread hop costs more for small regions.
    if nbytes < (64 << 20):
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _check_expectations(ref: ObjectRef, dtype: Any, shape: Any) -> None:
    if dtype is not None:
        want = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        have = {dt for dt, _ in ref.tensor_specs().values()} if ref.kind != VALUE else {"value"}
        if have != {want}:
            raise ObjectTypeError(
                f"object {ref.object_id} holds dtype {sorted(have)}, the caller expects {want}; "
                "convert after pulling or fix the producer")
    if shape is not None:
        if ref.kind != TENSOR or tuple(shape) != tuple(ref.shape or ()):
            have = list(ref.shape) if ref.kind == TENSOR else ref.kind
            raise ObjectTypeError(
                f"object {ref.object_id} has shape {have}, the caller expects {list(shape)}")
