"""Worker classes for the programming-model tests (importable by worker processes)."""

from __future__ import annotations

import os
import time

import torch

from asyncrl import Batch, ParallelConfig, ParallelLayout, Worker, register
from asyncrl.single_controller.protocols import (
    ALL_TO_ALL,
    DP_PROTO,
    LOCAL_ROWS,
    ONE_TO_ALL,
    RANK_ZERO,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
)


class Producer(Worker):
    @register(DP_PROTO)
    def make(self, spec: Batch) -> Batch:
        """Each rank makes rows for its share of `spec["idx"]`."""
        idx = spec["idx"]
        return Batch({"idx": idx.clone(), "x": idx.float().unsqueeze(1).repeat(1, 4),
                      "owner": torch.full_like(idx, self.rank)},
                     {"tag": [f"r{int(i)}" for i in idx]})

    @register(ONE_TO_ALL)
    def make_rows(self, rows: int, cols: int) -> Batch:
        n = rows // self.world_size
        start = self.rank * n
        return Batch({"idx": torch.arange(start, start + n),
                      "x": torch.ones(n, cols, dtype=torch.float32)})

    @register(ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "world": self.world_size, "pid": os.getpid()}


class Consumer(Worker):
    @register(DP_PROTO)
    def double(self, batch: Batch) -> Batch:
        out = Batch({"y": batch["x"] * 2, "seen_by": torch.full((len(batch),), self.rank)})
        return out

    @register(DP_PROTO)
    def rows_seen(self, batch: Batch) -> dict:
        return {"rank": self.rank, "rows": len(batch), "first": int(batch["idx"][0]) if len(batch) else -1}

    @register(DP_PROTO)
    def sum_x(self, batch: Batch) -> Batch:
        return Batch({"s": batch["x"].sum(dim=1, keepdim=False)})

    @register(ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(RANK_ZERO)
    def rank_zero(self) -> int:
        return self.rank

    @register(ALL_TO_ALL)
    def echo(self, value):
        return (self.rank, value)

    @register(ONE_TO_ALL)
    def sleep(self, seconds: float) -> tuple[float, float]:
        """Sleep; (start, end) on the machine's monotonic clock (one clock for every process)."""
        start = time.monotonic()
        time.sleep(seconds)
        return start, time.monotonic()

    @register(ONE_TO_ALL)
    def stamp(self, label: str) -> tuple:
        return (label, time.monotonic())

    @register(DP_PROTO)
    def repeat_rows(self, batch: Batch, k: int) -> Batch:
        """k output rows per input row (like n samples per prompt)."""
        return batch.select("idx").repeat(k, interleave=True)

    @register(ONE_TO_ALL)
    def fail_fast_or_sleep(self, seconds: float) -> float:
        if self.rank == 1:
            raise RuntimeError(f"rank 1 fails at once (at {time.monotonic()!r})")
        time.sleep(seconds)
        return time.monotonic()

    @register(DP_PROTO)
    def fail_on_rank_one(self, batch: Batch) -> Batch:
        if self.rank == 1:
            raise ValueError("rank one refuses")
        return batch


class Mesh3D(Worker):
    """4 ranks as pp=1 × dp=2 × tp=2; a rollout layout with dp=1 × micro_dp=2 × tp=2."""

    def __init__(self, tp: int = 2) -> None:
        super().__init__()
        self.register_mesh(ParallelLayout.from_config(ParallelConfig(tp=tp), self.world_size))
        self.register_mesh(ParallelLayout.of(self.world_size, "rollout", dp=1, micro_dp=2, tp=2))

    @register(THREE_D_PROTO)
    def tag(self, batch: Batch) -> Batch:
        c = self.coords()
        return Batch({"idx": batch["idx"], "dp": torch.full((len(batch),), c["dp"]),
                      "tp": torch.full((len(batch),), c["tp"])})

    @register(THREE_D_ALL_MICRO_DP)
    def gen(self, batch: Batch) -> Batch:
        micro = self.coords("rollout")["micro_dp"]
        return Batch({"idx": batch["idx"], "micro": torch.full((len(batch),), micro)})

    @register(THREE_D_PP_ONLY)
    def names(self) -> list:
        return [self.rank, self.coords()]

    @register(ONE_TO_ALL)
    def relayout(self, tp: int) -> None:
        """Change the train layout mid-job (the driver learns it from this call's result)."""
        self.register_mesh(ParallelLayout.from_config(ParallelConfig(tp=tp), self.world_size))


class Colocated(Worker):
    @register(ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def add_column(batch: Batch, value: float) -> Batch:
    """Runs on a worker via group.apply."""
    return Batch({"z": batch["x"][:, 0] + value})


def gathered_sizes(batch: Batch, big: int, peers) -> list[int]:
    """Runs on a worker via group.apply: the sizes of every rank's gathered value (rank 0's is
    `big` bytes, the others' 3, each plus a byte of its row count)."""
    got = peers.gather(b"x" * (big if peers.rank == 0 else 3) + bytes([len(batch)]))
    return [len(v) for v in got] + [v[-1] for v in got]


class RowsWorker(Worker):
    """Rows of a GRPO-shaped batch made on each rank, in a process group (advantages where they live)."""

    def __init__(self) -> None:
        super().__init__()
        from asyncrl.train.fsdp import init_distributed

        init_distributed()

    @register(ONE_TO_ALL)
    def make_samples(self, rows_per_rank: list[int], n: int, width: int = 6) -> Batch:
        """`rows_per_rank[rank]` rows; uid = row // n over the whole batch (so a group may reach
        onto the next rank), random scores, masks and log-probs."""
        start, rows = sum(rows_per_rank[:self.rank]), rows_per_rank[self.rank]
        g = torch.Generator().manual_seed(self.rank)
        mask = (torch.rand(rows, width, generator=g) < 0.8).float()
        mask[:, 0] = 1.0
        return Batch({"scores": torch.randint(0, 2, (rows,), generator=g).float(), "response_mask": mask,
                      "old_log_probs": -torch.rand(rows, width, generator=g),
                      "ref_log_prob": -torch.rand(rows, width, generator=g),
                      "values": torch.randn(rows, width, generator=g)},
                     {"uid": [f"p{(start + i) // n}" for i in range(rows)]})


class Counter:
    """A part of `WithPart`: its registered methods are the worker's."""

    def __init__(self, rank: int) -> None:
        self.rank, self.count = rank, 0

    @register(ONE_TO_ALL)
    def bump(self, by: int) -> list[int]:
        self.count += by
        return [self.rank, self.count]

    @register(DP_PROTO)
    def tag(self, batch: Batch) -> Batch:
        return Batch({"rank": torch.full((len(batch),), self.rank), "count": torch.full((len(batch),), self.count)})

    def hidden(self) -> int:  # not registered: not the driver's to call
        return self.count


class WithPart(Worker):
    parts = {"counter": Counter}

    def __init__(self) -> None:
        super().__init__()
        self.counter = Counter(self.rank)

    @register(ONE_TO_ALL)
    def count(self) -> int:
        return self.counter.count


class Chain(Worker):
    """A producer and a LOCAL_ROWS consumer on the same processes (pipelined calls), in a
    process group (`totals`' sum)."""

    def __init__(self) -> None:
        super().__init__()
        from asyncrl.train.fsdp import init_distributed

        init_distributed()

    @register(DP_PROTO)
    def make(self, spec: Batch, delay: float = 0.0, fail_rank: int = -1) -> Batch:
        """Rows x = 10 * idx + rank after `delay` seconds; rank `fail_rank` raises."""
        time.sleep(delay)
        if self.rank == fail_rank:
            raise RuntimeError(f"make failed on rank {self.rank}")
        idx = spec["idx"]
        return Batch({"x": idx.float() * 10 + self.rank, "made_by": torch.full_like(idx, self.rank)})

    @register(LOCAL_ROWS)
    def score(self, batch: Batch) -> Batch:
        return Batch({"score": batch["x"] + 1, "scored_by": torch.full((len(batch),), self.rank)})

    @register(DP_PROTO)
    def span(self, spec: Batch, delay: float = 0.0, fail_rank: int = -1) -> Batch:
        """Each row: when this rank began and ended the call (monotonic seconds), after `delay`;
        rank `fail_rank` raises."""
        began = time.monotonic()
        time.sleep(delay)
        if self.rank == fail_rank:
            raise RuntimeError(f"span failed on rank {self.rank}")
        n = len(spec["idx"])
        return Batch({"began": torch.full((n,), began, dtype=torch.float64),
                      "ended": torch.full((n,), time.monotonic(), dtype=torch.float64),
                      "rank": torch.full((n,), self.rank)})


def totals(batch: Batch, peers) -> Batch:
    """Runs on a worker via group.apply: x + score per row, and the batch's sum over every rank."""
    total = batch["x"] + batch["score"]
    everything = peers.sum(total.sum().reshape(1))
    return Batch({"total": total, "everything": everything.expand(len(batch)).clone()})
