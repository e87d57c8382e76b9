"""Training state kept in host memory while it is not needed (`actor.offload`).

`optimizer`: AdamW's moments (and step counts) live in host memory except while the optimizer
steps (or a checkpoint reads them), as verl's optimizer offload does: the update's forward and
backward passes and the rollout run without them on the device. `all`: besides, the weight
shards (and any gradients) of the actor and the reference policy leave the device while the
rollout generates (after the reshard has built the generation weights from them), and come back
before the next pass that needs them: the rollout runs with the device to itself. Tensors keep their identity —
their storages' bytes go to host buffers and the device storages shrink to nothing, then grow back
and take the bytes again — so the optimizer, and everything holding its state, sees the same
objects, bit for bit. Host buffers are kept between steps (pinned once, on a GPU).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from asyncrl.train.common import local_tensor


class HostCopy:
    """Storages moved to host buffers and back (`away`, `back`), bit for bit."""

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self.host: list[torch.UntypedStorage] = []
        self.away_now = False
        self.moved_s = 0.0  # time spent moving, since the last `take_time`

    def away(self, tensors: Iterable[Tensor]) -> int:
        """Copy the tensors' storages into host buffers and free them; returns the bytes moved."""
        if self.away_now:
            return 0
        t0 = time.perf_counter()
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            s = local_tensor(t).untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen[s.data_ptr()] = s
        self.storages = list(seen.values())
        self._fit_host()
        for s, h in zip(self.storages, self.host, strict=True):
            h.copy_(s, non_blocking=s.device.type == "cuda")
        if any(s.device.type == "cuda" for s in self.storages):
            torch.cuda.current_stream().synchronize()
        for s in self.storages:
            s.resize_(0)
        self.away_now = True
        self.moved_s += time.perf_counter() - t0
        return sum(h.nbytes() for h in self.host)

    def back(self) -> None:
        """Grow each storage again and copy its bytes back (the tensors as they were)."""
        if not self.away_now:
            return
        t0 = time.perf_counter()
        for s, h in zip(self.storages, self.host, strict=True):
            s.resize_(h.nbytes())
            s.copy_(h, non_blocking=s.device.type == "cuda")
        self.away_now = False
        self.moved_s += time.perf_counter() - t0

    def _fit_host(self) -> None:
        """Host buffers of the storages' sizes (those of the last move reused when they fit)."""
        sizes = [s.nbytes() for s in self.storages]
        if [h.nbytes() for h in self.host] == sizes:
            return
        pin = any(s.device.type == "cuda" for s in self.storages)
        self.host = [torch.UntypedStorage(n, device="cpu") for n in sizes]
        if pin:
            self.host = [h.pin_memory() for h in self.host]

    def held_bytes(self) -> int:
        return sum(h.nbytes() for h in self.host)


def _storage(t: Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[Tensor]:
    """Every tensor of the optimizers' per-parameter state (moments, step counts)."""
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    yield value


class OptimizerOffload:
    """actor.offload (`mode`) for one engine: the optimizer's state in host memory between its steps
    (`optimizers`: the torch optimizers that hold it, none for a forward-only engine; megatron's
    distributed optimizer wraps one per parameter group), and with `all` its weight shards during
    the rollout (`weights_away`)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], mode: str) -> None:
        self.optimizers = optimizers
        self.enabled, self.weights = mode != "none" and bool(optimizers), mode == "all"
        self.copy = HostCopy()
        self.weight_copy = HostCopy()

    def weights_away(self, params: Iterable[Tensor], keep: Iterable[Tensor] = (), *, copy_kept: bool = False) -> int:
        """The shards of `params` (and their gradients) to host memory, but for storages that
        `keep`'s tensors share (generation weights that are the training shards themselves) —
        or, with `copy_kept` (one buffer holds every weight: megatron's), each such kept tensor
        given its own copy first and the buffer moved; the bytes moved (0 unless `weights`)."""
        if not self.weights:
            return 0
        tensors = [t for p in params for t in (p, getattr(p, "main_grad", None), p.grad) if t is not None]
        keep = list(keep)
        kept = {_storage(t) for t in keep} & {_storage(t) for t in tensors}
        if copy_kept:
            for t in keep:
                if _storage(t) in kept:
                    t.data = t.data.clone()
            kept = set()
        return self.weight_copy.away(t for t in tensors if _storage(t) not in kept)

    def weights_back(self) -> None:
        """The weight shards on the device again, bit for bit."""
        self.weight_copy.back()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The state on the device inside the block (a step, a checkpoint), in host memory after it."""
        self.copy.back()
        try:
            yield
        finally:
            if self.enabled:
                self.copy.away(optimizer_tensors(self.optimizers))

    def metrics(self) -> dict[str, float]:
        """The time spent moving since the last call and the host bytes held."""
        if not self.enabled:
            return {}
        moved = self.copy.moved_s + self.weight_copy.moved_s
        self.copy.moved_s = self.weight_copy.moved_s = 0.0
        held = self.copy.held_bytes() + self.weight_copy.held_bytes()
        return {"perf/offload_s": moved, "perf/offload_host_gib": held / 2**30}
