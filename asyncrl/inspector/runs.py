"""A run directory as the inspector reads it: metrics, kept rollouts and held-out samples, each
read incrementally while the run still writes them, never held whole where a page needs a part.

- `metrics.jsonl`: read from where the last read stopped (a line still being written waits for its
  newline; a file that shrank — a fresh start — is read again), kept as one column per metric.
- `rollouts/rank<r>/steps_<a>-<b>.parquet` (asyncrl.roles.kept_rollouts): found by name; a step's
  rows on a rank come from the newest file that holds it (a resumed run writes steps again). Each
  file's small columns are read once and cached; text and per-token columns only for the rows a
  page shows.
- `samples.jsonl`: the held-out completions of each evaluation.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import AsyncRLError

ROLLOUT_FILE = re.compile(r"steps_(\d+)-(\d+)\.parquet")
SCALARS = ("step", "rank", "row", "data_source", "reward", "advantage", "response_length", "finish_reason",
           "weights_version", "staleness", "num_turns", "tool_calls", "tool_errors")
SORTS = {"step": "step", "reward": "reward", "length": "response_length", "advantage": "advantage",
         "staleness": "staleness"}
PER_PAGE = 50
MAX_POINTS = 2000  # a curve's points sent to the browser at most (bucket means beyond)


class RunError(AsyncRLError):
    """A directory (or file in it) the inspector cannot read, or a request it cannot answer; the
    message says what is wrong."""

    status = 400


class NotFound(RunError):
    """What a page asks for is not in the run (yet)."""

    status = 404


def describe_problem(path: Path) -> str | None:
    """Why `path` is not a run directory asyncrl wrote, or None when it is one."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file, not a run directory (asyncrl-launch's trainer.output_dir)"
    if not any((path / f).exists() for f in ("config.yaml", "metrics.jsonl", "rollouts")):
        return (f"{path} is not a run directory: it has no config.yaml, metrics.jsonl or rollouts/ "
                "(pass trainer.output_dir of a run, e.g. outputs/quickstart)")
    return None


class JsonLines:
    """A JSON-lines file read from where the last read stopped: whole lines only (one still being
    written waits for its newline), never the whole file at once; `take` sees each new line and
    `reset` runs first when the file shrank (written again from the start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def refresh(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:
            self.offset = self.lines = 0
            self.reset()
        if size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                self.offset += len(line)
                self.lines += 1
                self.take(line)

    def reset(self) -> None:
        raise NotImplementedError

    def take(self, line: bytes) -> None:
        raise NotImplementedError


class Metrics(JsonLines):
    """metrics.jsonl as one (steps, values) column per metric, extended by `refresh`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reset()

    def reset(self) -> None:
        self.series: dict[str, tuple[array, array]] = {}
        self.problems: list[str] = []
        self.last_step = -1

    def take(self, line: bytes) -> None:
        try:
            row = json.loads(line)
            step = float(row["step"])
        except (ValueError, KeyError, TypeError):
            if line.strip():
                self.problems.append(f"metrics.jsonl line {self.lines}: not a JSON object with a step; skipped")
            return
        self.last_step = max(self.last_step, int(step))
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = self.series.setdefault(key, (array("d"), array("d")))
                steps.append(step)
                values.append(value)

    def points(self, key: str) -> tuple[list[float], list[float | None]]:
        """A metric's steps and values (a step written again: its last value), at most MAX_POINTS
        (means of equal runs of steps beyond); non-finite values as None."""
        steps, values = self.series.get(key, (array("d"), array("d")))
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):  # a resumed run wrote steps again
            last = dict(zip(steps, values, strict=True))
            steps, values = array("d", sorted(last)), array("d", (last[s] for s in sorted(last)))
        if len(steps) > MAX_POINTS:
            width = math.ceil(len(steps) / MAX_POINTS)
            steps = [sum(steps[i:i + width]) / len(steps[i:i + width]) for i in range(0, len(steps), width)]
            values = [_mean(values[i:i + width]) for i in range(0, len(values), width)]
        return list(steps), [v if math.isfinite(v) else None for v in values]


def _mean(xs: Any) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else math.nan


@dataclass(frozen=True)
class RolloutFile:
    path: Path
    rank: int
    first: int
    last: int
    mtime_ns: int


