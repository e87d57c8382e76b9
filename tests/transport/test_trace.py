"""Spans: free while tracing is off, nested on one lane, concurrent ones on lanes of their own."""

from __future__ import annotations

import asyncio
import threading

from transport import trace


def _by_name(events: list[list]) -> dict[str, list]:
    return {e[0]: e for e in events}


def test_nothing_is_recorded_while_tracing_is_off():
    trace.collect()
    with trace.span("off") as s:
        s.note(bytes=1)
    assert trace.collect()["events"] == []


async def test_nested_spans_share_a_lane_and_concurrent_ones_do_not():
    trace.start()

    async def child(name: str, delay: float) -> None:
        async with trace.span(name):
            await asyncio.sleep(delay)

    with trace.span("parent"):
        with trace.span("inner"):
            pass
        await asyncio.gather(child("a", 0.02), child("b", 0.01))
    out = _by_name(trace.collect()["events"])
    assert out["parent"][4] == out["inner"][4]  # nested: same lane
    assert out["a"][4] != out["b"][4]  # concurrent: one lane each, never overlapping on one
    for lane in {e[4] for e in out.values()}:
        spans = sorted((e[2], e[2] + e[3]) for e in out.values() if e[4] == lane)
        for (_, e0), (s1, e1) in zip(spans, spans[1:], strict=False):
            assert s1 >= e0 or e1 <= e0  # disjoint or nested
    assert out["inner"][2] >= out["parent"][2] and out["inner"][2] + out["inner"][3] <= out["parent"][2] + out["parent"][3]


def test_threads_record_with_their_own_lanes_and_notes():
    trace.start()
    barrier = threading.Barrier(2)

    def work(name: str) -> None:
        with trace.span(name, "compute") as s:
            barrier.wait()
            s.note(rows=3)

    threads = [threading.Thread(target=work, args=(n,)) for n in ("t1", "t2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = trace.collect()
    out = _by_name(got["events"])
    assert out["t1"][4] != out["t2"][4] and out["t1"][5] == {"rows": 3} and out["t1"][1] == "compute"
    assert got["clock_ns"] >= max(e[2] + e[3] for e in got["events"])
