"""The `objectstore` section of a job's config: how much memory each object store may hold."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ObjectStoreConfig:
    memory_limit: int | None = None
    """Bytes of host memory each worker's (and the driver's) object store may hold; past it a put
    raises ObjectStoreFullError naming the biggest objects, instead of the kernel killing the
    worker. None: objectstore.memory.DEFAULT_MEMORY_FRACTION of the node's memory (RAM or its
    cgroup limit), shared equally by the node's stores."""

    def check(self, at: str) -> None:
        """Raises ValueError naming the key (the config loader turns it into a ConfigError)."""
        if self.memory_limit is not None and not self.memory_limit > 0:
            raise ValueError(f"bad configuration: {at}memory_limit={self.memory_limit!r}: must be a number of "
                             "bytes > 0 (e.g. 8589934592 for 8 GiB), or null for the default")
