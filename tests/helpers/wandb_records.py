"""Read what an offline wandb run wrote: the records of its `run-<id>.wandb` file.

The file is a LevelDB-style log (wandb's own format since its first releases): a 7-byte header
(":W&B", a magic number and a version), then 32 KiB blocks of records, each with a 7-byte header
(CRC-32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last piece) and a protobuf
`Record`. wandb 0.31 dropped its own Python reader, so the tests carry this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a wandb run file")
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pieces = chunk
        elif kind == MIDDLE:
            pieces += chunk
        elif kind == LAST:
            yield pieces + chunk


def records(run_dir: Path) -> list[Any]:
    """Every record of the offline run in `run_dir` (a `wandb/offline-run-*` folder)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    out = []
    for payload in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def history(run_dir: Path) -> list[dict[str, str]]:
    """The logged rows (`wandb.log`), each as {key: JSON text}; nested keys joined with '/'."""
    return [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            for r in records(run_dir) if r.WhichOneof("record_type") == "history"]


def run_info(run_dir: Path) -> Any:
    """The run record: id, project, display name, config."""
    return next(r.run for r in records(run_dir) if r.WhichOneof("record_type") == "run")
