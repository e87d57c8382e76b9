"""Event-loop selection: uvloop when installed, the stdlib loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

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
