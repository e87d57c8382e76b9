"""Safetensors files as `save_pretrained` writes them, written while the tensors are gathered."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor


class ShardWriter:
    """Safetensors files of at most `max_shard_bytes`, written as tensors are added: one file,
    `model.safetensors`, or `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`
    (the layout `save_pretrained` writes and `from_pretrained` reads)."""

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.current: dict[str, Tensor] = {}
        self.size = self.total = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.max_shard_bytes:
            self._flush()
        self.current[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self.written) + 1:05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> list[Path]:
        """Write what is left and name the files; returns them."""
        if self.current or not self.written:
            self._flush()
        if len(self.written) == 1:
            final = self.out_dir / "model.safetensors"
            self.written[0][0].rename(final)
            return [final]
        files, weight_map = [], {}
        for i, (path, names) in enumerate(self.written, 1):
            final = self.out_dir / f"model-{i:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return files


def write_safetensors(tensors: dict[str, Tensor], out_dir: Path, max_shard_bytes: int) -> list[Path]:
    """`tensors` as `ShardWriter` files."""
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    return writer.close()
