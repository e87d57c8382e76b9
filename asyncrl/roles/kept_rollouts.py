"""The training rollouts a run keeps for reading later (trainer.keep_rollouts).

Each actor rank samples rows of the batch its update reads — rows of every data source in turn,
chosen without the training's random streams — and writes them itself (the rows never pass
through the controller) as parquet, one file per rank per `FLUSH_STEPS` steps:
`<run>/rollouts/rank<r>/steps_<first>-<last>.parquet`, written to a temporary name and renamed, so
a reader sees whole files only (a resumed run writes the steps after its checkpoint again: for a
step, the newest file's rows are the ones that trained). A row: the step, the prompt and response as text, the response's
token ids, the reward and its parts, the advantage, the length, why it ended, the weights version
and staleness, turns and tool calls of a multi-turn trajectory, and per token the rollout's and
the trainer's log-probs (where the step computed the trainer's), the advantage and the mask of
the model's own tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import torch

from asyncrl.rewards.rules import REWARD_EXTRA

FLUSH_STEPS = 10  # steps a rank's kept rows wait in memory before they are written
TRAJECTORY = ("num_turns", "tool_calls", "tool_errors", "env_errors")  # multi-turn columns kept when present


def schema() -> Any:
    """The kept rows' columns and types: one schema for every file, whatever a step computed."""
    import pyarrow as pa

    floats = pa.list_(pa.float32())
    return pa.schema([("step", pa.int64()), ("rank", pa.int32()), ("row", pa.int32()), ("uid", pa.string()),
                      ("data_source", pa.string()), ("prompt", pa.string()), ("response", pa.string()),
                      ("response_ids", pa.list_(pa.int32())), ("model_token", pa.list_(pa.int8())),
                      ("reward", pa.float64()), ("reward_parts", pa.string()), ("advantage", pa.float64()),
                      ("response_length", pa.int32()), ("finish_reason", pa.string()), ("weights_version", pa.int64()),
                      ("staleness", pa.int64()), *((k, pa.float64()) for k in TRAJECTORY),
                      ("rollout_log_probs", floats), ("trainer_log_probs", floats), ("advantages", floats)])


def warm_up() -> None:
    """One empty table written to memory: what the first real write would load, loaded now."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pydict({f.name: [] for f in schema()}, schema=schema()), pa.BufferOutputStream(),
                   compression="zstd")


def chosen_rows(sources: list[str], want: int, step: int, rank: int) -> list[int]:
    """`want` row indices (all when want < 0), each data source in turn, drawn by a generator of
    the step and rank's own (the training's random streams untouched)."""
    if want < 0 or want >= len(sources):
        return list(range(len(sources)))
    pick = random.Random(step * 1_000_003 + rank)
    by_source: dict[str, list[int]] = {}
    for i, s in enumerate(sources):
        by_source.setdefault(s, []).append(i)
    for rows in by_source.values():
        pick.shuffle(rows)
    out: list[int] = []
    while len(out) < want:
        for rows in by_source.values():
            if rows and len(out) < want:
                out.append(rows.pop())
    return sorted(out)


def _ragged(t: torch.Tensor | None, ends: list[int]) -> list[list[Any]] | None:
    """Each row of `t` cut at its response's end, as lists (one conversion for all rows)."""
    return None if t is None else [r[:e] for r, e in zip(t.tolist(), ends, strict=True)]


