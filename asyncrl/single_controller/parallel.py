"""Parallel layouts: one value per worker group that says how its ranks split into pipeline,
data and tensor parallel groups.

`ParallelConfig` is the typed config (plain ints, a Hydra structured-config field);
`ParallelLayout.from_config(cfg, world_size)` validates it against the group's world size. The
same layout value serves the driver (the transfer protocols read a rank's DP index and which
ranks' outputs count) and the worker (it owns the torch `DeviceMesh` and hands out named
sub-meshes to `apply_fsdp` and, later, `apply_tp`).

Ranks are laid out row-major over the dims, outer to inner: pp, dp, tp (tensor parallel
innermost, so a TP group is neighbouring ranks). Other layouts name their own dims with
`ParallelLayout.of`.

The generation layout (HybridFlow §5.3, `generation_layout`) re-reads the same ranks as
pg × micro_pp × dp × tg × micro_tp: a training TP coordinate `tp = g·(t/tg) + m` splits into
the generation TP coordinate g (ranks at stride t/tg form a generation TP group) and the
micro-DP coordinate m (consecutive ranks form a micro-DP group), the same for pp. Every rank's
generation shard then *contains* its training shard, and the reshard is one all-gather inside
each micro-DP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TRAIN = "train"
ROLLOUT = "rollout"
TRAIN_DIMS = ("pp", "dp", "tp")
GENERATION_DIMS = ("pp", "micro_pp", "dp", "tp", "micro_tp")
MICRO_DP_DIMS = ("micro_pp", "micro_tp")
# the dims a batch splits over (absent dims count as size 1); user layouts may name "micro_dp"
DATA_DIMS = ("dp", "micro_dp", "micro_pp", "micro_tp")


class LayoutError(ValueError):
    """A parallel layout does not fit its world size or was asked for a dim it lacks."""


@dataclass
class ParallelConfig:
    """Sizes of one model's parallel dims; `dp=0` fills the rest: world_size // (pp * tp)."""

    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel ranks per stage
    dp: int = 0  # data-parallel ranks; 0 = world_size // (pp * tp)
    # Ulysses sequence parallelism: groups of `sp` data-parallel ranks share each micro-batch's
    # tokens (asyncrl.train.ulysses); it must divide dp and the heads per TP rank
    sp: int = 1


@dataclass
class GenerationParallelConfig:
    """The rollout engine's model parallelism (HybridFlow's pg, tg); its micro-DP size is
    derived: dg = (actor pp·tp) / (pp·tp)."""

    pp: int = 1  # generation pipeline stages (1: generation holds whole layers)
    tp: int = 1  # generation tensor-parallel ranks (HybridFlow's tg): a divisor of the actor's tp
    # expert-parallel generation of a mixture of experts: each rank keeps the block of experts it trains
    # (ep = actor.moe.ep on megatron, the data-parallel ranks on fsdp2) and generates its own rows, the
    # group's tokens exchanged at every MoE layer (asyncrl.rollout.experts); 1: every rank holds every expert
    ep: int = 1


