"""Mixture-of-experts weights on disk and in memory: transformers 5 keeps a MoE layer's experts
fused in memory (`experts.gate_up_proj` [E, 2I, H] with each expert's gate rows before its up
rows, `experts.down_proj` [E, H, I]) and per expert in checkpoints (`experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`; what vLLM and other loaders read). asyncrl's loaders fuse, its exports
and weight syncs write per expert."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import Tensor

PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def fuse_experts(tensors: dict[str, Tensor], wanted: set[str]) -> None:
    """Replace, in place, the per-expert tensors of every fused name in `wanted` by the fused one."""
    groups: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name in list(tensors):
        m = PER_EXPERT.match(name)
        if m and f"{m['prefix']}.gate_up_proj" in wanted:
            groups.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"])] = tensors.pop(name)
    for prefix, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in experts])
        tensors[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in experts])


def per_expert(name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """A tensor by checkpoint names: a fused expert tensor as one tensor per expert, others as they are."""
    m = FUSED.match(name)
    if m is None:
        yield name, tensor
        return
    for e, t in enumerate(tensor.unbind(0)):
        if m["proj"] == "down_proj":
            yield f"{m['prefix']}.{e}.down_proj.weight", t
        else:
            gate, up = t.chunk(2)
            yield f"{m['prefix']}.{e}.gate_proj.weight", gate
            yield f"{m['prefix']}.{e}.up_proj.weight", up
