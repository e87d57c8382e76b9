"""`ObjectFuture`: the not-yet-produced output of a call, and `resolve_refs` to wait on them.

Passing an unresolved future into another call is a dataflow edge: the consumer awaits it
(via `resolve_refs`) and then pulls from the owner; the controller never touches the data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from objectstore.ref import ObjectRef


class ObjectFuture:
    """An awaitable that resolves to an `ObjectRef` (or a structure of refs) once produced."""

    __slots__ = ("_fut", "label")

    def __init__(self, label: str = "", *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._fut: asyncio.Future = (loop or asyncio.get_running_loop()).create_future()
        self.label = label

    @classmethod
    def wrap(cls, aw: Any, label: str = "") -> ObjectFuture:
        """A future fed by an awaitable (e.g. an RPC call that returns refs)."""
        fut = cls(label)
        task = asyncio.ensure_future(aw)

        def _done(t: asyncio.Future) -> None:
            if fut.done():
                return
            if t.cancelled():
                fut._fut.cancel()
            elif t.exception() is not None:
                fut.set_exception(t.exception())
            else:
                fut.set_result(t.result())

        task.add_done_callback(_done)
        return fut

    def done(self) -> bool:
        return self._fut.done()

    def set_result(self, ref: Any) -> None:
        self._fut.set_result(ref)

    def set_exception(self, exc: BaseException) -> None:
        self._fut.set_exception(exc)

    def result(self) -> Any:
        """The ref; raises if not done or if the producer failed."""
        return self._fut.result()

    def exception(self) -> BaseException | None:
        return self._fut.exception()

    def add_done_callback(self, fn: Any) -> None:
        self._fut.add_done_callback(lambda _f: fn(self))

    def __await__(self) -> Generator[Any, None, Any]:
        return self._fut.__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"ObjectFuture({self.label or id(self):} {state})"


async def resolve_refs(value: Any) -> Any:
    """`value` with every ObjectFuture inside (lists, tuples, dicts) replaced by its result.

    Futures are awaited concurrently; the first producer failure is raised.
    """
    futures: list[ObjectFuture] = []

    def collect(v: Any) -> None:
        if isinstance(v, ObjectFuture):
            futures.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                collect(item)
        elif isinstance(v, dict):
            for item in v.values():
                collect(item)

    collect(value)
    if not futures:
        return value
    await asyncio.gather(*futures)

    def rebuild(v: Any) -> Any:
        if isinstance(v, ObjectFuture):
            return v.result()
        if isinstance(v, list):
            return [rebuild(item) for item in v]
        if isinstance(v, tuple):
            items = [rebuild(item) for item in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        if isinstance(v, dict):
            return {k: rebuild(item) for k, item in v.items()}
        return v

    return rebuild(value)


def contains_refs(value: Any) -> list[ObjectRef]:
    """Every ObjectRef inside `value` (lists, tuples, dicts)."""
    out: list[ObjectRef] = []
    if isinstance(value, ObjectRef):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            out.extend(contains_refs(item))
    elif isinstance(value, dict):
        for item in value.values():
            out.extend(contains_refs(item))
    return out
