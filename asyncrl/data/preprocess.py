"""Turn the published files of datasets the built-in rewards know into verl-layout parquet.

    python -m asyncrl.data.preprocess gsm8k --input test.jsonl --output data/gsm8k/test.parquet
    python -m asyncrl.data.preprocess math --input MATH/test --output data/math/test.parquet

Nothing is downloaded: `--input` is a file you fetched (GSM8K: openai/grade-school-math's
`train.jsonl`/`test.jsonl`, or the Hub's parquet; MATH: Hendrycks et al.'s directory of per-problem
JSON files, or a jsonl/parquet of them). Rows get `data_source` (the reward's key), `prompt` as
chat messages with an instruction on how to state the final answer, `reward_model.ground_truth`,
and `extra_info` (split, index, the original fields). An existing `--output` is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.data.dataset import DatasetError, load_rows
from asyncrl.data.synthetic import write_rows

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    r"""The contents of the last \boxed{...} (or \fbox{...}) in `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def gsm8k_row(raw: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """One GSM8K problem: the answer is what follows "####" in its worked solution."""
    try:
        question, solution = raw["question"], raw["answer"]
    except KeyError as e:
        raise DatasetError(f"GSM8K row {index} has no {e} field (fields: {sorted(raw)})") from None
    if "####" not in solution:
        raise DatasetError(f"GSM8K row {index}: its answer has no '#### <number>' line")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": final},
            "extra_info": {"split": split, "index": index, "question": question, "answer": solution}}


def math_row(raw: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """One MATH problem: the answer is the last \\boxed{} of its solution."""
    try:
        problem, solution = raw["problem"], raw["solution"]
    except KeyError as e:
        raise DatasetError(f"MATH row {index} has no {e} field (fields: {sorted(raw)})") from None
    final = last_boxed(solution)
    if final is None:
        raise DatasetError(f"MATH row {index}: its solution has no \\boxed{{...}} answer")
    return {"data_source": "hendrycks/math",
            "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": final},
            "extra_info": {"split": split, "index": index, "level": raw.get("level"), "type": raw.get("type"),
                           "solution": solution}}


DATASETS = {"gsm8k": gsm8k_row, "math": math_row}


def read_input(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a jsonl/json/parquet file, or of every *.json file under a directory (MATH's layout)."""
    if path.is_dir():
        files = sorted(path.rglob("*.json"))
        if not files:
            raise DatasetError(f"{path} holds no .json files")
        for f in files:
            yield json.loads(f.read_text())
        return
    yield from load_rows(path)


def convert(dataset: str, src: Path, out: Path, split: str) -> int:
    if out.exists():
        raise FileExistsError(f"{out} exists; pick another --output (it was left as it is)")
    make = DATASETS[dataset]
    rows = [make(raw, i, split) for i, raw in enumerate(read_input(src))]
    if not rows:
        raise DatasetError(f"{src} holds no rows")
    write_rows(rows, out)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.data.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--input", required=True, type=Path, help="the published file (or MATH's directory)")
    parser.add_argument("--output", required=True, type=Path, help="a new .parquet (or .jsonl) file")
    parser.add_argument("--split", default=None, help="recorded in extra_info (default: from the input's name)")
    args = parser.parse_args(argv)
    split = args.split or ("test" if "test" in args.input.name else "train")
    try:
        n = convert(args.dataset, args.input, args.output, split)
    except (DatasetError, FileExistsError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"preprocess: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
