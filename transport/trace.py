"""Spans of a process's work, recorded only while tracing is on, as Chrome trace events.

`span(name, **args)` times a block (sync or async) on this process's monotonic clock. Off (the
default) it costs one attribute read. On, each span is a complete event ("X") on a lane: a span
nests on its parent's lane while the parent is innermost there, otherwise it takes the lowest
free lane, so concurrent spans (coroutines, threads) never overlap on one lane and every lane's
spans nest. `collect()` hands over the events with this process's clock; the controller aligns
the processes' clocks and writes one file (`asyncrl.trace`).
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Any

MAX_EVENTS = 200_000  # per recording: a runaway loop cannot exhaust memory


class _Recorder:
    def __init__(self) -> None:
        self.on = False
        self.events: list[list] = []  # [name, cat, start_ns, dur_ns, lane, args]
        self.lanes: list[list[int]] = []  # per lane, the ids of its open spans, innermost last
        self.lock = threading.Lock()
        self.next_id = 0
        self.dropped = 0


_rec = _Recorder()
_current: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("asyncrl_span", default=None)


def clock_ns() -> int:
    """The clock spans are recorded on (CLOCK_MONOTONIC: shared by the processes of one host)."""
    return time.monotonic_ns()


def start() -> None:
    """Record spans from now on (events from an earlier recording are discarded)."""
    with _rec.lock:
        _rec.events, _rec.lanes, _rec.dropped, _rec.on = [], [], 0, True


def collect(stop: bool = True) -> dict[str, Any]:
    """The events recorded so far (and stop recording): `events` as [name, cat, start_ns,
    dur_ns, lane, args], `clock_ns` this process's monotonic clock now, `dropped` past MAX_EVENTS."""
    with _rec.lock:
        events, _rec.events = _rec.events, []
        if stop:
            _rec.on, _rec.lanes = False, []
        return {"events": events, "clock_ns": time.monotonic_ns(), "dropped": _rec.dropped}


class _Span:
    __slots__ = ("name", "cat", "args", "t0", "lane", "id", "token")

    def __init__(self, name: str, cat: str, args: dict[str, Any]) -> None:
        self.name, self.cat, self.args = name, cat, args
        self.lane = -1

    def __enter__(self) -> _Span:
        if not _rec.on:
            return self
        parent = _current.get()
        with _rec.lock:
            _rec.next_id += 1
            self.id = _rec.next_id
            lanes = _rec.lanes
            if parent is not None and parent[0] < len(lanes) and lanes[parent[0]] and lanes[parent[0]][-1] == parent[1]:
                self.lane = parent[0]
            else:
                self.lane = next((i for i, open_ in enumerate(lanes) if not open_), len(lanes))
                if self.lane == len(lanes):
                    lanes.append([])
            lanes[self.lane].append(self.id)
        self.token = _current.set((self.lane, self.id))
        self.t0 = time.monotonic_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.lane < 0:
            return
        dur = time.monotonic_ns() - self.t0
        try:
            _current.reset(self.token)
        except ValueError:  # left in another context than it entered (a generator): fine to ignore
            pass
        with _rec.lock:
            if self.lane < len(_rec.lanes) and self.id in _rec.lanes[self.lane]:
                _rec.lanes[self.lane].remove(self.id)
            if not _rec.on:
                return
            if len(_rec.events) >= MAX_EVENTS:
                _rec.dropped += 1
                return
            _rec.events.append([self.name, self.cat, self.t0, dur, self.lane, self.args])

    async def __aenter__(self) -> _Span:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)

    def note(self, **args: Any) -> None:
        """Add arguments known only inside the span (bytes moved, rows)."""
        if self.lane >= 0:
            self.args = {**self.args, **args}


class _Off:
    """The span while tracing is off: nothing is timed or kept."""

    __slots__ = ()

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    async def __aenter__(self) -> _Off:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def note(self, **args: Any) -> None:
        return None


_OFF = _Off()


def span(name: str, cat: str = "", **args: Any) -> _Span | _Off:
    """A block recorded as one span while tracing is on: `with span("pull", bytes=n): ...`."""
    if not _rec.on:
        return _OFF
    return _Span(name, cat, args)
