"""Megatron checkpoints in Hugging Face space: every parameter's fp32 master weight and Adam
moments by HF name (`param/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>`), one safetensors file
per pipeline stage (or more, of at most 2 GiB). A checkpoint so written resumes exactly in any tp × pp × dp layout: each rank
reads the parts its new shards cover (the same mapping as the weights), and its data-parallel
slice of them goes into the distributed optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.train.megatron.convert import Rule, SafetensorsReader, megatron_shard

STATES = ("param", "exp_avg", "exp_avg_sq")


def _owner(engine: Any, param: Tensor) -> tuple[Any, Any] | None:
    """The distributed optimizer that holds part of `param` on this DP rank, and which part."""
    for opt in engine._optimizers():
        if param in opt.model_param_group_index_map:
            return opt, opt._get_model_param_range_map(param)["param"]
    return None


def _full_states(engine: Any, param: Tensor, expert: bool) -> dict[str, Tensor]:
    """`param`'s fp32 master and moments over this rank's whole TP shard (a sum over the DP ranks
    that shard it: an expert's over the expert-data-parallel ranks)."""
    flat = {k: torch.zeros(param.numel(), dtype=torch.float32, device=param.device) for k in STATES}
    owner = _owner(engine, param)
    if owner is not None:
        opt, part = owner
        for k, v in opt._get_main_param_and_optimizer_states(param).items():
            if k in flat:
                flat[k][part.start:part.end] = v.detach().float().reshape(-1)
    for t in flat.values():
        dist.all_reduce(t, group=engine.experts.dp_group if expert else engine.dp_group)
    return {k: t.view(param.shape) for k, t in flat.items()}


def save_optimizer(engine: Any, out: Path) -> None:
    """Every stage's masters and moments by HF name (a collective over the engine's ranks; the
    first TP and DP rank of each stage writes them, a weight at a time, to `stage{s}-*.safetensors`)."""
    from asyncrl.train.export import EXPORT_SHARD_BYTES, ShardWriter

    writes = engine.tp_rank == 0 and dist.get_rank(engine.dp_group) == 0
    if writes:
        out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, EXPORT_SHARD_BYTES, prefix=f"stage{engine.pp_rank}") if writes else None
    params = engine.local_tensors()
    for i, rule in enumerate(engine.rules):
        for state, full in _full_states(engine, params[rule.megatron], ".local_experts." in rule.megatron).items():
            for name, t in engine.hf_state(i, full).items():
                if writer is not None:
                    writer.add(f"{state}/{name}", t.cpu().contiguous())
    if writer is not None:
        writer.flush()


def adam_step(engine: Any) -> float:
    """Adam's step count (the same for every parameter)."""
    for opt in engine._optimizers():
        for moments in opt.optimizer.state.values():
            if "step" in moments:
                return float(moments["step"])
    return 0.0


@torch.no_grad()
def load_optimizer(engine: Any, src: Path, step: float) -> None:
    """This rank's shards of the masters (into the model's weights too) and of the moments, from
    `save_optimizer`'s files of any layout."""
    read = SafetensorsReader(src)
    for opt in engine._optimizers():
        if not opt.optimizer.state:  # Adam makes its moments at the first step
            opt._init_optimizer_states_with_dummy_values()
    params = engine.local_tensors()
    for rule in engine.rules:
        param = params[rule.megatron]
        full = {k: megatron_shard(Rule(tuple(f"{k}/{h}" for h in rule.hf), rule.megatron, rule.kind),
                                  read, engine.shape, engine.tp, engine.tp_rank) for k in STATES}
        param.copy_(full["param"].to(param.dtype))
        owner = _owner(engine, param)
        if owner is not None:
            opt, part = owner
            tensors = {k: v.reshape(-1)[part.start:part.end].to(param.device) for k, v in full.items()}
            opt._set_main_param_and_optimizer_states(param, {**tensors, "step": torch.tensor(step)})
    for opt in engine._optimizers():
        for moments in opt.optimizer.state.values():  # loading may share one `step` tensor among all
            if "step" in moments:
                moments["step"] = moments["step"].clone()
