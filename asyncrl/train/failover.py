"""A training rank's state kept twice: by itself and in its ring neighbour's memory.

The building block of failover without a restart (trainer.failover): at the end of each step
every rank of an FSDP2 engine keeps a copy of its training state — its parameter shards, AdamW's
moments and step counts, any frozen shards (a reference policy, LoRA's base), and small extras
(random streams, the lr schedule) — and sends the same to rank (r + 1) % world, which keeps it in
host memory (`ShardMirror.update`). When a rank dies mid-step, every rank builds its engine anew
on a new process group, the survivors load their own copies back and the replacement for rank r
takes r's from that neighbour (`ShardMirror.restore`): the pool is where it was at the kept step,
bit for bit, and the next step runs again. The price: two more copies of a rank's training
state (16 bytes a parameter over the world, with fp32 masters and AdamW) per rank, and sending
one a step (`nbytes`).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.errors import AsyncRLError
from asyncrl.train.common import local_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


class FailoverError(AsyncRLError):
    """The ranks' kept states do not line up: the pool cannot be restored in place."""


def state_tensors(engine: Any) -> list[Tensor]:
    """This rank's training state as local tensors, in a fixed order: each trainable parameter's
    shard, then its AdamW step count and moments (created by the first step)."""
    out = []
    for p in (p for group in engine.optimizer.param_groups for p in group["params"]):
        state = engine.optimizer.state.get(p, {})
        out.append(local_tensor(p.data))
        out += [local_tensor(state[k]) for k in ("step", *MOMENTS) if k in state]
    return out


def frozen_tensors(engine: Any, *others: torch.nn.Module | None) -> list[Tensor]:
    """The local shards of the parameters `engine`'s optimizer does not update (LoRA's base) and
    of `others` (a reference policy): sent once, kept as long as the job runs."""
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    return [local_tensor(p.data) for m in (engine.model, *others) if m is not None for p in m.parameters()
            if id(p) not in trained]


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32)
                      for t in tensors]) if tensors else torch.zeros(0)


