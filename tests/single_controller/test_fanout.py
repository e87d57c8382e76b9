"""A group call's fast path (asyncrl/single_controller/fanout.py: no future per rank) against fake
clients: replies gathered with their refs noted, a failure turning the ranks into futures that
still complete, one deadline withdrawing the late ranks, a cancelled call withdrawing the rest."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.single_controller.fanout import Gather
from transport import RemoteError, RpcTimeout


class FakeClient:
    """What Gather needs of an RpcClient: send_to records, withdraw tells whether it was waited for."""

    def __init__(self, rank: int) -> None:
        self.endpoint, self.waiting, self.withdrawn = f"ipc://rank{rank}", {}, []

    def send_to(self, req_id, frames, sink, key, method="") -> None:
        self.waiting[req_id] = (sink, key)
        self.method = method

    def withdraw(self, req_id: int) -> bool:
        self.withdrawn.append(req_id)
        return self.waiting.pop(req_id, None) is not None

    def answer(self, value) -> None:
        (sink, key), = self.waiting.values()
        self.waiting.clear()
        sink.reply(key, value)

    def error(self, exc) -> None:
        (sink, key), = self.waiting.values()
        self.waiting.clear()
        sink.fail(key, exc)


def _handles(n: int):
    noted = []
    coordinator = SimpleNamespace(note_refs=lambda value, info: noted.append((info, value)))
    return [SimpleNamespace(client=FakeClient(r), coordinator=coordinator, info=f"w{r}") for r in range(n)], noted


def _requests(n: int) -> dict[int, tuple[int, list]]:
    return {r: (100 + r, [b"request"]) for r in range(n)}


async def test_every_reply_gathered_with_its_refs_noted():
    handles, noted = _handles(3)
    gather = Gather(handles, _requests(3), deadline=30)
    for r in (2, 0, 1):
        assert not gather.all_in_or_failed.done()
        handles[r].client.answer([f"out{r}", None, []])
    await asyncio.wait_for(gather.all_in_or_failed, 1)
    assert gather.futures is None and gather.replies == {r: [f"out{r}", None, []] for r in range(3)}
    assert [info for info, _ in noted] == ["w2", "w0", "w1"] and gather.timer.cancelled()


async def test_a_failure_turns_the_ranks_into_futures_that_still_complete():
    handles, noted = _handles(3)
    gather = Gather(handles, _requests(3), deadline=None)
    handles[0].client.answer(["a", None, []])
    handles[1].client.error(RemoteError("ValueError", "bad input"))
    await asyncio.wait_for(gather.all_in_or_failed, 1)
    futures = gather.futures
    assert futures[0].result() == ["a", None, []] and isinstance(futures[1].exception(), RemoteError)
    assert not futures[2].done()  # still running: the pool's next call waits for it
    handles[2].client.answer(["c", None, []])
    assert futures[2].result() == ["c", None, []] and [i for i, _ in noted] == ["w0", "w2"]


async def test_one_deadline_withdraws_the_late_ranks():
    handles, _ = _handles(3)
    gather = Gather(handles, _requests(3), deadline=0.2)
    handles[1].client.answer(["b", None, []])
    await asyncio.wait_for(gather.all_in_or_failed, 2)
    assert handles[0].client.withdrawn == [100] and handles[2].client.withdrawn == [102]
    assert handles[1].client.withdrawn == []
    for r in (0, 2):
        with pytest.raises(RpcTimeout, match=f"rank{r} did not answer within 0.2s"):
            gather.futures[r].result()


async def test_a_cancelled_call_withdraws_what_is_still_running():
    handles, _ = _handles(2)
    gather = Gather(handles, _requests(2), deadline=30)
    handles[0].client.answer(["a", None, []])
    gather.cancel()
    assert handles[1].client.withdrawn == [101] and handles[0].client.withdrawn == []
    assert gather.timer.cancelled() and not gather.waiting


async def test_a_rank_whose_send_fails_fails_the_call():
    handles, _ = _handles(2)

    def closed(*args):
        raise ConnectionError("client for ipc://rank1 is closed")

    handles[1].client.send_to = closed
    gather = Gather(handles, _requests(2), deadline=None)
    await asyncio.wait_for(gather.all_in_or_failed, 1)
    assert isinstance(gather.futures[1].exception(), ConnectionError) and not gather.futures[0].done()
