"""A trace of the controller and every worker process on one timeline (Chrome trace-event JSON).

`Recording.start(procs)` turns span recording on in this process and in each worker process;
`Recording.write(path)` collects every process's spans, aligns their clocks to the
controller's (the worker clock read with the least round trip of a few pings, taken as read
half-way) and writes a file that ui.perfetto.dev or chrome://tracing open.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transport import trace

PINGS = 5  # clock reads per worker; the one with the shortest round trip is used


class Recording:
    """One recording over the controller and the worker processes of `procs` (ProcessSets)."""

    def __init__(self, procs: Iterable[Any]) -> None:
        seen: dict[str, Any] = {}
        for ps in procs:
            for h in ps.handles:
                seen.setdefault(h.info.worker_id, h)
        self.handles = list(seen.values())

    async def start(self) -> None:
        await asyncio.gather(*(h.call("trace_start") for h in self.handles))
        trace.start()

    async def write(self, path: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Stop recording everywhere and write the trace to `path`; returns a summary
        (events and clock offsets per process)."""
        own = trace.collect()
        offsets = await asyncio.gather(*(_offset_ns(h) for h in self.handles))
        remote = await asyncio.gather(*(h.call("trace_collect") for h in self.handles))
        events: list[dict[str, Any]] = []
        _process(events, 0, f"controller (pid {os.getpid()})", own["events"], 0)
        summary = {"controller": len(own["events"])}
        for pid, (h, off, got) in enumerate(zip(self.handles, offsets, remote, strict=True), start=1):
            name = f"rank {h.rank} {h.info.worker_id} (node {h.info.node_id}, pid {got['pid']})"
            _process(events, pid, name, got["events"], off)
            summary[f"rank {h.rank}"] = len(got["events"])
        events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
        body = {"traceEvents": events, "displayTimeUnit": "ms",
                "metadata": {"clock": "CLOCK_MONOTONIC of the controller", "offsets_ns": offsets, **(meta or {})}}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        await asyncio.to_thread(tmp.write_text, json.dumps(body))
        os.replace(tmp, path)
        return {"path": str(path), "events": summary, "offsets_ns": offsets}


async def _offset_ns(handle: Any) -> int:
    """The worker's clock minus the controller's, from the ping with the shortest round trip."""
    best: tuple[int, int] | None = None
    for _ in range(PINGS):
        t0 = time.monotonic_ns()
        remote = await handle.call("trace_clock")
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, int(remote) - (t0 + t1) // 2)
    return best[1]


def _process(out: list[dict[str, Any]], pid: int, name: str, events: list[list], offset_ns: int) -> None:
    """One process's spans as trace events on the controller's clock (microseconds)."""
    out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
    out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    lanes = set()
    for name_, cat, t0, dur, lane, args in events:
        lanes.add(lane)
        out.append({"name": name_, "cat": cat or "asyncrl", "ph": "X", "pid": pid, "tid": lane,
                    "ts": (t0 - offset_ns) / 1000.0, "dur": dur / 1000.0, "args": args})
    for lane in sorted(lanes):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane, "args": {"name": f"lane {lane}"}})
