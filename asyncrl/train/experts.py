"""Mixture-of-experts weights on disk and in memory: transformers 5 keeps a MoE layer's experts
fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H] with each expert's gate rows before its
up rows, `mlp.experts.down_proj` [E, H, I]) and per expert in checkpoints, under each family's
names (`ExpertNames`: Qwen's `mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`;
Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` / `w2` and `block_sparse_moe.gate`; what vLLM
and other loaders read). asyncrl's loaders fuse, its exports and weight syncs write per expert."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

FUSED = re.compile(r"^(?P<prefix>.*)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertNames:
    """How a model family's checkpoints name a MoE block and its experts' projections."""

    block: str  # the block's module name on disk (in memory transformers 5 calls it `mlp`)
    gate: str
    up: str
    down: str

    def per_expert(self) -> re.Pattern:
        projs = "|".join((self.gate, self.up, self.down))
        return re.compile(rf"^(?P<prefix>.*)\.{self.block}\.experts\.(?P<e>\d+)\.(?P<proj>{projs})\.weight$")


QWEN = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
_FAMILIES = {"mixtral": MIXTRAL, "minimax": MIXTRAL}


def expert_names(config: Any) -> ExpertNames:
    """The checkpoint names of a Hugging Face config's family (Qwen's for every other MoE)."""
    return _FAMILIES.get(getattr(config, "model_type", None), QWEN)


def expert_names_at(path: str | Path) -> ExpertNames:
    """The checkpoint names of the model directory at `path` (from its config.json)."""
    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return _FAMILIES.get(model_type, QWEN)


def fuse_experts(tensors: dict[str, Tensor], wanted: set[str] | None, names: ExpertNames = QWEN) -> None:
    """Replace, in place, the per-expert tensors of every fused name in `wanted` (None: of every
    layer found) by the fused one (and a family's other block names, e.g. Mixtral's router, by
    the in-memory ones)."""
    if names.block != "mlp":
        for name in [n for n in tensors if f".{names.block}." in n]:
            tensors[name.replace(f".{names.block}.", ".mlp.")] = tensors.pop(name)
    pattern, projs = ExpertNames("mlp", names.gate, names.up, names.down).per_expert(), (names.gate, names.up, names.down)
    groups: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name in list(tensors):
        m = pattern.match(name)
        if m and (wanted is None or f"{m['prefix']}.mlp.experts.gate_up_proj" in wanted):
            groups.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"])] = tensors.pop(name)
    gate, up, down = projs
    for prefix, parts in groups.items():  # the experts present, in order (an expert-parallel rank holds a block)
        experts = sorted({e for e, _ in parts})
        tensors[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, gate)], parts[(e, up)]]) for e in experts])
        tensors[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts[(e, down)] for e in experts])


def in_memory_names(names: list[str], family: ExpertNames = QWEN) -> list[str]:
    """Checkpoint names as the model holds them: each layer's per-expert tensors as its two fused
    ones (in order of first appearance), the family's block renamed to `mlp`."""
    pattern, out = family.per_expert(), {}
    for name in names:
        m = pattern.match(name)
        if m is None:
            out[name.replace(f".{family.block}.", ".mlp.")] = None
        else:
            fused = "down_proj" if m["proj"] == family.down else "gate_up_proj"
            out[f"{m['prefix']}.mlp.experts.{fused}"] = None
    return list(out)


def per_expert(name: str, tensor: Tensor, names: ExpertNames = QWEN) -> Iterator[tuple[str, Tensor]]:
    """A tensor by checkpoint names: a fused expert tensor as one tensor per expert, others as they
    are (under the family's block name)."""
    m = FUSED.match(name)
    if m is None:
        yield (name.replace(".mlp.", f".{names.block}.") if names.block != "mlp" else name), tensor
        return
    experts = f"{m['prefix']}.{names.block}.experts"
    for e, t in enumerate(tensor.unbind(0)):
        if m["proj"] == "down_proj":
            yield f"{experts}.{e}.{names.down}.weight", t
        else:
            gate, up = t.chunk(2)
            yield f"{experts}.{e}.{names.gate}.weight", gate
            yield f"{experts}.{e}.{names.up}.weight", up
