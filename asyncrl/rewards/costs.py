"""Rule-based costs for Safe-RLHF-style constrained training (same signature as rewards)."""

from __future__ import annotations

from typing import Any


def length_cost(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Cost in [0, 1]: how much longer than the reference answer the response is (verbosity)."""
    gold = len(str(ground_truth).split()) or 1
    extra = max(0, len(solution_str.split()) - gold)
    return min(1.0, extra / gold)
