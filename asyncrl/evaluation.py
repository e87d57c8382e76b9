"""Held-out evaluation: scores per data_source, pass@k, and the completions a user should see.

Pure functions over scored rows (one dict per generated response: `prompt_index`,
`data_source`, `prompt`, `response`, `score`); the trainer generates and scores them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `correct` of `n` samples correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def by_source(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["data_source"] or "unknown"].append(r)
    return dict(sorted(groups.items()))


def source_means(rows: Sequence[dict[str, Any]], prefix: str = "val/reward") -> dict[str, float]:
    """Mean score per data_source, as `prefix/<source>` (only when there are several sources)."""
    groups = by_source(rows)
    if len(groups) < 2:
        return {}
    return {f"{prefix}/{source}": sum(r["score"] for r in rs) / len(rs) for source, rs in groups.items()}


def pass_at_ks(rows: Sequence[dict[str, Any]], ks: Sequence[int], correct_at: float) -> dict[str, float]:
    """pass@k for each k and mean@n (the mean score of all samples), per data_source and over all
    prompts, as `eval/<source>/pass@k` and `eval/all/pass@k`."""
    out: dict[str, float] = {}
    for source, rs in [*by_source(rows).items(), ("all", list(rows))]:
        prompts: dict[int, list[float]] = defaultdict(list)
        for r in rs:
            prompts[r["prompt_index"]].append(r["score"])
        for k in ks:
            values = [pass_at_k(len(s), sum(x >= correct_at for x in s), k) for s in prompts.values()]
            out[f"eval/{source}/pass@{k}"] = sum(values) / len(values)
        n = max(len(s) for s in prompts.values())
        out[f"eval/{source}/mean@{n}"] = sum(r["score"] for r in rs) / len(rs)
        out[f"eval/{source}/prompts"] = float(len(prompts))
    return out


def sample_rows(rows: Sequence[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The first response of the first `count` prompts, spread over data_sources when there are several."""
    first = {}
    for r in rows:
        first.setdefault(r["prompt_index"], r)
    groups = by_source(list(first.values()))
    picked: list[dict[str, Any]] = []
    while len(picked) < count and any(groups.values()):
        for rs in groups.values():
            if rs and len(picked) < count:
                picked.append(rs.pop(0))
    return picked


def format_samples(step: int, samples: Sequence[dict[str, Any]], width: int = 400) -> str:
    """Completions as a console block: prompt (as templated), response, score."""
    def cut(text: str) -> str:
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[:width] + " ..."

    lines = [f"step {step}: {len(samples)} held-out completions"]
    for i, s in enumerate(samples, 1):
        lines += [f"  [{i}] {s['data_source']}  score {s['score']:.3f}", f"      prompt:   {cut(s['prompt'])}",
                  f"      response: {cut(s['response'])}"]
    return "\n".join(lines)
