"""`ObjectStore`: one per worker process; holds the objects the process produced and pulls
objects other stores own.

Objects live where they were produced (CPU memory, or GPU memory on a GPU worker). A consumer
pulls straight from the owner, by the cheapest path its locality allows (`objectstore.paths`):

    owner is this store          LocalPath     the object itself (no copy)
    a plain value                InlinePath    inside the RPC reply
    same node, CPU               ShmPath       shared memory, mapped page by page
    same node, GPU               CudaIpcPath   device memory shared, no copy
    other node, CPU              TcpPath       bulk TCP stream, gated by a one-time token
    other node, GPU              NcclPath      NCCL point-to-point (cupy), else TcpPath

The store composes an `ObjectTable` (objects, refcounts, memory), the paths, the RPC server
that serves their owner halves, the bulk TCP server and the shared-memory `SegmentPool`.

`memory_limit_bytes` bounds the host memory of the objects the store owns: a `put` past it raises
`ObjectStoreFullError` naming the biggest objects and their holders (`objectstore.memory` decides
the default that jobs get). The store's shared-memory segments belong to it through a lock file
(`segments.SegmentOwner`), so a sweep by any process removes them once this one is gone, and
never before. A same-node pull that /dev/shm has no room for goes over TCP (`ShmPath`);
`shm_free_bytes` is how free shared memory is measured (tests simulate a small /dev/shm with it).

`shm_pool_bytes` keeps one spare, pre-faulted shared-memory segment of that size ready, so the
first same-node pull of an object up to that size copies into already-faulted pages instead of
paying a page fault per 4 KiB. Its memory cost is `shm_pool_bytes` of /dev/shm (counted against
the machine's RAM, and against a container's shm limit) per store while idle, and up to twice
that while a pull is copying and the spare is being refilled. 0 disables it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from objectstore import segments
from objectstore.errors import ObjectLostError, ObjectStoreError, ObjectTypeError, from_remote
from objectstore.paths import PATHS, PullKind, PullPath
from objectstore.paths import nccl as nccl_path
from objectstore.paths.cuda_ipc import CudaIpcUnavailable
from objectstore.paths.tcp import BulkServer
from objectstore.ref import TENSOR, VALUE, ObjectRef, RowRange
from objectstore.table import Entry, ObjectTable, check_rows, describe
from transport import (
    AuthenticationError,
    ConnectionLost,
    CurveConfig,
    RemoteError,
    RpcClient,
    RpcServer,
    RpcTimeout,
)
from transport.dtypes import dtype_name
from transport.peers import ServerLimits

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "local", "shm", "tcp", "cuda_ipc", "nccl")
# Which path serves a forced `transport=`; "local" names no remote path, so it pulls over TCP.
_FORCED = {"local": PullKind.TCP, "shm": PullKind.SHM, "tcp": PullKind.TCP,
           "cuda_ipc": PullKind.CUDA_IPC, "nccl": PullKind.NCCL}


def default_node_id() -> str:
    """This machine's id: stores with equal node ids pull through shared memory."""
    return socket.gethostname()


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
        limits: ServerLimits | None = None,
        memory_limit_bytes: int | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        bulk_timeout: float = 60.0,
        transport: str = "auto",
        io_threads: int = 4,
        name: str = "store",
        shm_dir: str = segments.SHM_DIR,
        shm_pool_bytes: int = 0,
        shm_free_bytes: Callable[[str], int] = segments.shm_free_bytes,
        host_only: bool = False,
        inline_bytes: int = 0,
    ) -> None:
        """`host_only`: this process never touches a GPU (the driver's store): GPU objects come
        over TCP into host memory, so no CUDA context is created here (seen on an H100: the
        driver's first CUDA IPC pull initialised CUDA on its event loop for over 10 s).
        `inline_bytes`: a host object up to this size travels inside its ref, so readers skip
        the pull (the driver's small prompt batches: a round trip to the driver saved per rank)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self.node_id = node_id or default_node_id()
        self.store_id = f"{name}-{uuid.uuid4().hex[:12]}"  # names this store as a holder of others' objects
        self.name = name
        self.curve, self.insecure = curve, insecure
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.bulk_timeout = bulk_timeout
        self.default_transport = transport
        self.host_only = host_only
        self.inline_bytes = inline_bytes
        self.shm_dir = shm_dir
        self.io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"{name}-io")
        self.table = ObjectTable(name=name, node_id=self.node_id, memory_limit_bytes=memory_limit_bytes,
                                 on_drop=self._forget)
        self.shm_owner = segments.SegmentOwner(shm_dir)
        self.segment_pool = segments.SegmentPool(shm_pool_bytes, self.io, shm_dir, owner=self.shm_owner,
                                                 free_bytes=shm_free_bytes)
        limits = limits or ServerLimits()
        self.bulk = BulkServer(bulk_host, bulk_port, self.io, name=f"{name}-bulk",
                               max_connections_per_peer=limits.max_connections_per_peer)
        self.paths: dict[PullKind, PullPath] = {cls.kind: cls(self) for cls in PATHS}
        self._server = RpcServer(endpoint, curve=curve, insecure=insecure, limits=limits, name=name)
        self.endpoint = ""
        self.bulk_addr = ""
        self._clients: dict[str, RpcClient] = {}
        self._met_before: set[str] = set()  # owners a forgotten client had passed the handshake of
        self._started = False
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets_local", "pulls_shm", "pulls_tcp", "pulls_cuda_ipc", "pulls_nccl",
             "pulls_value", "pulls_inline", "bytes_mapped_shm", "bytes_received_tcp", "bytes_received_gpu",
             "shm_bytes_written"), 0)

    @property
    def memory_limit_bytes(self) -> int | None:
        return self.table.memory_limit_bytes

    @property
    def shm_pool_bytes(self) -> int:
        return self.segment_pool.segment_bytes

    # lifecycle --------------------------------------------------------------------------
    async def start(self) -> str:
        """Start serving pulls; returns this store's RPC endpoint."""
        segments.remove_stale_segments(self.shm_dir)
        self._server.register_object(self.table)
        for path in self.paths.values():
            if path.remote:
                self._server.register_object(path, prefix=f"{path.kind.value}.")
        self.shm_owner.acquire()
        try:
            self.endpoint = await self._server.start()
            try:
                self.bulk_addr = await self.bulk.start()
            except BaseException:
                await self._server.close()
                raise
        except BaseException:
            self.shm_owner.release()
            raise
        self._started = True
        self.segment_pool.start()
        log.info("%s: object store on node %s serving %s (bulk %s)", self.name, self.node_id,
                 self.endpoint, self.bulk_addr)
        return self.endpoint

    async def close(self) -> None:
        """Stop serving, drop every object and unlink every shared-memory segment."""
        try:
            await self.segment_pool.close()
            await self.bulk.close()
            await self._server.close()
            for client in list(self._clients.values()):
                await client.close()
            self._clients.clear()
        finally:
            self.table.drop_all()
            for path in self.paths.values():
                await path.close()
            self.shm_owner.release()  # after the segments: a sweep may then remove any straggler
            self.io.shutdown(wait=False, cancel_futures=True)
            self._started = False

    async def __aenter__(self) -> ObjectStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def wait_shm_pool(self) -> None:
        """Wait until the spare shared-memory segment is ready (tests and benchmarks)."""
        await self.segment_pool.wait()

    def _forget(self, entry: Entry) -> None:
        for path in self.paths.values():
            path.forget(entry)

    # producing --------------------------------------------------------------------------
    def put(self, value: Any, inline: bool | None = None) -> ObjectRef:
        """Store `value` (a tensor, a dict of tensors sharing dim 0, or an msgpack value).

        The store keeps a reference, not a copy: do not modify a tensor after putting it.
        `inline`: whether a host value also travels inside its ref (None: when it is at most
        `inline_bytes`).
        """
        if not self._started:
            raise ObjectStoreError(f"{self.name} is not started; await store.start() first")
        ref, value = describe(value, object_id=uuid.uuid4().hex, node_id=self.node_id,
                              endpoint=self.endpoint, bulk_addr=self.bulk_addr)
        if (ref.nbytes <= self.inline_bytes if inline is None else inline) and ref.device == "cpu":
            ref = dataclasses.replace(ref, inline=value)
        self.table.add(ref, value)
        self.counters["puts"] += 1
        return ref

    # reference counting -----------------------------------------------------------------
    def owns(self, ref: ObjectRef) -> bool:
        return ref.endpoint == self.endpoint and ref.object_id in self.table

    async def free(self, ref: ObjectRef) -> bool:
        """Drop the object now, whatever its counts; False when it was already gone."""
        if ref.endpoint == self.endpoint:
            return self.table.drop(ref.object_id)
        return await self.call_owner(ref, "free", ref.object_id)

    async def free_many(self, refs: list[ObjectRef]) -> int:
        """`free` every ref, one call per owner; how many objects were still there (an owner
        that is gone counts none)."""
        by_owner: dict[str, list[ObjectRef]] = {}
        for ref in refs:
            by_owner.setdefault(ref.endpoint, []).append(ref)

        async def owner(endpoint: str, owned: list[ObjectRef]) -> int:
            if endpoint == self.endpoint:
                return sum(self.table.drop(r.object_id) for r in owned)
            try:
                return await self.call_owner(owned[0], "free_many", [r.object_id for r in owned])
            except ObjectLostError:
                return 0
        return sum(await asyncio.gather(*(owner(e, owned) for e, owned in by_owner.items())))

    async def incref(self, ref: ObjectRef) -> None:
        """Hold `ref`: its owner keeps the object until the matching `decref`."""
        if ref.endpoint == self.endpoint:
            self.table.add_local_ref(ref.object_id)
        else:
            await self.call_owner(ref, "incref", ref.object_id, self.store_id)

    async def decref(self, ref: ObjectRef) -> None:
        """Release one hold on `ref`; the owner frees the object once nobody holds it."""
        if ref.endpoint == self.endpoint:
            self.table.release_local_ref(ref.object_id)
        else:
            await self.call_owner(ref, "decref", ref.object_id, self.store_id)

    def stats(self) -> dict[str, Any]:
        """Objects held, bytes used, the limit, shared memory and transfer counters."""
        out = {"objects": len(self.table), "bytes": self.table.bytes_used,
               "host_bytes": self.table.host_bytes_used, "limit": self.table.memory_limit_bytes,
               "shm_owner": self.shm_owner.token, "shm_segments": 0, "shm_bytes": 0,
               "shm_pool_bytes_ready": self.segment_pool.bytes_ready,
               "bulk_bytes_sent": self.bulk.stats["bytes_sent"],
               "bulk_rejected": self.bulk.stats["rejected"], **self.counters,
               "frees": self.table.frees}
        for path in self.paths.values():
            out.update(path.stats())
        return out

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
        view: bool = False,
    ) -> Any:
        """The object `ref` names, or only its rows [start, stop) when `rows` is given.

        `dtype`/`shape` state what the caller expects (a tensor's full shape; a batch's dtype
        applies to every column) and raise ObjectTypeError on a mismatch before any transfer.
        `transport` forces a path ("shm", "tcp", …); by default locality picks it. A GPU
        object from the same node is a copy on this process's device unless `view=True`, which
        maps the owner's memory (read it only: a write would change the owner's object).
        """
        if not isinstance(ref, ObjectRef):
            raise ObjectTypeError(f"get() takes an ObjectRef, got a {type(ref).__qualname__}")
        rng = check_rows(ref, rows)
        _check_expectations(ref, dtype, shape)
        if ref.inline is not None and ref.endpoint != self.endpoint and transport is None:
            value = ref.inline_rows(rng)
            if value is not None:
                self.counters["pulls_inline"] += 1
                return value if ref.kind == VALUE else _to_device(value, device)
        kind = self.choose_path(ref, transport or self.default_transport)
        path = self.paths[kind]
        try:
            try:
                pulled = await (path.fetch(ref, rng, view=view) if kind == PullKind.CUDA_IPC else path.fetch(ref, rng))
            except (CudaIpcUnavailable, nccl_path.NcclUnavailable) as e:
                # each path remembers its failure (IPC for the node, NCCL for this owner)
                log.warning("%s: %s from %s failed (%s); those GPU objects come over TCP from now on",
                            self.name, kind.name, ref.endpoint, e)
                kind, pulled = PullKind.TCP, await self.paths[PullKind.TCP].fetch(ref, rng)
        except (OSError, EOFError) as e:
            self._forget_client(ref.endpoint)
            raise ObjectLostError.for_owner(ref.object_id, ref.node_id, ref.endpoint, e) from e
        if ref.kind == VALUE:
            return pulled
        value = pulled[None] if ref.kind == TENSOR else pulled
        if (device is None and kind == PullKind.TCP and ref.device.startswith("cuda") and not self.host_only
                and torch.cuda.is_available()):
            device = torch.device("cuda", torch.cuda.current_device())  # a GPU object stays on a GPU
        return _to_device(value, device)

    def choose_path(self, ref: ObjectRef, transport: str = "auto") -> PullKind:
        """The path a pull of `ref` takes: forced by `transport`, else by locality and device."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if ref.endpoint == self.endpoint:
            return PullKind.LOCAL
        if ref.kind == VALUE:
            return PullKind.INLINE
        is_cuda = ref.device.startswith("cuda")
        if is_cuda and self.host_only:  # even when a GPU path is asked for: never a CUDA context here
            return PullKind.TCP
        if transport != "auto":
            return _FORCED[transport]
        if ref.node_id == self.node_id:
            if is_cuda:  # no peer access (or IPC failed before): through host memory
                return PullKind.CUDA_IPC if self.paths[PullKind.CUDA_IPC].usable(ref) else PullKind.TCP
            return PullKind.SHM
        if is_cuda and self.paths[PullKind.NCCL].usable(ref):
            return PullKind.NCCL
        return PullKind.TCP

    # talking to owners ------------------------------------------------------------------
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
        if client is not None and client.authenticated_once:
            self._met_before.add(endpoint)
        if client is not None:
            asyncio.get_running_loop().create_task(client.close())

    @property
    def bytes_transferred(self) -> tuple[int, int]:
        """RPC bytes (sent, received) by this store's clients: control traffic, not bulk data."""
        sent = sum(c.bytes_transferred[0] for c in self._clients.values())
        return sent, sum(c.bytes_transferred[1] for c in self._clients.values())

    @property
    def bytes_served(self) -> int:
        """Bytes this store has served to others: RPC replies (values included), bulk TCP sent, and
        objects written to shared memory for same-node readers."""
        return (self._server.bytes_transferred[0] + self.bulk.stats["bytes_sent"]
                + self.counters["shm_bytes_written"])

    async def call_owner(self, ref: ObjectRef, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call `method` on the store that owns `ref`; typed errors come back typed, a dead
        owner is ObjectLostError."""
        client = self._client(ref.endpoint)
        try:
            return await client.call(method, *args, timeout=timeout)
        except RemoteError as e:
            raise from_remote(e) from None
        except (ConnectionLost, RpcTimeout) as e:
            self._forget_client(ref.endpoint)
            raise ObjectLostError.for_owner(ref.object_id, ref.node_id, ref.endpoint, e) from e
        except AuthenticationError as e:
            if not client.authenticated_once and ref.endpoint not in self._met_before:  # first contact: keys
                raise
            # an owner that accepted our keys before and now drops the handshake has gone away
            # (killed, its address reached something else): its objects are lost
            self._forget_client(ref.endpoint)
            raise ObjectLostError.for_owner(ref.object_id, ref.node_id, ref.endpoint, e) from e


def _to_device(value: Any, device: str | torch.device | None) -> Any:
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return {k: t.to(device) for k, t in value.items()}


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