def _floats(t: Any) -> list[float] | None:
    return None if t is None else [float(x) for x in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def _parts(batch: Any, rows: list[int]) -> list[str]:
    """Each row's reward parts (a dict reward's extra numbers) as JSON."""
    names = [c.removeprefix(REWARD_EXTRA) for c in batch.keys() if c.startswith(REWARD_EXTRA)]
    values = [_floats(_column(batch, REWARD_EXTRA + name, rows)) for name in names]
    return [json.dumps(dict(zip(names, v, strict=True))) for v in zip(*values, strict=True)] if names else ["{}"] * len(rows)


def _trainer(batch: Any, rows: list[int], ends: list[int], seen: torch.Tensor | None) -> list[Any] | None:
    """The trainer's log-probs of the kept rows: recomputed ones, else the update's (a row it did not see: null)."""
    if "old_log_probs" in batch:
        return _ragged(batch["old_log_probs"][rows], ends)
    if seen is None:
        return None
    return [None if r and math.isnan(r[0]) else r for r in _ragged(seen[rows], ends)]  # NaN: not seen


def _column(batch: Any, name: str, rows: list[int]) -> Any:
    if name not in batch:
        return None
    col = batch[name]
    return col[rows] if isinstance(col, torch.Tensor) else [col[i] for i in rows]


class RolloutKeeper:
    """One actor rank's kept rollouts: rows added at each update, written every FLUSH_STEPS steps."""

    def __init__(self, out_dir: str | Path, rank: int, world_size: int, rows_per_step: int, tokenizer: Any) -> None:
        self.dir = Path(out_dir) / "rollouts" / f"rank{rank}"
        self.rank, self.tokenizer = rank, tokenizer
        # the step's rows over the ranks: each keeps its share (all: -1)
        self.want = rows_per_step if rows_per_step < 0 else -(-rows_per_step // world_size)
        self.columns: dict[str, list[Any]] = {}  # the kept rows since the last flush, by column
        self.steps: set[int] = set()  # and their steps
        warm_up()  # parquet's first write (~0.3 s: imports, the codec) at setup, not in a step

    def add(self, batch: Any, step: int, version: int, trainer_log_probs: torch.Tensor | None = None) -> None:
        """Keep this step's sample of `batch` (the update's rows on this rank), column by column; the
        trainer's log-probs are the batch's `old_log_probs`, else `trainer_log_probs` (the update's own)."""
        n = len(batch)
        sources = [str(s) for s in batch["data_source"]] if "data_source" in batch else ["unknown"] * n
        rows = chosen_rows(sources, self.want, step, self.rank)
        if not rows:
            return
        responses = batch["responses"][rows]
        width = responses.shape[1]
        prompt_ids, attn = batch["input_ids"][rows, :-width], batch["attention_mask"][rows]
        ends = attn[:, -width:].sum(-1).tolist()  # the response's tokens, the environment's included
        mask = batch["response_mask"][rows].bool()
        ids = _ragged(responses, ends)
        prompts = [p[m].tolist() for p, m in zip(prompt_ids, attn[:, :-width].bool(), strict=True)]
        texts = self.tokenizer.batch_decode(prompts + ids, skip_special_tokens=False)
        adv, versions = _column(batch, "advantages", rows), _column(batch, "behav_versions", rows)
        cols: dict[str, Any] = {
            "step": [step] * len(rows), "rank": [self.rank] * len(rows), "row": rows,
            "uid": [str(u) for u in _column(batch, "uid", rows) or [""] * len(rows)],
            "data_source": [sources[i] for i in rows], "prompt": texts[:len(rows)], "response": texts[len(rows):],
            "response_ids": ids, "model_token": _ragged(mask.to(torch.int8), ends),
            "reward": _floats(_column(batch, "scores", rows)),
            "reward_parts": _parts(batch, rows),
            "advantage": ((adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist() if adv is not None else None,
            "response_length": mask.sum(-1).tolist(),
            "finish_reason": ["length" if c else "stop" for c in (_floats(_column(batch, "response_clipped", rows))
                                                                 or [0.0] * len(rows))],
            "weights_version": (versions.masked_fill(~mask, 1 << 62).amin(-1).clamp(max=version).tolist()
                                if versions is not None else [version] * len(rows)),
            **{k: _floats(_column(batch, k, rows)) for k in TRAJECTORY},
            "rollout_log_probs": _ragged(_column(batch, "rollout_log_probs", rows), ends),
            "trainer_log_probs": _trainer(batch, rows, ends, trainer_log_probs),
            "advantages": _ragged(adv, ends),
        }
        cols["staleness"] = [version - v for v in cols["weights_version"]]
        for k, v in cols.items():
            self.columns.setdefault(k, []).extend(v if v is not None else [None] * len(rows))
        self.steps.add(step)
        if len(self.steps) >= FLUSH_STEPS:
            self.flush()

    def flush(self) -> Path | None:
        """Write the rows kept since the last flush; returns the file (None: nothing kept)."""
        if not self.columns:
            return None
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"steps_{min(self.steps):07d}-{max(self.steps):07d}.parquet"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        pq.write_table(pa.Table.from_pydict(self.columns, schema=schema()), tmp, compression="zstd")
        tmp.replace(path)
        self.columns, self.steps = {}, set()
        return path
