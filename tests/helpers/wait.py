"""Waiting in tests for a condition, not for a time: `await until(lambda: ..., "what")`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0, every_s: float = 0.01) -> None:
    """Return once `condition()` holds; fail naming `what` if it has not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        await asyncio.sleep(every_s)
