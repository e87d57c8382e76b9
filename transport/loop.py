"""Event-loop selection (uvloop when installed, the stdlib loop otherwise) and a blocked-loop monitor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
    uvloop = None


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run `main` to completion on uvloop when available."""
    if use_uvloop and uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)


def loop_kind() -> str:
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


class LoopLagMonitor:
    """Warns when an event loop was blocked: a thread watches a tick the loop keeps fresh, and
    names the Python frame the loop's thread was stuck in (e.g. a `time.sleep` in `async def`).

        monitor = LoopLagMonitor("driver", threshold_s=1.0)
        monitor.start()   # on the loop to watch
        ...
        monitor.stop()
    """

    def __init__(self, role: str, threshold_s: float = 1.0, logger: logging.Logger | None = None) -> None:
        self.role, self.threshold_s = role, threshold_s
        self.log = logger or log
        self.stalls: list[tuple[float, str]] = []  # (seconds, where) of each stall seen
        self._tick = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._handle: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._excused: list[str] = []  # why stalls are expected now (`excused`), innermost last

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat()
        self._thread = threading.Thread(target=self._watch, name=f"{self.role}-loop-lag", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._tick = time.monotonic()
        self._handle = self._loop.call_later(self.threshold_s / 4, self._beat)

    def _watch(self) -> None:
        began, where = None, ""
        while not self._stop.wait(self.threshold_s / 4):
            lag = time.monotonic() - self._tick
            if lag > self.threshold_s and began is None:
                began, where = self._tick, self._where()
            elif lag <= self.threshold_s and began is not None:
                seconds = self._tick - began
                self.stalls.append((seconds, where))
                if where.startswith("excused: "):
                    self.log.debug("the %s's event loop waited %.1f s (%s)", self.role, seconds, where)
                    began = None
                    continue
                self.log.warning(
                    "the %s's event loop was blocked for %.1f s%s: blocking code in `async def` holds "
                    "up every call, RPC and reply of this process; run it with `await "
                    "asyncio.to_thread(...)` (or use `await asyncio.sleep`)", self.role, seconds,
                    f" (in {where})" if where else "")
                began = None

    @contextlib.contextmanager
    def excused(self, why: str) -> Iterator[None]:
        """Stalls that begin inside the block are expected (`why`: e.g. heavy imports on a thread
        of the loop's process, whose C code holds the GIL): recorded, not warned about."""
        self._excused.append(why)
        try:
            yield
        finally:
            self._excused.remove(why)

    def _where(self) -> str:
        """The innermost frame of the loop's thread outside the standard library and this module."""
        if self._excused:
            return f"excused: {self._excused[-1]}"
        frame = sys._current_frames().get(self._loop_thread)
        stdlib = os.path.dirname(os.__file__)
        innermost = frame
        while frame is not None:
            path = frame.f_code.co_filename
            if not path.startswith(stdlib) and "site-packages" not in path and path != __file__:
                return f"{frame.f_code.co_name} at {os.path.basename(path)}:{frame.f_lineno}"
            frame = frame.f_back
        return innermost.f_code.co_name if innermost is not None else ""

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2)
