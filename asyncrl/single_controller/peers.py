"""`Peers`: the ranks one `group.apply` call runs on, for the few batch-wide numbers a function
over a rank's own rows needs (a whitening mean, a GRPO group's sum, a metric's maximum).

Only scalars and small per-key sums travel, over a gloo group of the worker processes; a call on
one rank (or one process) needs none. Every rank called must make the same calls in the same
order, as with any collective.
"""

from __future__ import annotations

import pickle
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from transport import trace

_GROUP: Any = None  # the all-ranks gloo group, made by the first call that needs it
GATHER_BYTES = 8192  # a gathered value pickled up to this size takes one collective (a GRPO group: ~40 bytes)
_LEN = 8  # the bytes of each rank's size header


class Peers:
    """The ranks (`ranks`) an apply call runs on; this process is `rank` of `world_size`."""

    def __init__(self, ranks: Sequence[int], rank: int, world_size: int) -> None:
        self.ranks, self.rank, self.world_size = list(ranks), rank, world_size
        if self.size > 1 and self.size != world_size:
            raise RuntimeError(f"an apply function with batch-wide sums runs on one rank or on all "
                               f"{world_size}; this call runs on ranks {self.ranks}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def sum(self, values: Tensor) -> Tensor:
        """`values` summed over the ranks, element-wise (float64 on the wire)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Tensor) -> Tensor:
        return self._reduce(values, dist.ReduceOp.MAX)

    def min(self, values: Tensor) -> Tensor:
        return self._reduce(values, dist.ReduceOp.MIN)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (small, picklable: it stays among the job's own processes), in
        rank order: one collective while every rank's pickle fits GATHER_BYTES, else two."""
        if self.size == 1:
            return [value]
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(_LEN + GATHER_BYTES, dtype=torch.uint8)
        head[:_LEN] = torch.frombuffer(bytearray(len(data).to_bytes(_LEN, "little")), dtype=torch.uint8)
        if len(data) <= GATHER_BYTES:
            head[_LEN:_LEN + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with trace.span("all_gather_object", "collective", bytes=len(data)):
            heads = [torch.empty_like(head) for _ in range(self.world_size)]
            dist.all_gather(heads, head, group=_group())
            sizes = [int.from_bytes(h[:_LEN].numpy().tobytes(), "little") for h in heads]
            if max(sizes) <= GATHER_BYTES:
                parts = [h[_LEN:_LEN + n] for h, n in zip(heads, sizes, strict=True)]
            else:  # a rank's value is larger: every rank sees it in the sizes and sends again
                body = torch.zeros(max(sizes), dtype=torch.uint8)
                body[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                bodies = [torch.empty_like(body) for _ in range(self.world_size)]
                dist.all_gather(bodies, body, group=_group())
                parts = [b[:n] for b, n in zip(bodies, sizes, strict=True)]
        return [pickle.loads(p.numpy().tobytes()) for p in parts]

    def all_gather(self, values: Tensor) -> list[Tensor]:
        """Every rank's `values` (the same shape on each; float64 on the wire), in rank order."""
        wire = values.detach().to("cpu", torch.float64).contiguous()
        if self.size == 1:
            return [wire]
        out = [torch.empty_like(wire) for _ in range(self.world_size)]
        with trace.span("all_gather", "collective", values=wire.numel()):
            dist.all_gather(out, wire, group=_group())
        return out

    def sum_by_key(self, keys: Sequence[Hashable], values: Tensor) -> Tensor:
        """Rows of `values` ([len(keys), ...]) summed with the other ranks' rows of the same key,
        in rank order; a key only this rank has keeps its row bit for bit."""
        if self.size == 1:
            return values
        merged: dict[Hashable, Tensor] = {}
        # plain lists travel: a pickled tensor costs a torch.save and a torch.load per rank
        for theirs, rows in self.gather((list(keys), values.cpu().tolist())):
            for key, row in zip(theirs, rows, strict=True):
                row = torch.tensor(row, dtype=values.dtype)
                merged[key] = merged[key] + row if key in merged else row
        return torch.stack([merged[k] for k in keys]).to(values.device) if keys else values

    def _reduce(self, values: Tensor, op: Any) -> Tensor:
        if self.size == 1:
            return values
        wire = values.detach().to("cpu", torch.float64).clone()
        with trace.span("all_reduce", "collective", values=wire.numel()):
            dist.all_reduce(wire, op=op, group=_group())
        return wire.to(values.device, values.dtype)


def open_group() -> None:
    """Make the gloo group the sums use, once, where every rank makes its groups in the same order
    (as the process group comes up): made lazily inside an apply call, the first rank there would
    wait in the group's rendezvous for the last, its heartbeats unanswered."""
    global _GROUP
    if _GROUP is None and dist.is_initialized() and dist.get_world_size() > 1:
        _GROUP = dist.new_group(backend="gloo")


def reset_group() -> None:
    """Forget the group (its process group was destroyed: a pool re-formed after a rank died)."""
    global _GROUP
    _GROUP = None


def _group() -> Any:
    if not dist.is_initialized():
        raise RuntimeError("batch-wide sums over several ranks need the workers' process group; "
                           "this worker class never started one (run the function on one rank: "
                           "protocol=RANK_ZERO)")
    open_group()
    return _GROUP
