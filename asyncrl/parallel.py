"""Parallel layouts of a worker group."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    pp: int = 1
    tp: int = 1
    dp: int = 0  # 0 = fill: world_size // (pp * tp)
