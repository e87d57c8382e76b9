"""Built-in synthetic tasks: deterministic prompts + ground truth in verl's row layout.

Every task speaks a closed word-level vocabulary (space-separated symbols), so the tiny model's
tokenizer covers it exactly, and every answer is a short space-separated symbol sequence scored
position by position (partial credit), which keeps the RL signal dense.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DIGITS = tuple(str(d) for d in range(10))
LETTERS = tuple("abcdefgh")


@dataclass(frozen=True)
class SyntheticTask:
    """A task: its symbols, and a generator of (prompt text, answer text) from a `random.Random`."""

    name: str
    symbols: tuple[str, ...]
    make: Callable[[random.Random], tuple[str, str]]
    max_answer_tokens: int
    answer_symbols: tuple[str, ...]
    # words only this task uses, kept out of the shared vocabulary (a tiny model built for another
    # task keeps the vocabulary, and so the random init, it had before the task was added)
    own_words: tuple[str, ...] = ()
    images: bool = False  # `make` also draws the prompt's image (PNG bytes): a vision-language task

    @property
    def data_source(self) -> str:
        return f"asyncrl/{self.name}"


def _digits(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(10) for _ in range(k)]


def _sum(rng: random.Random) -> tuple[str, str]:
    # a + b with two-digit operands; answer digits most-significant first, e.g. "1 0 7"
    a, b = rng.randrange(100), rng.randrange(100)
    question = " ".join([*str(a), "+", *str(b), "="])
    return question, " ".join(str(a + b))


def _max(rng: random.Random) -> tuple[str, str]:
    xs = _digits(rng, 5)
    return " ".join(["max", *map(str, xs)]), str(max(xs))


def _sort(rng: random.Random) -> tuple[str, str]:
    xs = _digits(rng, 4)
    return " ".join(["sort", *map(str, xs)]), " ".join(map(str, sorted(xs)))


def _copy(rng: random.Random) -> tuple[str, str]:
    xs = [rng.choice(LETTERS) for _ in range(4)]
    return " ".join(["copy", *xs]), " ".join(xs)


def _reverse(rng: random.Random) -> tuple[str, str]:
    xs = [rng.choice(LETTERS) for _ in range(4)]
    return " ".join(["reverse", *xs]), " ".join(reversed(xs))


def _copy_tail(rng: random.Random) -> tuple[str, str]:
    # long-tailed answer lengths (most 1-4 symbols, one in seven 5-16): a batch's generation
    # waits for its longest answer, which is what asynchronous RL hides
    k = rng.randint(1, 4) if rng.random() < 6 / 7 else rng.randint(5, 16)
    xs = [rng.choice(LETTERS) for _ in range(k)]
    return " ".join(["copy", *xs]), " ".join(xs)


def lookup_value(key: str) -> str:
    """The digit the `lookup` tool returns for `key`: a hash, so no model can work it out."""
    import hashlib

    return str(hashlib.sha256(f"asyncrl-lookup:{key}".encode()).digest()[0] % 10)


def _lookup(rng: random.Random) -> tuple[str, str]:
    # "lookup c a f" -> the digit only the tool knows (asyncrl.agents.tasks.LookupEnvironment): a
    # model that answers without calling it is right one time in ten
    key = " ".join(rng.choice(LETTERS) for _ in range(3))
    return f"lookup {key}", lookup_value(key)


SQUARE_WORDS = ("<image>", "how", "many", "squares", "?")


def _squares(rng: random.Random) -> tuple[str, str, bytes]:
    """A 56x56 picture (a 4x4 grid of 14-pixel cells, Qwen2.5-VL's patches) with 1-4 red squares
    in random cells: how many?"""
    count = rng.randint(1, 4)
    return "<image> how many squares ?", str(count), squares_png(rng.sample(range(16), count))


def squares_png(cells: list[int], colour: tuple[int, int, int] = (220, 40, 40)) -> bytes:
    """PNG bytes of a white 56x56 image with a 10-pixel square in each of `cells` (of a 4x4 grid)."""
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    for cell in cells:
        x, y = 14 * (cell % 4) + 2, 14 * (cell // 4) + 2
        draw.rectangle([x, y, x + 9, y + 9], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


TASKS: dict[str, SyntheticTask] = {
    t.name: t
    for t in (
        SyntheticTask("sum", (*DIGITS, "+", "="), _sum, 3, DIGITS),
        SyntheticTask("max", (*DIGITS, "max"), _max, 1, DIGITS),
        SyntheticTask("sort", (*DIGITS, "sort"), _sort, 4, DIGITS),
        SyntheticTask("copy", (*LETTERS, "copy"), _copy, 4, LETTERS),
        SyntheticTask("reverse", (*LETTERS, "reverse"), _reverse, 4, LETTERS),
        SyntheticTask("copy_tail", (*LETTERS, "copy"), _copy_tail, 16, LETTERS),
        SyntheticTask("lookup", (*LETTERS, *DIGITS), _lookup, 1, DIGITS, own_words=("lookup", "call")),
        SyntheticTask("squares", DIGITS, _squares, 1, ("1", "2", "3", "4"), own_words=SQUARE_WORDS, images=True),
    )
}


def get_task(name: str) -> SyntheticTask:
    """The task called `name` (also accepts its data_source, e.g. "asyncrl/sort")."""
    key = name.removeprefix("asyncrl/")
    if key not in TASKS:
        raise KeyError(f"unknown synthetic task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[key]


def all_symbols(task: str | None = None) -> list[str]:
    """Every task's shared symbols in a stable order (the tiny tokenizer's content vocabulary),
    then `task`'s own words."""
    seen: dict[str, None] = {}
    for spec in TASKS.values():
        seen.update(dict.fromkeys(spec.symbols))
    if task is not None:
        seen.update(dict.fromkeys(get_task(task).own_words))
    return list(seen)


