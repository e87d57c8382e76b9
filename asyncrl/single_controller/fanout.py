"""A group call's replies, gathered as they come (used by `WorkerGroup._fan_out`).

`Gather` is the fast path when every rank is reachable: no future, timer or callback per rank.
Each request goes out with `RpcClient.send_to`, which hands the reply straight to `reply` as it
is read; one deadline covers all ranks. Once a rank fails, the ranks become futures (the answered
ones done, the others completing as their replies come), which the error path reads as it reads
`Replies`' per-rank futures: a death explained, the others awaited before the pool's next call.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemons.worker_client import WorkerHandle
from transport import RpcTimeout


class Gather:
    """Replies of the requests {rank: (request id, frames)} sent to `handles[rank]`."""

    __slots__ = ("handles", "ids", "waiting", "replies", "futures", "all_in_or_failed", "deadline", "timer")

    def __init__(self, handles: list[WorkerHandle], requests: dict[int, tuple[int, list]],
                 deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        self.handles = handles
        self.ids = {r: req_id for r, (req_id, _) in requests.items()}
        self.waiting = set(requests)
        self.replies: dict[int, Any] = {}
        self.futures: dict[int, asyncio.Future] | None = None  # set once a rank failed
        self.all_in_or_failed = loop.create_future()
        self.deadline = deadline
        self.timer = loop.call_later(deadline, self._expire) if deadline and requests else None
        if not requests:
            self.all_in_or_failed.set_result(None)
        for r, (req_id, frames) in requests.items():
            try:
                handles[r].client.send_to(req_id, frames, self, r, "call_instance")
            except Exception as e:  # noqa: BLE001 - a closed or unauthenticated client: this rank's failure
                self.fail(r, e)

    def reply(self, rank: int, value: Any) -> None:
        """A rank's reply: its refs noted in the coordinator's directory at once."""
        if rank not in self.waiting:
            return
        self.waiting.discard(rank)
        handle = self.handles[rank]
        handle.coordinator.note_refs(value, handle.info)
        if self.futures is None:
            self.replies[rank] = value
        else:
            self.futures[rank].set_result(value)
        self._settle()

    def fail(self, rank: int, exc: BaseException) -> None:
        if rank not in self.waiting:
            return
        self.waiting.discard(rank)
        if self.futures is None:
            loop = asyncio.get_running_loop()
            self.futures = {r: loop.create_future() for r in self.ids}
            for r, value in self.replies.items():
                self.futures[r].set_result(value)
        self.futures[rank].set_exception(exc)
        if not self.all_in_or_failed.done():
            self.all_in_or_failed.set_result(None)
        self._settle()

    def _settle(self) -> None:
        if self.waiting:
            return
        if self.timer is not None:
            self.timer.cancel()
        if not self.all_in_or_failed.done():
            self.all_in_or_failed.set_result(None)

    def _expire(self) -> None:
        """The deadline passed: every rank still running is told to cancel and fails late."""
        for r in sorted(self.waiting):
            client = self.handles[r].client
            if client.withdraw(self.ids[r]):
                self.fail(r, RpcTimeout(f"call_instance on {client.endpoint} did not answer within {self.deadline}s"))

    def cancel(self) -> None:
        """The caller was cancelled: the ranks still running are told to cancel."""
        if self.timer is not None:
            self.timer.cancel()
        for r in list(self.waiting):
            self.handles[r].client.withdraw(self.ids[r])
            self.waiting.discard(r)
            if self.futures is not None:
                self.futures[r].cancel()


class Replies:
    """A group call's per-rank futures (the path when a rank must be checked first: dead or
    disconnected), one callback per rank: each success's refs noted in the coordinator's
    directory as it arrives (`handle` None: noted by the caller), `all_in_or_failed` set when
    every rank answered or one raised."""

    __slots__ = ("left", "all_in_or_failed")

    def __init__(self, count: int) -> None:
        self.left = count
        self.all_in_or_failed = asyncio.get_running_loop().create_future()
        if not count:
            self.all_in_or_failed.set_result(None)

    def arrived(self, handle: WorkerHandle | None, fut: asyncio.Future) -> None:
        self.left -= 1
        failed = not fut.cancelled() and fut.exception() is not None
        if not fut.cancelled() and not failed and handle is not None:
            handle.coordinator.note_refs(fut.result(), handle.info)
        if (failed or not self.left) and not self.all_in_or_failed.done():
            self.all_in_or_failed.set_result(None)