@dataclass
class Query:
    """A rollout table's filters, order and page (each from the page's URL)."""

    step_min: int | None = None
    step_max: int | None = None
    source: str = ""
    reward_min: float | None = None
    reward_max: float | None = None
    length_min: int | None = None
    length_max: int | None = None
    text: str = ""
    sort: str = "-step"
    page: int = 1
    per_page: int = PER_PAGE

    def check(self) -> None:
        if self.sort.lstrip("-") not in SORTS:
            raise RunError(f"sort={self.sort!r}: sort by one of {', '.join(SORTS)} (a leading - for descending)")
        if self.page < 1 or not 1 <= self.per_page <= 500:
            raise RunError("page starts at 1, and per_page is 1 to 500")
        for name in ("step_min", "step_max", "length_min", "length_max"):
            value = getattr(self, name)
            if value is not None and abs(value) >= 2**62:
                raise RunError(f"{name}={value}: out of range")
        for name in ("reward_min", "reward_max"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise RunError(f"{name}={value}: give a finite number")


@dataclass
class Table:
    rows: list[dict[str, Any]]
    more: bool  # rows past this page
    total: int | None  # matching rows, when the whole range was read
    problems: list[str] = field(default_factory=list)


class Rollouts:
    """The kept rollouts of a run: files found by name, small columns cached per file."""

    def __init__(self, run: Path) -> None:
        self.dir = run / "rollouts"
        self.files: dict[Path, RolloutFile] = {}
        self.owner: dict[tuple[int, int], RolloutFile] = {}  # (rank, step) -> the newest file that holds it
        self.steps: list[int] = []  # kept steps, ascending
        self.cache: dict[Path, tuple[int, Any]] = {}  # small columns, by file (its mtime when read)
        self.problems: dict[Path, str] = {}

    def refresh(self) -> None:
        found = {}
        for path in self.dir.glob("rank*/steps_*.parquet"):
            m, rank = ROLLOUT_FILE.fullmatch(path.name), path.parent.name.removeprefix("rank")
            if m is None or not rank.isdigit():
                continue
            try:
                mtime = path.stat().st_mtime_ns
            except FileNotFoundError:  # replaced while listed
                continue
            found[path] = RolloutFile(path, int(rank), int(m[1]), int(m[2]), mtime)
        if found == self.files:
            return
        self.files = found
        owner: dict[tuple[int, int], RolloutFile] = {}
        for f in sorted(found.values(), key=lambda f: (f.mtime_ns, f.path.name)):
            for step in range(f.first, f.last + 1):
                owner[(f.rank, step)] = f  # newer files last: theirs win
        self.owner = owner
        self.steps = sorted({s for _, s in owner})

    def scalars(self, f: RolloutFile) -> Any:
        """`f`'s small columns, only its rows whose step it owns (read once per file version)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        cached = self.cache.get(f.path)
        if cached is not None and cached[0] == f.mtime_ns:
            return cached[1]
        try:
            table = pq.read_table(f.path, columns=list(SCALARS), read_dictionary=["data_source", "finish_reason"])
        except (OSError, pa.ArrowException) as e:
            self.problems[f.path] = f"{f.path.relative_to(self.dir.parent)}: unreadable ({e}); its rows are left out"
            return None
        self.problems.pop(f.path, None)
        owned = [s for s in range(f.first, f.last + 1) if self.owner.get((f.rank, s)) is f]
        if len(owned) < f.last - f.first + 1:
            table = table.filter(pc.is_in(table["step"], pa.array(owned, pa.int64())))
        self.cache[f.path] = (f.mtime_ns, table)
        return table

    def in_range(self, lo: int | None, hi: int | None, descending: bool) -> list[RolloutFile]:
        """The files that own a step in [lo, hi], by their steps (newest first when `descending`)."""
        lo, hi = -1 if lo is None else lo, math.inf if hi is None else hi
        owners = {f.path: f for f in self.owner.values() if f.first <= hi and f.last >= lo}
        return sorted(owners.values(), key=lambda f: (f.last, f.rank), reverse=descending)

    def table(self, q: Query) -> Table:
        """The kept rows that pass `q`'s filters, in its order, its page of them with their text."""
        import pyarrow as pa
        import pyarrow.compute as pc

        q.check()
        key, descending = SORTS[q.sort.lstrip("-")], q.sort.startswith("-")
        by_step = key == "step"
        want = q.page * q.per_page + 1  # one past the page says whether there are more
        parts, count, complete, edge = [], 0, True, None
        for f in self.in_range(q.step_min, q.step_max, descending if by_step else True):
            if by_step and count >= want and (f.last < edge if descending else f.first > edge):
                complete = False  # every step the page can show is read (files of one range on all ranks)
                break
            table = self.scalars(f)
            if table is None or not table.num_rows:
                continue
            table = self._filter(f, table, q)
            if table.num_rows:
                parts.append(table)
                count += table.num_rows
                edge = (f.first if descending else f.last) if edge is None else (
                    min(edge, f.first) if descending else max(edge, f.last))
        if not parts:
            return Table([], False, 0, self.problem_list())
        rows = pa.concat_tables(parts, promote_options="default")  # chunks side by side: no copy
        way = "descending" if descending else "ascending"
        order = [("step", way)] if by_step else [(key, way), ("step", "descending")]
        index = pc.sort_indices(rows.select(list({k for k, _ in order} | {"rank", "row"})),
                                sort_keys=[*order, ("rank", "ascending"), ("row", "ascending")])
        page = rows.take(index.slice((q.page - 1) * q.per_page, q.per_page)).to_pylist()
        self._add_text(page)
        return Table(page, rows.num_rows > q.page * q.per_page, rows.num_rows if complete else None,
                     self.problem_list())

    def _filter(self, f: RolloutFile, table: Any, q: Query) -> Any:
        import pyarrow.compute as pc

        conds = []
        if q.step_min is not None:
            conds.append(pc.greater_equal(table["step"], q.step_min))
        if q.step_max is not None:
            conds.append(pc.less_equal(table["step"], q.step_max))
        if q.source:
            conds.append(pc.equal(table["data_source"], q.source))
        for col, lo, hi in (("reward", q.reward_min, q.reward_max), ("response_length", q.length_min, q.length_max)):
            if lo is not None:
                conds.append(pc.greater_equal(table[col], lo))
            if hi is not None:
                conds.append(pc.less_equal(table[col], hi))
        if q.text:
            text = self._text(f, ["prompt", "response"])
            if text is None:
                return table.slice(0, 0)
            found = {(s, r) for s, r, p, t in zip(*(text[c].to_pylist() for c in ("step", "row", "prompt", "response")),
                                                strict=True) if q.text.lower() in f"{p}\n{t}".lower()}
            conds.append(pc.is_in(_keys(table), _key_array(found)))
        if not conds:
            return table
        keep = conds[0]
        for c in conds[1:]:
            keep = pc.and_kleene(keep, c)
        return table.filter(pc.fill_null(keep, False))

    def _text(self, f: RolloutFile, columns: list[str]) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(f.path, columns=["step", "row", *columns])
        except (OSError, pa.ArrowException) as e:
            self.problems[f.path] = f"{f.path.relative_to(self.dir.parent)}: unreadable ({e}); its rows are left out"
            return None

    def _add_text(self, rows: list[dict[str, Any]]) -> None:
        """Each shown row's prompt and response (read from its file, for the page's rows only)."""
        by_file: dict[RolloutFile, list[dict[str, Any]]] = {}
        for r in rows:
            by_file.setdefault(self.owner[(r["rank"], r["step"])], []).append(r)
        for f, rs in by_file.items():
            text = self._text(f, ["prompt", "response"])
            got = {} if text is None else {(s, w): (p, t) for s, w, p, t in zip(
                *(text[c].to_pylist() for c in ("step", "row", "prompt", "response")), strict=True)}
            for r in rs:
                r["prompt"], r["response"] = got.get((r["step"], r["row"]), ("", ""))

    def row(self, step: int, rank: int, row: int) -> dict[str, Any]:
        """One kept rollout whole (its tokens and per-token numbers included)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        f = self.owner.get((rank, step))
        if f is None:
            raise NotFound(f"no kept rollout of step {step} on rank {rank} in {self.dir}")
        try:
            table = pq.read_table(f.path)
        except (OSError, pa.ArrowException) as e:
            raise RunError(f"{f.path}: unreadable ({e})") from None
        table = table.filter(pc.and_(pc.equal(table["step"], step), pc.equal(table["row"], row)))
        if not table.num_rows:
            raise NotFound(f"step {step}, rank {rank} kept no row {row} (see the step's table for its rows)")
        return table.slice(table.num_rows - 1).to_pylist()[0]

    def sources(self) -> list[str]:
        import pyarrow.compute as pc

        newest = sorted(self.owner.values(), key=lambda f: f.last)[-8:]  # the sources of the latest steps
        found = set()
        for f in newest:
            table = self.scalars(f)
            if table is not None and "data_source" in table.column_names:
                found.update(pc.unique(table["data_source"]).to_pylist())
        return sorted(s for s in found if s is not None)

    def problem_list(self) -> list[str]:
        return list(self.problems.values())


def _keys(table: Any) -> Any:
    import pyarrow.compute as pc

    return pc.add(pc.multiply(pc.cast(table["step"], "int64"), 1 << 20), pc.cast(table["row"], "int64"))


def _key_array(found: set[tuple[int, int]]) -> Any:
    import pyarrow as pa

    return pa.array([s * (1 << 20) + r for s, r in found], pa.int64())


class Samples(JsonLines):
    """samples.jsonl: each evaluation's held-out completions, by step."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reset()

    def reset(self) -> None:
        self.by_step: dict[int, list[dict[str, Any]]] = {}
        self.problems: list[str] = []

    def take(self, line: bytes) -> None:
        try:
            row = json.loads(line)
            self.by_step.setdefault(int(row["step"]), []).append(row)
        except (ValueError, KeyError, TypeError):
            if line.strip():
                self.problems.append("samples.jsonl: a line that is not a sample; skipped")


class Tokens:
    """Token ids as the run's tokenizer writes them (its newest export's, else model.path's)."""

    def __init__(self, run: Path, model_path: str | None) -> None:
        self.run, self.model_path, self.tokenizer, self.tried = run, model_path, None, False

    def pieces(self, ids: list[int]) -> list[str] | None:
        tok = self._load()
        return None if tok is None else [tok.decode([i], skip_special_tokens=False) or tok.id_to_token(i) or "" for i in ids]

    def _load(self) -> Any:
        if not self.tried:
            self.tried = True
            for path in self._candidates():
                try:
                    from tokenizers import Tokenizer

                    self.tokenizer = Tokenizer.from_file(str(path))
                    break
                except Exception:  # noqa: BLE001 - a file that is not a tokenizer: the next one, else ids
                    continue
        return self.tokenizer

    def _candidates(self) -> list[Path]:
        exports = sorted(self.run.glob("checkpoints/step_*/actor/hf/tokenizer.json"),
                         key=lambda p: int(p.parts[-4].removeprefix("step_")) if p.parts[-4][5:].isdigit() else -1)
        found = exports[::-1]
        if self.model_path:
            mp = Path(self.model_path)
            found += [p / "tokenizer.json" for p in ([mp] if mp.is_absolute() else [Path.cwd() / mp, self.run.parent / mp,
                                                                                     self.run.parent.parent / mp])]
        return [p for p in found if p.is_file()]


class Run:
    """One run directory: its parts read incrementally (`refresh`), safe to share between threads."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name
        self.lock = threading.Lock()
        self.metrics = Metrics(path / "metrics.jsonl")
        self.rollouts = Rollouts(path)
        self.samples = Samples(path / "samples.jsonl")
        self.problem: str | None = None
        self.config: dict[str, Any] = {}
        self.tokens = Tokens(path, None)
        self.refreshed = 0.0

    def refresh(self) -> None:
        """Read what the run wrote since the last refresh; a directory that is not a run says why."""
        with self.lock:
            self.problem = describe_problem(self.path)
            if self.problem is not None:
                return
            if not self.config:
                self._read_config()
            for part in (self.metrics, self.rollouts, self.samples):
                try:
                    part.refresh()
                except OSError as e:
                    self.problem = f"{self.path}: cannot read ({e})"

    def _read_config(self) -> None:
        import yaml

        try:
            cfg = yaml.safe_load((self.path / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return
        if isinstance(cfg, dict):
            self.config = cfg
            self.tokens = Tokens(self.path, (cfg.get("model") or {}).get("path"))

    def writing(self) -> bool:
        """Whether the run's launcher holds its directory now (.lock names a live process here)."""
        try:
            text = (self.path / ".lock").read_text().split()
            return len(text) >= 2 and text[0] == "pid" and _alive(int(text[1]))
        except (OSError, ValueError):
            return False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "problem": self.problem, "writing": self.writing(),
                "last_step": self.metrics.last_step, "kept_steps": len(self.rollouts.steps),
                "last_kept_step": self.rollouts.steps[-1] if self.rollouts.steps else None,
                "metrics_lines": self.metrics.lines, "evaluations": len(self.samples.by_step)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_runs(paths: list[str]) -> list[Run]:
    """A Run for each path, named by its directory (with as much of its parent as tells them apart)."""
    resolved = [Path(p).expanduser().resolve() for p in paths]
    names = [p.name for p in resolved]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in resolved]
    return [Run(p, n) for p, n in zip(resolved, names, strict=True)]