class ShardMirror:
    """This rank's state as of the kept step (`own`), and rank (r - 1) % world's (`copy`)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.step: int | None = None  # the steps done when the states were kept
        self.own = self.copy = self.own_frozen = self.copy_frozen = torch.zeros(0)
        self.own_extras: dict[str, Any] = {}
        self.copy_extras: dict[str, Any] = {}
        self.nbytes = 0  # what the last update sent

    @property
    def held_bytes(self) -> int:
        """The memory the two kept states take on this rank."""
        return sum(t.numel() * t.element_size() for t in (self.own, self.copy, self.own_frozen, self.copy_frozen))

    def _peers(self) -> tuple[int, int]:
        return (self.rank + 1) % self.world, (self.rank - 1) % self.world

    def update(self, step: int, state: list[Tensor], frozen: list[Tensor], extras: dict[str, Any]) -> None:
        """Keep this rank's `state` (and `frozen` tensors, the first time) as it is after `step`
        steps, send them to the next rank and keep the previous rank's. Nothing is kept unless
        every transfer completed (a rank dying meanwhile leaves the last kept step). Two
        exchanges with the neighbours (the sizes, then the values) and a one-number all-reduce."""
        mine = _flat(state)
        send_frozen = self.copy_frozen.numel() == 0 and bool(frozen)
        mine_frozen = _flat(frozen) if send_frozen else self.own_frozen
        wire = torch.frombuffer(bytearray(pickle.dumps((step, extras), protocol=pickle.HIGHEST_PROTOCOL)),
                                dtype=torch.uint8)
        head = torch.tensor([mine.numel(), mine_frozen.numel() if send_frozen else 0, wire.numel()])
        (their_head,) = self._swap([head], [torch.empty_like(head)])
        n, n_frozen, n_wire = (int(x) for x in their_head)
        payload = [mine, wire, *([mine_frozen] if send_frozen else [])]
        theirs, their_wire, *their_frozen = self._swap(payload, [torch.empty(n, dtype=mine.dtype),
                                                                 torch.empty(n_wire, dtype=torch.uint8),
                                                                 *([torch.empty(n_frozen)] if n_frozen else [])])
        their_step, their_extras = pickle.loads(their_wire.numpy().tobytes())  # noqa: S301 - the job's own ranks
        if their_step != step:
            raise FailoverError(f"rank {(self.rank - 1) % self.world} kept step {their_step}, this rank {step}: "
                                "the ranks' marks are out of order")
        # every rank's exchanges done before any keeps the new state: a rank lost meanwhile fails this
        # on all the others (its share is missing), so they all keep the step before
        dist.all_reduce(torch.ones(1), group=self.group)
        self.step, self.own, self.copy = step, mine, theirs
        if send_frozen or n_frozen:
            self.own_frozen, self.copy_frozen = mine_frozen, (their_frozen or [self.copy_frozen])[0]
        self.own_extras, self.copy_extras = extras, their_extras
        self.nbytes = sum(t.numel() * t.element_size() for t in payload if t is not wire)  # the extras: ~10 KB

    def _swap(self, mine: list[Tensor], theirs: list[Tensor]) -> list[Tensor]:
        """Send `mine` to the next rank while receiving `theirs` from the previous one."""
        nxt, prev = self._peers()
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in mine]
        ops += [dist.P2POp(dist.irecv, t, prev, self.group) for t in theirs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return theirs

    def restore(self, lost: int, state: list[Tensor], frozen: list[Tensor]) -> tuple[int, dict[str, Any]]:
        """Every rank's `state` and `frozen` tensors (a rebuilt engine's, `prime`d) back to the
        kept step: the survivors' from their own copies, rank `lost`'s from the rank that
        holds its copy. Every rank calls this; returns the step and this rank's extras."""
        table: list[Any] = [None] * self.world
        dist.all_gather_object(table, self.step if self.rank != lost else None, group=self.group)
        steps = {s for r, s in enumerate(table) if r != lost}
        if len(steps) != 1 or None in steps:
            raise FailoverError(f"the surviving ranks kept different steps ({table}); the pool cannot be "
                                "restored in place: restart the job from its last checkpoint")
        step = steps.pop()
        holder = (lost + 1) % self.world
        if self.rank == holder:
            dist.broadcast_object_list([(self.copy.numel(), self.copy_frozen.numel(), self.copy.dtype, self.copy_extras)],
                                       src=holder, group=self.group)
            dist.send(self.copy, lost, group=self.group)
            if self.copy_frozen.numel():
                dist.send(self.copy_frozen, lost, group=self.group)
        else:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=holder, group=self.group)
            if self.rank == lost:
                self._receive(holder, box[0], state, frozen)
        if self.rank != lost:
            _unflatten_into(self.own, state)
            _unflatten_into(self.own_frozen, frozen)
        return step, self.own_extras

    def _receive(self, holder: int, head: tuple, state: list[Tensor], frozen: list[Tensor]) -> None:
        numel, frozen_numel, dtype, extras = head
        want = (sum(t.numel() for t in state), sum(t.numel() for t in frozen))
        if want != (numel, frozen_numel):
            raise FailoverError(f"rank {self.rank}'s rebuilt engine holds {want} state and frozen values; the copy "
                                f"rank {holder} kept has {(numel, frozen_numel)}: the engines were built differently")
        self.own, self.own_frozen = torch.empty(numel, dtype=dtype), torch.empty(frozen_numel)
        dist.recv(self.own, holder, group=self.group)
        if frozen_numel:
            dist.recv(self.own_frozen, holder, group=self.group)
        self.own_extras = extras
        _unflatten_into(self.own, state)
        _unflatten_into(self.own_frozen, frozen)


def _unflatten_into(flat: Tensor, targets: list[Tensor]) -> None:
    at = 0
    with torch.no_grad():
        for t in targets:
            n = t.numel()
            t.copy_(flat[at:at + n].view(t.shape).to(t.dtype))
            at += n


def prime(engine: Any) -> None:
    """Give a fresh engine's AdamW the state tensors one step creates (zeros, step 0), so a
    kept state can be copied into them."""
    opt = engine.optimizer
    for p in (p for group in opt.param_groups for p in group["params"]):
        if p not in opt.state or not opt.state[p]:
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=local_tensor(p.data).device),
                            **{k: torch.zeros_like(p.data) for k in MOMENTS}}
