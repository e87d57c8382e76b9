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


def render_png(trace_path: Path, png_path: Path) -> None:
    """A picture of a trace file for the docs: a band per process lane, nested spans stacked
    inside it, coloured by category. Open the JSON in a trace viewer for the real thing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    body = json.loads(Path(trace_path).read_text())
    events = body["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))
    t0 = min(e["ts"] for e in spans)
    total = max(e["ts"] + e["dur"] for e in spans) - t0
    depth: dict[int, int] = {}
    stacks: dict[tuple[int, int], list[float]] = {}
    for i, e in enumerate(spans):  # nesting depth within its lane
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= e["ts"] + 1e-3:
            stack.pop()
        depth[i] = len(stack)
        stack.append(e["ts"] + e["dur"])
    lanes = sorted(stacks)
    levels = {lane: 1 + max(depth[i] for i, e in enumerate(spans) if (e["pid"], e["tid"]) == lane) for lane in lanes}
    base, y = {}, 0.0
    for lane in lanes:
        base[lane], y = y, y + levels[lane] + 0.6
    colours = {"step": "#bbbbbb", "call": "#4c72b0", "method": "#55a868", "compute": "#8172b2", "store": "#dd8452",
               "collective": "#c44e52", "sync": "#937860", "bookkeeping": "#8c8c8c"}
    fig, ax = plt.subplots(figsize=(15, 0.32 * y + 1.4))
    for i, e in enumerate(spans):
        row = base[(e["pid"], e["tid"])] + depth[i]
        ax.barh(row, e["dur"] / 1000, left=(e["ts"] - t0) / 1000, height=0.9, color=colours.get(e["cat"], "#999999"),
                edgecolor="white", linewidth=0.3)
        if e["dur"] > 0.0042 * total * (len(e["name"]) + 2):  # where the label fits its bar
            ax.text((e["ts"] - t0 + 0.004 * total) / 1000, row, e["name"], va="center", fontsize=6, clip_on=True)
    ax.set_yticks([base[lane] for lane in lanes],
                  [f"{names[p].split(' (')[0]} · lane {t}" for p, t in lanes], fontsize=7)
    ax.set_ylim(y - 0.4, -0.8)
    ax.set_xlim(0, total / 1000 * 1.01)
    ax.set_xlabel("ms since the step began (the controller's clock)")
    ax.set_title(f"{Path(trace_path).name}: spans by process and lane, nested spans below their parent", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), fontsize=6, loc="lower right", ncol=4)
    fig.tight_layout()
    fig.savefig(png_path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":  # python -m asyncrl.single_controller.trace TRACE.json OUT.png
    import sys

    render_png(Path(sys.argv[1]), Path(sys.argv[2]))