@dataclass(frozen=True)
class ParallelLayout:
    """Named parallel dims (outer to inner) and their sizes over `world_size` ranks.

    Driver side it is pure arithmetic on ranks; on a worker, `device_mesh()` builds the torch
    `DeviceMesh` once (a collective: every rank of the group calls it) and `submesh(dim)`
    returns a named dim of it.
    """

    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    name: str = TRAIN
    _mesh: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.sizes) or len(set(self.dims)) != len(self.dims):
            raise LayoutError(f"layout {self.name!r}: dims {self.dims} and sizes {self.sizes} must "
                              "pair up, one size per distinct dim")
        bad = [f"{d}={s}" for d, s in zip(self.dims, self.sizes, strict=True) if s < 1]
        if bad:
            raise LayoutError(f"layout {self.name!r}: sizes must be >= 1, got {', '.join(bad)}")

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelLayout:
        """The pp × dp × tp training layout of `world_size` ranks; `cfg.dp=0` fills the rest."""
        for dim in ("pp", "tp"):
            if getattr(cfg, dim) < 1:
                raise LayoutError(f"parallel.{dim}={getattr(cfg, dim)}: must be >= 1")
        if cfg.dp < 0:
            raise LayoutError(f"parallel.dp={cfg.dp}: must be >= 1, or 0 to fill the world size")
        model = cfg.pp * cfg.tp
        if cfg.dp == 0:
            if world_size % model:
                fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
                raise LayoutError(
                    f"parallel pp={cfg.pp} x tp={cfg.tp} = {model} does not divide the world size "
                    f"{world_size}; choose pp*tp among {fits}, or change the group's world size to "
                    f"a multiple of {model}")
            dp = world_size // model
        else:
            dp = cfg.dp
            if dp * model != world_size:
                raise LayoutError(
                    f"parallel pp={cfg.pp} x dp={dp} x tp={cfg.tp} = {dp * model} ranks, but the "
                    f"world size is {world_size}; set dp=0 to fill it, or make pp*dp*tp = {world_size}")
        sp = getattr(cfg, "sp", 1)
        if sp < 1 or dp % sp:
            raise LayoutError(f"parallel.sp={sp} must be >= 1 and divide the data-parallel size dp={dp} "
                              "(sequence-parallel groups are sp data-parallel ranks); choose sp among "
                              f"{[k for k in range(1, dp + 1) if dp % k == 0]}")
        return cls(TRAIN_DIMS, (cfg.pp, dp, cfg.tp), TRAIN)

    @classmethod
    def of(cls, world_size: int, name: str = TRAIN, **sizes: int) -> ParallelLayout:
        """A layout with its own dims, outer to inner in keyword order, e.g. the rollout layout
        `ParallelLayout.of(4, "rollout", dp=1, micro_dp=2, tp=2)`."""
        layout = cls(tuple(sizes), tuple(sizes.values()), name)
        if layout.world_size != world_size:
            raise LayoutError(f"layout {name!r} {layout.describe()} covers {layout.world_size} "
                              f"ranks, but the world size is {world_size}; make the sizes "
                              f"multiply to {world_size}")
        return layout

    # shape ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, dim: str) -> int:
        """The size of `dim` (1 for a dim this layout does not have)."""
        return dict(zip(self.dims, self.sizes, strict=True)).get(dim, 1)

    def describe(self) -> str:
        return " x ".join(f"{d}={s}" for d, s in zip(self.dims, self.sizes, strict=True))

    # a rank's place -------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate on every dim (row-major, last dim innermost)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside layout {self.name!r} ({self.describe()}, "
                              f"{self.world_size} ranks)")
        out, rest = {}, rank
        for d, s in zip(reversed(self.dims), reversed(self.sizes), strict=True):
            out[d] = rest % s
            rest //= s
        return {d: out[d] for d in self.dims}

    def coord(self, rank: int, dim: str) -> int:
        return self.coords(rank).get(dim, 0)

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    def dp_rank(self, rank: int) -> int:
        return self.coord(rank, "dp")

    def data_index(self, rank: int, data_dims: tuple[str, ...] = DATA_DIMS) -> int:
        """Which data shard `rank` gets when the batch splits over the product of `data_dims`."""
        c, index = self.coords(rank), 0
        for d in data_dims:
            index = index * self.size(d) + c.get(d, 0)
        return index

    def data_shards(self, data_dims: tuple[str, ...] = DATA_DIMS) -> int:
        return math.prod(self.size(d) for d in data_dims)

    def is_collect_rank(self, rank: int, data_dims: tuple[str, ...] = DATA_DIMS) -> bool:
        """Whether `rank`'s output represents its data shard: every non-data dim at 0, except
        pp at its last stage (where the outputs are)."""
        return self.collect_rank_of(rank, data_dims) == rank

    def collect_rank_of(self, rank: int, data_dims: tuple[str, ...] = DATA_DIMS) -> int:
        c = self.coords(rank)
        want = {d: (self.size(d) - 1 if d == "pp" else 0) if d not in data_dims else c[d]
                for d in self.dims}
        return self.rank_of(want)

    def collect_ranks(self, data_dims: tuple[str, ...] = DATA_DIMS) -> list[int]:
        """One rank per data shard, in shard order: the ranks whose outputs the driver keeps."""
        ranks = sorted({self.collect_rank_of(r, data_dims) for r in range(self.world_size)})
        return sorted(ranks, key=lambda r: self.data_index(r, tuple(d for d in data_dims if d in self.dims)))

    def groups(self, vary: tuple[str, ...]) -> list[list[int]]:
        """The partition of all ranks into groups that differ only along the dims in `vary`
        (each group in row-major order of `vary`), e.g. `groups(("tp",))` = the TP groups."""
        unknown = [d for d in vary if d not in self.dims]
        if unknown:
            raise LayoutError(f"layout {self.name!r} ({self.describe()}) has no dims {unknown}")
        out: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            out.setdefault(tuple(c[d] for d in self.dims if d not in vary), []).append(rank)
        for ranks in out.values():
            ranks.sort(key=lambda r: [self.coord(r, d) for d in vary])
        return sorted(out.values())

    def group_of(self, rank: int, vary: tuple[str, ...]) -> list[int]:
        """The group of `groups(vary)` that holds `rank`."""
        return next(g for g in self.groups(vary) if rank in g)

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for d, s in zip(self.dims, self.sizes, strict=True):
            rank = rank * s + coords.get(d, 0)
        return rank

    # the torch mesh (worker side) -----------------------------------------------------------
    def mesh_dims(self) -> tuple[str, ...]:
        """The dims the DeviceMesh has: those larger than 1, and always dp when the layout has it
        (FSDP shards over it even on one rank)."""
        dims = tuple(d for d, s in zip(self.dims, self.sizes, strict=True) if s > 1 or d == "dp")
        return dims or self.dims[-1:]

    def device_mesh(self, device_type: str | None = None) -> Any:
        """This group's `DeviceMesh`, built on first use (a collective over the group's ranks)."""
        if "mesh" not in self._mesh:
            import torch
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            if not dist.is_initialized():
                raise LayoutError("torch.distributed is not initialised; call "
                                  "asyncrl.train.init_distributed() before layout.device_mesh()")
            if dist.get_world_size() != self.world_size:
                raise LayoutError(f"layout {self.name!r} covers {self.world_size} ranks but the "
                                  f"process group has {dist.get_world_size()}")
            device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            dims = self.mesh_dims()
            self._mesh["mesh"] = init_device_mesh(device_type, tuple(self.size(d) for d in dims),
                                                  mesh_dim_names=dims)
        return self._mesh["mesh"]

    def submesh(self, dim: str, device_type: str | None = None) -> Any:
        """The 1-D sub-mesh of `dim` that holds this rank (e.g. `submesh("dp")` for FSDP)."""
        mesh = self.device_mesh(device_type)
        if dim not in self.mesh_dims():
            raise LayoutError(f"layout {self.name!r} ({self.describe()}) has no {dim!r} mesh "
                              f"(mesh dims: {self.mesh_dims()}); a dim of size 1 needs no group")
        return mesh[dim] if len(self.mesh_dims()) > 1 else mesh

    # wire -----------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dims": list(self.dims), "sizes": list(self.sizes)}

    @classmethod
    def from_wire(cls, v: dict[str, Any]) -> ParallelLayout:
        return cls(tuple(v["dims"]), tuple(v["sizes"]), v["name"])


