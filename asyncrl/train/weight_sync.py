"""Weights from the training pool to a separate rollout pool (`trainer.placement=split`).

The two pools are separate worker groups with separate torch.distributed worlds; the bytes
never pass through the driver, which only hands the rendezvous address around.

- **Source-parallel** (a training pool sharded by FSDP alone: every weight a dim-0 shard on a
  1-D mesh): every training rank sends its own shard of every weight over a process group of
  its own with the rollout ranks (`WeightBridge` with `sources=N`: group i = training rank i
  and every rollout rank), all N at once, and each rollout rank receives the shards straight
  into its staging copy. No rank gathers the model, and none sends more than its shard
  (`source_rows` gives each rank's rows, `piece_offsets` where they go).
- **Single source** (tensor or pipeline parallel layouts): every training rank gathers each
  weight in full and rank 0 broadcasts it, bucketed: consecutive tensors of one dtype until a
  bucket holds `bucket_bytes`.

On a node that holds several rollout ranks and no training rank, only one of them (the node's
receiver) is in the bridge groups, and it hands each piece on to the others over a group of that
node's own (`bridge_plan`, `Relay`): one copy of an update crosses the network per node, as
verl's and NeMo-RL's checkpoint engines do it.

Both ends walk the same ordered tensor list (`TensorSpec`s from the same architecture's
`named_parameters()`, or the LoRA adapters'), so pieces and buckets line up without headers.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.train.common import full_tensor
from asyncrl.train.delta import TensorDelta, frame, unframe


class WeightSyncError(RuntimeError):
    """The training and rollout pools disagree on the weights they exchange."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def specs_of(model: torch.nn.Module) -> list[TensorSpec]:
    """The tensors a sync carries, in order: a model's parameters by name (full shapes, also for
    sharded DTensor parameters; a tied weight once)."""
    return [TensorSpec(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]


def digest(specs: list[TensorSpec]) -> str:
    """A short fingerprint of a tensor list, compared by the driver before the first sync."""
    text = ";".join(f"{s.name}:{list(s.shape)}:{s.dtype}" for s in specs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of `specs` grouped into buckets: consecutive tensors of one dtype, closed once
    they hold `bucket_bytes` (a bigger tensor gets a bucket of its own)."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, s in enumerate(specs):
        if not out or s.dtype != dtype or size >= bucket_bytes:
            out.append([])
            size, dtype = 0, s.dtype
        out[-1].append(i)
        size += s.nbytes
    return out


def source_rows(tensors: Iterable[torch.Tensor]) -> list[int] | None:
    """This training rank's rows of each tensor (in sync order) when every one is a DTensor
    sharded on dim 0 over a 1-D mesh (FSDP alone): what a source-parallel sync sends from
    here. None for any other layout (tensor or pipeline parallel): the single-source path."""
    rows = []
    for t in tensors:
        if not hasattr(t, "to_local") or t.device_mesh.ndim != 1 or not t.placements[0].is_shard(0) or t.dim() == 0:
            return None
        rows.append(int(t.to_local().shape[0]))
    return rows


def local_pieces(tensors: Iterable[torch.Tensor], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """This rank's shard of each tensor, in the sync's dtype (no gather)."""
    for t in tensors:
        yield t.to_local().detach().to(dtype).contiguous()


def piece_offsets(specs: list[TensorSpec], rows: list[list[int]]) -> list[list[int]]:
    """Where source i's rows of tensor t start (dim 0): the sources' shards in rank order, as
    FSDP lays them out. Raises WeightSyncError when the rows do not add up to the shapes."""
    if any(len(r) != len(specs) for r in rows):
        raise WeightSyncError(f"the training ranks report shards of {[len(r) for r in rows]} tensors; the sync "
                              f"carries {len(specs)}: both pools must hold the same model")
    offsets = [[0] * len(specs) for _ in rows]
    for t, spec in enumerate(specs):
        at = 0
        for i, r in enumerate(rows):
            offsets[i][t] = at
            at += r[t]
        if at != spec.shape[0]:
            raise WeightSyncError(f"{spec.name}: the training ranks' shards hold {at} rows of {spec.shape[0]}")
    return offsets


@dataclass(frozen=True)
class Relay:
    """A rollout rank's place in its node's relay: the node's group (`key`), this rank in it
    (0: the node's receiver, which takes each update from the training ranks) and its size."""

    key: str
    rank: int
    size: int


def bridge_plan(nodes: list[str], sender_nodes: Collection[str]) -> tuple[list[int], dict[int, Relay]]:
    """Who the training ranks send to, given each rollout rank's node: one rollout rank of each
    node that holds several and no training rank (it relays every update to the others there),
    every rollout rank elsewhere. Returns those receivers (rollout ranks, in bridge order: bridge
    rank 1 + position) and each relayed node's ranks' `Relay`."""
    by_node: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        by_node.setdefault(node, []).append(r)
    receivers, relays = [], {}
    for node, ranks in by_node.items():
        if len(ranks) > 1 and node not in sender_nodes:
            receivers.append(ranks[0])
            relays.update({r: Relay(str(ranks[0]), k, len(ranks)) for k, r in enumerate(ranks)})
        else:
            receivers.extend(ranks)
    return sorted(receivers), relays


def _group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))


class Sending:
    """Broadcasts queued by `WeightBridge.queue_pieces`: their works, the tensors they read
    (kept alive until they finish) and the bytes they carry."""

    def __init__(self) -> None:
        self.works: list[dist.Work] = []
        self.pieces: list[torch.Tensor] = []
        self.nbytes = 0

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.pieces = [], []


class WeightBridge:
    """Process groups from the training pool to the rollout pool's receiving ranks (bridge ranks
    1..size-1): one per source, source i's group holding training rank i as its rank 0 (single
    source: `sources=1`, training rank 0 alone). Training rank 0 opens the rendezvous first
    (`listen`, whose port the driver hands to the others); every member then builds its groups at
    once, the rollout ranks theirs in source order, then a relayed node's ranks their `relay`
    group (a rank its node's receiver relays to has `rank` None: it is in no bridge group)."""

    def __init__(self, store: dist.Store, rank: int | None, size: int, device: str | torch.device,
                 timeout_s: float, sources: int = 1, source: int = 0, relay: Relay | None = None) -> None:
        self.rank, self.size = rank, size  # rank 0 on a training rank (the source `source`)
        self.device = torch.device(device)
        self.store = store  # rank 0's listening socket lives as long as the bridge
        mine = [] if rank is None else [source] if rank == 0 else list(range(sources))
        self.groups = {i: _group(dist.PrefixStore(f"source{i}/", store), rank, size, self.device, timeout_s)
                       for i in mine}
        self.group = self.groups[mine[0]] if mine else None
        self.relay = None if relay is None else _group(dist.PrefixStore(f"relay{relay.key}/", store), relay.rank,
                                                        relay.size, self.device, timeout_s)

    def send_pieces(self, pieces: Iterable[torch.Tensor]) -> int:
        """A training rank: broadcast its shards (in sync order) over its group, all queued at
        once; returns the bytes sent."""
        sending = self.queue_pieces(pieces)
        sending.wait()
        return sending.nbytes

    def queue_pieces(self, pieces: Iterable[torch.Tensor]) -> Sending:
        """`send_pieces` without the wait: the broadcasts run in the background until
        `Sending.wait` (the weights they read must not change before then)."""
        sending = Sending()
        for piece in pieces:
            if piece.shape[0]:  # as the receiver counts: by rows
                piece = piece.to(self.device)
                sending.works.append(self._broadcast_async(self.group, piece))
                sending.pieces.append(piece)
                sending.nbytes += piece.numel() * piece.element_size()
        return sending

    def receive_pieces(self, specs: list[TensorSpec], rows: list[list[int]], into: list[torch.Tensor]) -> int:
        """A rollout rank: every source's shards straight into their rows of `into`, all sources
        at once; returns the bytes received."""
        views = [(i, into[t].narrow(0, starts[t], n))
                 for i, (r, starts) in enumerate(zip(rows, piece_offsets(specs, rows), strict=True))
                 for t, n in enumerate(r) if n]
        self._fill(views)
        return sum(v.numel() * v.element_size() for _, v in views)

    def _fill(self, bufs: list[tuple[int, torch.Tensor]]) -> None:
        """A rollout rank: `bufs` ((source, tensor), in the order every rank walks them) from the
        sources' groups, all at once; on a relayed node each handed on by the node's receiver
        as soon as it holds it."""
        works = [self._broadcast_async(self.groups[i], b) for i, b in bufs] if self.groups else []
        relayed = []
        for k, (_, b) in enumerate(bufs):
            if works:
                works[k].wait()
            if self.relay is not None:
                relayed.append(self._broadcast_async(self.relay, b))
        for w in relayed:
            w.wait()

    def send_deltas(self, deltas: list[TensorDelta]) -> int:
        """A training rank: its shards' deltas (`asyncrl.train.delta`, in sync order, empty
        shards left out) over its group, a header then the payloads; returns the bytes sent."""
        header, payload = frame(deltas)
        self._broadcast(header.to(self.device))
        if payload.numel():
            self._broadcast(payload.to(self.device))
        return header.numel() * 8 + payload.numel()

    def receive_deltas(self, specs: list[TensorSpec], rows: list[list[int]], version: int
                       ) -> tuple[list[list[TensorDelta]], int]:
        """A rollout rank: every source's `send_deltas` (all sources at once), as deltas per
        source for its non-empty shards in order; and the bytes received."""
        shapes = [[(specs[t].name, specs[t].dtype, (n, *specs[t].shape[1:])) for t, n in enumerate(r) if n]
                  for r in rows]
        headers = [torch.empty((len(s), 4), dtype=torch.int64, device=self.device) for s in shapes]
        self._fill(list(enumerate(headers)))
        payloads = [torch.empty(int(h[:, 1].sum()), dtype=torch.uint8, device=self.device) for h in headers]
        self._fill([(i, p) for i, p in enumerate(payloads) if p.numel()])
        received = sum(h.numel() * 8 + p.numel() for h, p in zip(headers, payloads, strict=True))
        return [unframe(h, p, s, version) for h, p, s in zip(headers, payloads, shapes, strict=True)], received

    @staticmethod
    def _broadcast_async(group: dist.ProcessGroup, buf: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return group.broadcast([buf], opts)

    @staticmethod
    def listen(size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's rendezvous store on a free port (`store.port`)."""
        return dist.TCPStore("0.0.0.0", 0, size, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    @staticmethod
    def connect(host: str, port: int, size: int, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def _broadcast(self, buf: torch.Tensor) -> None:
        """`buf` from training rank 0 (the single source) to every rollout rank."""
        if self.rank == 0:
            self._broadcast_async(self.group, buf).wait()
        else:
            self._fill([(0, buf)])

    def send(self, specs: list[TensorSpec], tensors: Iterator[torch.Tensor], bucket_bytes: int) -> int:
        """Broadcast `tensors` (full, in `specs` order, produced lazily so a caller can gather
        one at a time) in buckets; returns the bytes sent."""
        sent = 0
        for idx in buckets(specs, bucket_bytes):
            parts = [next(tensors).detach().to(self.device, specs[i].dtype).reshape(-1) for i in idx]
            buf = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            self._broadcast(buf)
            sent += buf.numel() * buf.element_size()
        return sent

    def receive(self, specs: list[TensorSpec], into: list[torch.Tensor], bucket_bytes: int) -> int:
        """Receive a `send` into `into` (tensors shaped like `specs`); returns the bytes received."""
        received = 0
        for idx in buckets(specs, bucket_bytes):
            total = sum(int(torch.Size(specs[i].shape).numel()) for i in idx)
            buf = torch.empty(total, dtype=specs[idx[0]].dtype, device=self.device)
            self._broadcast(buf)
            offset = 0
            for i in idx:
                n = into[i].numel()
                into[i].copy_(buf[offset:offset + n].view(into[i].shape))
                offset += n
            received += buf.numel() * buf.element_size()
        return received

    def close(self) -> None:
        for group in [*self.groups.values(), *([self.relay] if self.relay is not None else [])]:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - a half-open group on teardown; nothing to keep
                pass


def full_tensors(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    """A training model's parameters as full tensors, one at a time (a DTensor's `full_tensor`
    is a collective over its mesh: every rank of the training pool iterates in step)."""
    for _, p in model.named_parameters():
        data = p.data
        yield full_tensor(data)


def bridge_host() -> str:
    """The address rollout ranks reach the training pool's rank 0 at (its pool's master)."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
