"""The one walker over call arguments and results: leaves of a type inside lists, tuples and
dicts (nested to any depth). Futures to await, `DistBatch`es to pull or track, and `Batch`es
to publish are all found this way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def tree_map(fn: Callable[[Any], Any], value: Any, kind: type | tuple[type, ...]) -> Any:
    """`value` with every leaf of type `kind` replaced by `fn(leaf)`; containers holding no such
    leaf are returned as they are (not copied)."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [tree_map(fn, v, kind) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        items = {k: tree_map(fn, v, kind) for k, v in value.items()}
        if all(items[k] is value[k] for k in value):
            return value
        return type(value)(items) if type(value) is not dict else items
    return value


def tree_leaves(value: Any, kind: type | tuple[type, ...]) -> list[Any]:
    """Every leaf of type `kind` in `value`, in walk order."""
    found: list[Any] = []
    tree_map(found.append, value, kind)
    return found


async def tree_map_async(fn: Callable[[Any], Awaitable[Any]], value: Any,
                         kind: type | tuple[type, ...]) -> Any:
    """`tree_map` with an async `fn`, run concurrently over the leaves (each distinct leaf once)."""
    leaves = list({id(v): v for v in tree_leaves(value, kind)}.values())
    if not leaves:
        return value
    results = await asyncio.gather(*(fn(v) for v in leaves))
    table = {id(v): r for v, r in zip(leaves, results, strict=True)}
    return tree_map(lambda v: table[id(v)], value, kind)