def generation_layout(train: ParallelLayout, cfg: GenerationParallelConfig,
                      at: str = "rollout.parallel", train_at: str = "actor.parallel") -> ParallelLayout:
    """The pg-tg-dg-d generation layout over a p-t-d training layout's ranks (module docstring).

    tg must divide t and pg divide p (so the generation shard of a rank contains its training
    shard); the micro-DP size is (t/tg)·(p/pg).
    """
    p, d, t = train.size("pp"), train.size("dp"), train.size("tp")
    for dim, gen, tr in (("tp", cfg.tp, t), ("pp", cfg.pp, p)):
        if gen < 1:
            raise LayoutError(f"{at}.{dim}={gen}: must be >= 1")
        if tr % gen:
            fits = [k for k in range(1, tr + 1) if tr % k == 0]
            raise LayoutError(f"{at}.{dim}={gen} must divide {train_at}.{dim}={tr} (each generation "
                              f"shard is built from whole training shards); choose {at}.{dim} among {fits}")
    return ParallelLayout.of(train.world_size, ROLLOUT, pp=cfg.pp, micro_pp=p // cfg.pp, dp=d,
                             tp=cfg.tp, micro_tp=t // cfg.tp)


def pure_dp(world_size: int) -> ParallelLayout:
    """Every rank its own data shard (the default layout of a group)."""
    return ParallelLayout.from_config(ParallelConfig(), world_size)


__all__ = ["DATA_DIMS", "GENERATION_DIMS", "MICRO_DP_DIMS", "ROLLOUT", "TRAIN", "GenerationParallelConfig",
           "LayoutError", "ParallelConfig", "ParallelLayout", "generation_layout", "pure_dp"]
