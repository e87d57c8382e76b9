"""Pipelined calls: a LOCAL_ROWS call whose batch arguments are the pending outputs of the
previous calls on the same processes is sent at once, before the driver has those replies.

Every ordered call carries its number on its processes (`seq`). Such a call's batch argument
travels as `Promised(seqs)`: "the union of this rank's own outputs of calls `seqs`", which a rank
resolves from its `CallOutputs` once those calls ended there. That is exactly the rank's part of
the collected result when the producing calls' outputs stay on their ranks (`Protocol.stays_local`,
checked by the driver before it sends), so the rows each rank works on are the ones LOCAL_ROWS
would have sent it. The driver still collects every reply and plans the result as before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from asyncrl.errors import AsyncRLError
from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.tree import tree_map_async
from transport.codec import register_type
from transport.errors import CodecError
from transport.wire import Ext

KEPT_OUTPUTS = 16  # a rank keeps its last calls' outputs (refs, not rows) for calls sent ahead


class PipelineError(AsyncRLError):
    """A pipelined call's input is not this rank's to give (a driver/worker mismatch, not a user error)."""


@dataclass(frozen=True, slots=True)
class Promised:
    """The union of this rank's outputs of the calls numbered `seqs` on its processes."""

    seqs: tuple[int, ...]


def _promised_from_wire(v: Any) -> Promised:
    if not isinstance(v, list) or not v or not all(isinstance(s, int) and not isinstance(s, bool) for s in v):
        raise CodecError(f"a promised input names call numbers, got {v!r}")
    return Promised(tuple(v))


register_type(Promised, int(Ext.PROMISED), lambda p: list(p.seqs), _promised_from_wire)


class CallOutputs:
    """A worker process's recent call outputs by number, for calls sent before they ended.

    Calls may begin here out of their numbers' order (a call sent ahead begins at once, the call
    it reads may still wait behind another), so what is no longer held is told by the numbers
    dropped (`floor`), not by the highest begun."""

    def __init__(self, keep: int = KEPT_OUTPUTS) -> None:
        self.keep = keep
        self.outputs: dict[int, asyncio.Future] = {}
        self.floor = -1  # the highest number dropped to keep `keep`: at or below it, nothing is held

    def _future(self, seq: int) -> asyncio.Future:
        fut = self.outputs.get(seq)
        if fut is None:
            if seq <= self.floor:
                raise PipelineError(f"the output of call #{seq} is no longer held on this rank "
                                    f"(it keeps the last {self.keep})")
            fut = self.outputs[seq] = asyncio.get_running_loop().create_future()
            while len(self.outputs) > self.keep:
                oldest = min(self.outputs)
                del self.outputs[oldest]
                self.floor = max(self.floor, oldest)
        return fut

    def begin(self, seq: int) -> None:
        self._future(seq)

    def ended(self, seq: int, output: Any = None, error: BaseException | None = None) -> None:
        fut = self.outputs.get(seq)
        if fut is None or fut.done():
            return
        if error is not None:
            fut.set_exception(PipelineError(f"call #{seq}, whose output this call takes, failed on this "
                                            f"rank: {type(error).__name__}: {error}"))
            fut.exception()  # retrieved: the call's own error is reported by its reply
        else:
            fut.set_result(output)

    async def wait_ended(self, seq: int) -> None:
        """Until call `seq` ended here; a PipelineError if it failed (what was sent behind it
        does not run: its ranks could otherwise meet in different collectives)."""
        if seq not in self.outputs and seq <= self.floor:
            return  # dropped: begun more than `keep` calls ago, long ended
        try:
            await self._future(seq)
        except PipelineError as e:
            raise PipelineError(f"not run: it was sent behind call #{seq}, which did not end well on this "
                                f"rank ({e})") from None

    async def resolve(self, value: Any, endpoint: str) -> Any:
        """`value` with each `Promised` replaced by the union of this rank's outputs it names
        (waited for), which must all be stored here (`endpoint`)."""
        async def one(p: Promised) -> DistBatch:
            parts = [await self._future(s) for s in p.seqs]
            if not all(isinstance(b, DistBatch) for b in parts):
                raise PipelineError(f"calls {list(p.seqs)} did not all return a batch here: "
                                    f"{[type(b).__name__ for b in parts]}")
            out = parts[0]
            for b in parts[1:]:
                out = out.union(b)
            foreign = sorted({r.endpoint for r in out.refs().values()} - {endpoint})
            if foreign:
                raise PipelineError(f"calls {list(p.seqs)} returned rows held in other stores ({foreign}); "
                                    "a call sent ahead takes only rows this rank holds")
            return out
        return await tree_map_async(one, value, Promised)
