"""A training rank's state kept twice: its own shards and a copy in its ring neighbour's memory.

The building block of failover without a restart (issue 61): after each optimizer step every
rank of an FSDP2 engine sends its training state — its parameter shards, AdamW's moments and
step counts, the lr schedule's position — to rank (r + 1) % world, which keeps it in host memory
(`ShardMirror.update`). A replacement for a lost rank r (an engine of the same layout, its
parameters anything) takes rank r's state back from that neighbour (`ShardMirror.restore`) and
continues where the lost rank was, bit for bit. The price: one more copy of a rank's training
state (16 bytes a parameter over the world, with fp32 masters and AdamW) per rank, and sending it
once a step (`nbytes`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(engine: Any) -> list[Tensor]:
    """This rank's training state as local tensors, in a fixed order: each trainable parameter's
    shard, then its AdamW step count and moments (created by the first step)."""
    out = []
    for p in engine.optimizer.param_groups[0]["params"]:
        state = engine.optimizer.state.get(p, {})
        out.append(_local(p.data))
        out += [_local(state[k]) for k in ("step", *MOMENTS) if k in state]
    return out


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32)
                      for t in tensors]) if tensors else torch.zeros(0)


class ShardMirror:
    """Rank r's training state held by rank (r + 1) % world, refreshed by `update` after each step."""

    def __init__(self, engine: Any, group: dist.ProcessGroup | None = None) -> None:
        if engine.optimizer is None:
            raise ValueError("a mirror keeps training state: this engine has no optimizer")
        self.engine, self.group = engine, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.copy: Tensor | None = None  # the previous rank's state, flat
        self.scheduler: dict[str, Any] | None = None
        self.nbytes = 0  # what one update sent (and what the copy holds)

    def _peers(self) -> tuple[int, int]:
        return (self.rank + 1) % self.world, (self.rank - 1) % self.world

    def update(self) -> None:
        """Send this rank's state to the next rank and keep the previous rank's."""
        mine = _flat(state_tensors(self.engine))
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([mine.numel()]), group=self.group)
        nxt, prev = self._peers()
        theirs = torch.empty(int(sizes[prev]), dtype=mine.dtype)
        ops = [dist.P2POp(dist.isend, mine, nxt, self.group), dist.P2POp(dist.irecv, theirs, prev, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.copy, self.nbytes = theirs, mine.numel() * mine.element_size()
        self.scheduler = self.engine.scheduler.state_dict() if self.engine.scheduler is not None else None

    def restore(self, lost: int) -> None:
        """Rank `lost`'s state from the rank that holds it, into `lost`'s engine (every rank calls
        this; the others only send or wait). `lost`'s engine must have taken one optimizer step's
        shape of state (`prime`) so that its tensors line up."""
        holder = (lost + 1) % self.world
        if self.rank == holder:
            dist.send(self.copy, lost, group=self.group)
            dist.broadcast_object_list([self.scheduler], src=holder, group=self.group)
        elif self.rank == lost:
            target = state_tensors(self.engine)
            flat = torch.empty(sum(t.numel() for t in target), dtype=_flat(target[:1]).dtype)
            dist.recv(flat, holder, group=self.group)
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=holder, group=self.group)
            _unflatten_into(flat, target)
            if box[0] is not None and self.engine.scheduler is not None:
                self.engine.scheduler.load_state_dict(box[0])
        else:
            dist.broadcast_object_list([None], src=holder, group=self.group)


def _unflatten_into(flat: Tensor, targets: list[Tensor]) -> None:
    at = 0
    with torch.no_grad():
        for t in targets:
            n = t.numel()
            t.copy_(flat[at:at + n].view(t.shape).to(t.dtype))
            at += n


def prime(engine: Any) -> None:
    """Give a fresh engine's AdamW the state tensors one step creates (zeros, step 0), so a
    mirrored state can be copied into them."""
    opt = engine.optimizer
    for p in opt.param_groups[0]["params"]:
        if p not in opt.state or not opt.state[p]:
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=_local(p.data).device),
                            **{k: torch.zeros_like(p.data) for k in MOMENTS}}
