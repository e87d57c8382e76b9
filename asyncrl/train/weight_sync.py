"""Weights from the training pool to a separate rollout pool (`trainer.placement=split`).

The two pools are separate worker groups with separate torch.distributed worlds. After each
update the training pool's rank 0 broadcasts the full weights, bucketed, over a process group
of its own that spans it and every rollout rank (`WeightBridge`: gloo on CPU, NCCL on GPU) —
the bytes never pass through the driver, which only hands the rendezvous address around.

Both ends walk the same ordered tensor list (`TensorSpec`s from the same architecture's
`named_parameters()`), so buckets line up without any per-bucket header: consecutive tensors
of one dtype until a bucket holds `bucket_bytes`.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


class WeightBridge:
    """One process group over the training pool's rank 0 (bridge rank 0, the source) and the
    rollout pool's ranks (bridge ranks 1..R). Rank 0 opens the rendezvous first (`listen`, whose
    port the driver hands to the others); then every member builds the group at once."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: str | torch.device,
                 timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self.device = torch.device(device)
        self.store = store  # rank 0's listening socket lives as long as the bridge
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            self.group = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))

    @staticmethod
    def listen(size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's rendezvous store on a free port (`store.port`)."""
        return dist.TCPStore("0.0.0.0", 0, size, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    @staticmethod
    def connect(host: str, port: int, size: int, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def _broadcast(self, buf: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([buf], opts).wait()

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
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 - a half-open group on teardown; nothing to keep
            pass


def full_tensors(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    """A training model's parameters as full tensors, one at a time (a DTensor's `full_tensor`
    is a collective over its mesh: every rank of the training pool iterates in step)."""
    for _, p in model.named_parameters():
        data = p.data
        yield data.full_tensor() if hasattr(data, "full_tensor") else data


def bridge_host() -> str:
    """The address rollout ranks reach the training pool's rank 0 at (its pool's master)."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