def score_answer(solution: str, ground_truth: str) -> float:
    """Fraction of answer positions right, over the longer of the two (1.0 only when exact)."""
    pred, gold = solution.split(), ground_truth.split()
    if not pred or not gold:
        return 0.0
    hits = sum(p == g for p, g in zip(pred, gold, strict=False))
    return hits / max(len(pred), len(gold))


def make_examples(task: str, n: int, seed: int) -> list[tuple]:
    """`n` (prompt, answer) pairs (and an image's PNG bytes for a task with images), a pure
    function of (task, n, seed)."""
    spec = get_task(task)
    rng = random.Random(f"{spec.name}:{seed}")
    return [spec.make(rng) for _ in range(n)]


def make_rows(task: str, n: int, seed: int, split: str = "train") -> list[dict]:
    """`n` rows in verl's layout: prompt as chat messages, reward_model.ground_truth, extra_info."""
    spec = get_task(task)
    return [
        {
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": prompt}],
            **({"images": [{"bytes": picture[0], "path": None}]} if picture else {}),
            "ability": "synthetic",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i, "answer": answer},
        }
        for i, (prompt, answer, *picture) in enumerate(make_examples(task, n, seed))
    ]


def row_key(row: dict) -> tuple:
    """What makes a row's prompt the same as another's: its text and its images' bytes."""
    return row["prompt"][0]["content"], tuple(image["bytes"] for image in row.get("images", ()))


def disjoint_splits(task: str, n_train: int, n_val: int, seed: int) -> tuple[list, list]:
    """Train and validation rows with no prompt in both (val is drawn first, from its own seed)."""
    val = make_rows(task, n_val, seed + 1_000_003, "test")
    held = {row_key(r) for r in val}
    train: list[dict] = []
    rng_seed = seed
    while len(train) < n_train:
        batch = make_rows(task, 2 * (n_train - len(train)) + 16, rng_seed, "train")
        train.extend(r for r in batch if row_key(r) not in held)
        rng_seed += 7919
    train = train[:n_train]
    for i, row in enumerate(train):
        row["extra_info"]["index"] = i
    return train, val


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as parquet (by suffix .parquet) or jsonl (anything else)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return path


def write_dataset(
    out_dir: str | Path,
    task: str = "sort",
    *,
    n_train: int = 4096,
    n_val: int = 256,
    seed: int = 0,
    fmt: str = "parquet",
) -> dict[str, Path]:
    """Write `train.<fmt>` and `test.<fmt>` (prompts disjoint) under `out_dir`; return the paths."""
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"fmt must be 'parquet' or 'jsonl', not {fmt!r}")
    train, val = disjoint_splits(task, n_train, n_val, seed)
    out = Path(out_dir)
    return {
        "train": write_rows(train, out / f"train.{fmt}"),
        "test": write_rows(val, out / f"test.{fmt}"),
    }


def main(argv: list[str] | None = None) -> None:
    """CLI: python -m asyncrl.data.synthetic OUT_DIR [--task sort] [--n-train N] [--n-val N]."""
    p = argparse.ArgumentParser(description="Write a synthetic task's train/test files.")
    p.add_argument("out_dir")
    p.add_argument("--task", default="sort", choices=sorted(TASKS))
    p.add_argument("--n-train", type=int, default=4096)
    p.add_argument("--n-val", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", dest="fmt", default="parquet", choices=("parquet", "jsonl"))
    a = p.parse_args(argv)
    files = write_dataset(a.out_dir, a.task, n_train=a.n_train, n_val=a.n_val, seed=a.seed,
                          fmt=a.fmt)
    print(json.dumps({k: str(v) for k, v in files.items()}))


if __name__ == "__main__":
    main()
