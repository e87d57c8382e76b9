"""The HF export of a trained model: safetensors files as `save_pretrained` writes them, written
while the tensors are gathered one at a time (with LoRA: the merged weights, and the adapter as a
PEFT directory beside them)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from asyncrl.train.common import full_tensor
from asyncrl.train.experts import expert_names, per_expert
from asyncrl.train.lora import (
    adapter_scales,
    is_lora_param,
    merged_weight,
    save_peft_adapter,
    vision_prefixes,
)

log = logging.getLogger(__name__)
EXPORT_SHARD_BYTES = 2 << 30  # the HF export's safetensors files: rank 0 holds one (asyncrl.plan.memory counts it)


def export_streamed(model: nn.Module, out_dir: Path, tied: set[str], tokenizer: Any, dtype: torch.dtype | None,
                    lora: dict[str, Any] | None = None) -> None:
    """The HF export gathered one tensor at a time (a collective: every rank runs it), rank 0
    writing a file whenever a shard is full: never the whole model on one rank. `tied`: names
    written once under another; `lora`: the adapter's settings (its PEFT export beside `out_dir` unless base_model is None)."""
    if not hasattr(getattr(model, "config", None), "save_pretrained"):  # the same answer on every rank
        log.warning("%s has no HF config; skipping the HF export", type(model).__name__)
        return
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    writer = ShardWriter(out_dir, EXPORT_SHARD_BYTES) if rank0 else None
    if writer is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    scales = adapter_scales(model)  # LoRA: each adapted weight exported merged
    names = expert_names(model.config)
    adapter: dict[str, Tensor] = {}
    state = model.state_dict()
    for name, value in state.items():
        if name in tied or is_lora_param(name):
            continue
        full = full_tensor(value)
        module = name.removesuffix(".weight")
        if module in scales:  # W0 + (alpha / rank) B A, in fp32 from the frozen base, cast once
            a, b = full_tensor(state[f"{module}.lora_A"]), full_tensor(state[f"{module}.lora_B"])
            full = merged_weight(full, a, b, scales[module], torch.float32)
            adapter.update({f"{module}.lora_A": a, f"{module}.lora_B": b})
        if writer is not None:
            cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
            for disk_name, t in per_expert(name, full.detach(), names):  # experts as checkpoints hold them
                writer.add(disk_name, t.to("cpu", cast).contiguous())
        del full
    if writer is not None:
        writer.close()
        write_hf_files(model, out_dir, tokenizer, dtype)
        if adapter and lora is not None and lora["base_model"] is not None:  # the adapter alone, as PEFT loads it
            heads = [n.removesuffix(".weight") for n in tied]  # a head sharing the embedding's matrix
            save_peft_adapter(out_dir.parent / "adapter", adapter, base_model=lora["base_model"],
                              tied_head=heads[0] if heads else None, vision=bool(vision_prefixes(model)),
                              **{k: v for k, v in lora.items() if k != "base_model"})


def export_full(model: nn.Module, out_dir: Path, full_sd: dict[str, Tensor], tied: set[str], tokenizer: Any,
                dtype: torch.dtype | None = None) -> None:
    """The HF export of a state dict already gathered on this rank (pipeline stages meet on rank 0)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        log.warning("%s has no HF config; skipping the HF export", type(model).__name__)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, full in full_sd.items() if k not in tied
               for name, v in per_expert(k, full, expert_names(config))}
    write_safetensors(tensors, out_dir, EXPORT_SHARD_BYTES)
    write_hf_files(model, out_dir, tokenizer, dtype)


def write_hf_files(model: nn.Module, out_dir: Path, tokenizer: Any, dtype: torch.dtype | None) -> None:
    """config.json (with the export's dtype), generation_config.json and the tokenizer."""
    config = model.config
    if dtype is not None:  # what from_pretrained(dtype="auto") loads it as
        config.torch_dtype = dtype
    config.save_pretrained(out_dir)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    copy_processor_files(Path(getattr(config, "_name_or_path", "") or ""), out_dir)


# what a vision-language model's image processor (and processor) load from, beside the tokenizer
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def copy_processor_files(source: Path, out_dir: Path) -> None:
    """The source model directory's image processor files, so the export reads images as it did."""
    for name in PROCESSOR_FILES:
        if str(source) and (source / name).is_file() and (source / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(source / name, out_dir / name)


class ShardWriter:
    """Safetensors files of at most `max_shard_bytes`, written as tensors are added: one file,
    `model.safetensors`, or `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`
    (the layout `save_pretrained` writes and `from_pretrained` reads). Writers in several
    processes (`prefix` apart) `flush` their files and one of them names them all (`name_shards`)."""

    def __init__(self, out_dir: Path, max_shard_bytes: int, prefix: str = ".shard") -> None:
        self.out_dir, self.max_shard_bytes, self.prefix = out_dir, max_shard_bytes, prefix
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
        path = self.out_dir / f"{self.prefix}-{len(self.written) + 1:05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def flush(self) -> list[tuple[Path, list[str]]]:
        """Write what is left; the files written and the tensors in each (not yet named)."""
        if self.current:
            self._flush()
        return self.written

    def close(self) -> list[Path]:
        """Write what is left and name the files; returns them."""
        if self.current or not self.written:
            self._flush()
        return name_shards(self.out_dir, self.written, self.total)


def name_shards(out_dir: Path, written: list[tuple[Path, list[str]]], total: int) -> list[Path]:
    """Rename written shard files to HF's names, with the index when there are several."""
    if len(written) == 1:
        final = out_dir / "model.safetensors"
        written[0][0].rename(final)
        return [final]
    files, weight_map = [], {}
    for i, (path, names) in enumerate(written, 1):
        final = out_dir / f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(final)
        files.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def write_safetensors(tensors: dict[str, Tensor], out_dir: Path, max_shard_bytes: int) -> list[Path]:
    """`tensors` as `ShardWriter` files."""
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    return writer.close()
