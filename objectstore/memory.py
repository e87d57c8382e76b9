"""How much host memory a store may hold: the one place the default limit is decided.

A store without a limit grows until the kernel's OOM killer ends its process ("killed by
SIGKILL"), which tells nobody which refs leaked. With one, a `put` past it raises
`ObjectStoreFullError` naming the biggest objects and who holds them.

By default the stores of a node share `DEFAULT_MEMORY_FRACTION` of the node's memory (the smaller
of its RAM and its cgroup's limit, so a container's limit counts): each store gets an equal share.
"""

from __future__ import annotations

import os
from pathlib import Path

# Ray gives its object store 30% of a node's memory; model weights, optimizer state and
# activations need the rest.
DEFAULT_MEMORY_FRACTION = 0.3

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",  # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1


def node_memory_bytes() -> int:
    """This machine's RAM, or its cgroup's memory limit when that is smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 reports a huge number instead
            total = min(total, int(text))
    return total


def resolve_memory_limit(configured: int | None, stores_on_node: int) -> int:
    """`configured` bytes, or by default this store's equal share of `DEFAULT_MEMORY_FRACTION`
    of the node's memory among the `stores_on_node` stores that run there."""
    if configured is not None:
        return int(configured)
    return int(DEFAULT_MEMORY_FRACTION * node_memory_bytes() / max(1, stores_on_node))


def format_bytes(n: int) -> str:
    """`n` bytes for people: 800 B, 512.0 KiB, 1.5 GiB."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"
