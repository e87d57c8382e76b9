"""The HF export of a Megatron model, streamed: each pipeline stage's first TP and DP rank writes
its stage's tensors (gathered over TP, and experts over EP, one weight at a time, never the whole
model on a rank) and
rank 0 names the files and writes the config, the index and the tokenizer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.train.export import EXPORT_SHARD_BYTES, ShardWriter, name_shards, write_hf_files
from asyncrl.train.pipeline import all_gather_values


def export_hf(engine: Any, out_dir: Path, tokenizer: Any, dtype: torch.dtype | None) -> None:
    """`out_dir` as `save_pretrained` writes it (a collective over the engine's ranks)."""
    writes = engine.tp_rank == 0 and dist.get_rank(engine.dp_group) == 0
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, EXPORT_SHARD_BYTES, prefix=f".stage{engine.pp_rank}") if writes else None
    local, seen = engine.local_tensors(), set()
    for i, rule in enumerate(engine.rules):
        if rule.megatron == "output_layer.weight" and engine.shape.tied:
            continue  # a later stage's copy of the tied embedding: the first stage writes it
        for name, t in engine.hf_state(i, local[rule.megatron]).items():  # every EP rank's experts
            if writer is not None and name not in seen:
                seen.add(name)
                writer.add(name, (t.to(dtype) if dtype is not None else t).cpu().contiguous())
    written = writer.flush() if writer is not None else []
    everyone = all_gather_values([(str(p), names) for p, names in written], None, engine.device)
    if dist.get_rank() == 0:
        files = [(Path(p), names) for stage in everyone for p, names in stage]
        total = sum(Path(p).stat().st_size for p, _ in files)  # safetensors sizes bound the index's total
        name_shards(out_dir, files, total)
        write_hf_files(SimpleNamespace(config=engine.hf_config), out_dir, tokenizer, dtype)
    dist.barrier()
