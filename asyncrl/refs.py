"""Driver-side reference counting for `DistBatch`es: a stored object is freed once no live
tracked DistBatch names it. A `JobContext` owns one `RefTracker`; nothing here is global."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import TYPE_CHECKING

from objectstore import ObjectRef, ObjectStore

if TYPE_CHECKING:
    from asyncrl.distbatch import DistBatch

log = logging.getLogger(__name__)


class RefTracker:
    """Counts, per stored object, the live DistBatches tracked here that name it; frees the
    object through `store` (the driver's, which reaches every owner) when the count drops to 0."""

    def __init__(self, store: ObjectStore, loop: asyncio.AbstractEventLoop) -> None:
        self.store, self.loop = store, loop
        self.counts: dict[str, int] = {}
        self.refs: dict[str, ObjectRef] = {}
        self.lock = threading.Lock()  # finalizers run on whichever thread drops the last reference
        self.freed = 0
        self.closed = False

    def track(self, d: DistBatch) -> DistBatch:
        """Count `d`'s refs until it dies; `d` then carries this tracker (and so does all that
        is derived from it)."""
        if d.tracker is self:
            return d
        if d.tracker is not None:
            raise ValueError("this DistBatch is tracked by another JobContext already")
        d.tracker = self
        refs = d.refs()
        with self.lock:
            for oid, ref in refs.items():
                self.counts[oid] = self.counts.get(oid, 0) + 1
                self.refs[oid] = ref
        weakref.finalize(d, self.release, list(refs))
        return d

    def release(self, object_ids: list[str]) -> None:
        dead = []
        with self.lock:
            for oid in object_ids:
                left = self.counts.get(oid, 0) - 1
                if left > 0:
                    self.counts[oid] = left
                elif oid in self.refs:
                    self.counts.pop(oid, None)
                    dead.append(self.refs.pop(oid))
        if dead and not self.closed and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._free_soon, dead)

    def _free_soon(self, refs: list[ObjectRef]) -> None:
        async def free() -> None:
            for ref in refs:
                try:
                    await self.store.free(ref)
                    self.freed += 1
                except Exception as e:  # the owner may be gone already: nothing left to free
                    log.debug("free %s: %s", ref.object_id, e)
        if not self.closed:
            self.loop.create_task(free())

    def close(self) -> None:
        """Stop freeing (the job is over; the stores go with their workers)."""
        self.closed = True

    @property
    def live(self) -> int:
        return len(self.counts)
