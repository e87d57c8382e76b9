"""Tensor parallelism for Hugging Face Llama/Qwen2-family decoders with torch DTensor,
torchtitan style: `apply_tp(model, tp_mesh)` before `apply_fsdp(model, dp_mesh)`.

The plan (Megatron's split, expressed as DTensor placements on the `tp` mesh dim):

- attention q/k/v and MLP gate/up: `ColwiseParallel` (weight `Shard(0)`: each rank owns a
  slice of heads / of the intermediate size);
- attention o and MLP down: `RowwiseParallel` (weight `Shard(1)`, output all-reduced);
- token embedding: `RowwiseParallel` over the vocabulary (weight `Shard(0)`), and the LM head
  `ColwiseParallel` gathered back to full-vocabulary logits (weight `Shard(0)`), when the
  vocabulary divides by the TP size; otherwise both stay replicated;
- RMSNorm weights (hidden-size vectors) stay replicated.

Attention modules keep reading `-1` heads from their inputs, so the per-rank head count is the
local one; `check_tp` says what to change when the model's sizes do not divide by the TP size.
`tp_shard_dim(param)` is the contract the reshard (`asyncrl.train.reshard`) reads back.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from asyncrl.train.common import EngineError, find_blocks

log = logging.getLogger(__name__)

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise EngineError(f"{type(model).__name__} has no HF config; tensor parallelism supports "
                          "Hugging Face Llama/Qwen2-family causal LMs")
    return config


def check_tp(model: nn.Module, tp: int) -> None:
    """Raise `EngineError` naming the size that does not divide by `tp`."""
    config = _config(model)
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise EngineError(f"tensor parallel size {tp} must divide the model's {', '.join(bad)}; "
                          f"choose parallel.tp among the common divisors, or 1")
    blocks = find_blocks(model)
    missing = [name for name in (*COLWISE, *ROWWISE) if blocks and blocks[0].get_submodule(name) is None]
    if not blocks or missing:
        raise EngineError(f"{type(model).__name__}: tensor parallelism needs decoder layers at "
                          "model.model.layers with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj "
                          "(the Llama/Qwen2 family)")


def shards_vocab(model: nn.Module, tp: int) -> bool:
    """Whether `apply_tp` splits the embedding and LM head over the vocabulary."""
    return _config(model).vocab_size % tp == 0


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Parallelise `model` in place over the 1-D `tp_mesh` (see the module docstring)."""
    tp = tp_mesh.size()
    check_tp(model, tp)
    layer_plan = {**{name: ColwiseParallel() for name in COLWISE},
                  **{name: RowwiseParallel() for name in ROWWISE}}
    for block in find_blocks(model):
        parallelize_module(block, tp_mesh, layer_plan)
    tied = getattr(_config(model), "tie_word_embeddings", False)
    if shards_vocab(model, tp):
        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        top_plan = {}
        for name, module in model.named_modules():
            if module is embed:
                top_plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            elif module is head:
                top_plan[name] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, tp_mesh, top_plan)
        if tied and head is not None:
            head.weight = embed.weight  # both are Shard(0) over the vocabulary: re-tie
    else:
        log.info("vocabulary %d does not divide by tp=%d: embedding and LM head stay replicated",
                 _config(model).vocab_size, tp)
    log.info("tensor parallel over %d ranks: %d blocks", tp, len(find_blocks(model)))
    return model


def planned_shard_dim(name: str, model: nn.Module, tp: int) -> int | None:
    """The dim `apply_tp(model, <tp ranks>)` splits parameter `name` along (None: replicated):
    the plan read without a mesh, for weights this rank never holds (other pipeline stages)."""
    if tp == 1:
        return None
    module, _, leaf = name.rpartition(".")
    if module.endswith(COLWISE):
        return 0
    if module.endswith(ROWWISE):
        return 1 if leaf == "weight" else None
    if shards_vocab(model, tp):
        vocab = {m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
        if any(mod is m for n, mod in model.named_modules() if n == module for m in vocab):
            return 0
    return None


def tp_shard_dim(param: Any, tp_dim_name: str = "tp") -> int | None:
    """The tensor dim `param` is split along on the mesh dim `tp_dim_name` (None: replicated)."""
    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    if tp_dim_name not in names:
        return None
    placement = param.placements[names.index(tp_dim_name)]
    return placement.dim if isinstance(placement, Shard) else None


__all__ = ["apply_tp", "check_tp", "planned_shard_dim", "shards_vocab", "tp_shard_dim"]
