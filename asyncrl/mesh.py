"""Parallel meshes: which DP/TP/PP/… coordinates a rank holds, so protocols know who gets which
rows and whose output counts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Outer to inner: Megatron's layout, with tensor parallelism innermost (neighbouring ranks).
DEFAULT_ORDER = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Mesh:
    """One rank's place in a named parallel mesh (e.g. "train" = pp×dp×tp, "rollout")."""

    name: str
    sizes: dict[str, int]
    coords: dict[str, int]

    @classmethod
    def from_rank(cls, rank: int, name: str = "train", order: tuple[str, ...] = DEFAULT_ORDER,
                  **sizes: int) -> Mesh:
        """Lay `rank` out in a row-major mesh of `sizes`, dims ordered by `order` (outer first)."""
        unknown = set(sizes) - set(order)
        dims = [d for d in order if d in sizes] + sorted(unknown)
        coords, rest = {}, rank
        for d in reversed(dims):
            coords[d] = rest % sizes[d]
            rest //= sizes[d]
        if rest:
            raise ValueError(f"rank {rank} does not fit in mesh {sizes} ({math.prod(sizes.values())} ranks)")
        return cls(name, {d: sizes[d] for d in dims}, {d: coords[d] for d in dims})

    def size(self, dim: str) -> int:
        return self.sizes.get(dim, 1)

    def coord(self, dim: str) -> int:
        return self.coords.get(dim, 0)

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def is_collect_rank(self) -> bool:
        """The rank whose output represents its DP group: TP/CP rank 0 on the last PP stage."""
        return (self.coord("tp") == 0 and self.coord("cp") == 0
                and self.coord("pp") == self.size("pp") - 1)

    def data_index(self, data_dims: tuple[str, ...] = ("dp",)) -> tuple[int, int]:
        """(index, count) of this rank's data shard over the product of `data_dims`."""
        index, count = 0, 1
        for d in data_dims:
            index = index * self.size(d) + self.coord(d)
            count *= self.size(d)
        return index, count

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "sizes": self.sizes, "coords": self.coords}

    @classmethod
    def from_wire(cls, v: dict[str, Any]) -> Mesh:
        return cls(v["name"], dict(v["sizes"]), dict(v["coords"]))
