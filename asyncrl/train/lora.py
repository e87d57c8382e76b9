"""LoRA adapters on a causal LM's linear layers, kept beside the base weights it leaves untouched.

`apply_lora(model, rank, alpha, ...)` gives each target `nn.Linear` two trainable parameters,
`lora_A` [rank, in] and `lora_B` [out, rank] (B starts at zero, so the adapted model starts as the
base), and a forward hook adding `(alpha / rank) * x A^T B^T`; every other parameter is frozen.
The base weights keep their Hugging Face names, so the sharded load, the reshard into generation
weights and the HF export see the model they know; the adapter's parameters are the ones whose
last name is `lora_A` / `lora_B`.

    apply_lora(model, rank=32, alpha=64)            # before FSDP2 wrapping (asyncrl.train.parallelize)
    with adapters_disabled(model): ...               # the base model: the reference policy, no second copy
    merged = merged_weight(base_w, a, b, scale)      # W0 + (alpha / rank) B A in fp32, cast once

`save_peft_adapter` writes the adapter as a PEFT directory (`PeftModel.from_pretrained(base, dir)`
loads it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

LORA_PARAMS = ("lora_A", "lora_B")
INPUT_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings")  # leaf names LoRA adapts as an embedding
VISION_TOWERS = ("visual", "vision_tower", "vision_model")  # a vision-language model's image encoder: not adapted
# the same as PEFT's `exclude_modules` (a module name it fullmatches)
VISION_EXCLUDE = rf"(.*\.)?({'|'.join(VISION_TOWERS)})(\..*)?"


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMS




def vision_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes of a vision-language model's image encoder (`model.visual.`); () for a text model."""
    return tuple(f"{name}." for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_TOWERS)


def target_linears(model: nn.Module, targets: list[str], skip: tuple[str, ...] = ()) -> dict[str, nn.Module]:
    """The modules `targets` names: leaf names (`q_proj`, `v_proj`, ...), `all-linear` (every
    linear layer but the output head, as PEFT means it), and the input embedding by its leaf name
    (`embed_tokens`); none whose name starts with `skip`, and none in a vision-language model's
    image encoder (LoRA adapts its language model). The output head only by name and only
    when it is not tied to the input embedding (a tied matrix is adapted as `embed_tokens`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and _tied_head(model) is not None
    skip = (*skip, *vision_prefixes(model))
    out = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if (name + ".").startswith(skip) or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if isinstance(module, nn.Embedding):
            if leaf in targets and leaf in INPUT_EMBEDDINGS:
                out[name] = module
        elif module is head:
            if leaf in targets and tied:
                raise ValueError(f"lora.target_modules names {leaf}, which shares its matrix with the input "
                                 "embedding: name embed_tokens instead (its adapter serves both uses)")
            if leaf in targets:
                out[name] = module
        elif "all-linear" in targets or leaf in targets:
            out[name] = module
    return out


def _tied_head(model: nn.Module) -> nn.Module | None:
    """The output head when it shares its weight with the input embedding."""
    if not (hasattr(model, "get_output_embeddings") and hasattr(model, "get_input_embeddings")):
        return None
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head if head is not None and emb is not None and head.weight is emb.weight else None


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               targets: list[str] | None = None, train: tuple[str, ...] = (), freeze_a: bool = False) -> list[str]:
    """Add adapters to `model`'s target modules in place and freeze everything else but the
    parameters whose names start with `train` (a critic's new value head: trained in full, not
    adapted) and, unless `freeze_a` (LoRA-FA: A stays at its draw), the adapters; returns the
    adapted modules' names. Parameters are created on the device (and
    meta-ness) of each base weight; `init_adapters` draws A as PEFT does (B stays zero).

    An embedding [vocab, dim] is adapted like a linear layer of that weight: B [vocab, rank] and
    A [rank, dim], its lookup plus `scale * B[ids] A`, so the merged weight is W0 + scale B A for
    both. A head tied to that embedding adds the same delta (`x A^T B^T`): the generation model,
    where the merged matrix serves both uses, and the trainer agree."""
    found = target_linears(model, targets or ["all-linear"], skip=train)
    if not found:
        raise ValueError(f"actor.lora.target_modules={targets}: no layer of {type(model).__name__} "
                         "matches; use leaf names such as q_proj, v_proj, embed_tokens, or all-linear")
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(train) if train else False)
    head = _tied_head(model)
    for module in found.values():
        w = module.weight
        out_dim, in_dim = w.shape
        module.lora_A = nn.Parameter(torch.zeros(rank, in_dim, dtype=w.dtype, device=w.device),
                                     requires_grad=not freeze_a)
        module.lora_B = nn.Parameter(torch.zeros(out_dim, rank, dtype=w.dtype, device=w.device))
        module.lora_scale = alpha / rank
        module.lora_off = False
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(_add_embedding_adapter)
            if head is not None and head.weight is w:
                head.register_forward_hook(functools.partial(_add_adapter, owner=module))
        else:
            module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
            module.register_forward_hook(_add_adapter)
    init_adapters(model)
    return list(found)


def init_adapters(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """A ~ kaiming-uniform(a=sqrt(5)) (PEFT's and nn.Linear's default), B = 0: the adapted model
    equals the base until the first update. Skipped for parameters on the meta device."""
    with torch.no_grad():
        for module in model.modules():
            a = getattr(module, "lora_A", None)
            if a is None or a.is_meta:
                continue
            bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [rank, in]
            a.uniform_(-bound, bound, generator=generator)
            module.lora_B.zero_()


def fresh_adapter(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """An adapter parameter's initial value for a sharded load (`asyncrl.train.load.load_sharded`:
    drawn on rank 0, which broadcasts it): A as `init_adapters` draws it, B = 0; None otherwise."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "lora_A":
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape, dtype=dtype).uniform_(-bound, bound)
    if leaf == "lora_B":
        return torch.zeros(shape, dtype=dtype)
    return None


def _add_adapter(module: nn.Module, args: tuple, output: Tensor, owner: nn.Module | None = None) -> Tensor:
    owner = owner or module  # a tied head: the embedding's adapter
    if owner.lora_off:
        return output
    x = owner.lora_dropout(args[0]) if hasattr(owner, "lora_dropout") else args[0]
    a, b = owner.lora_A, owner.lora_B
    return output + (x.to(a.dtype) @ a.t() @ b.t()).to(output.dtype) * owner.lora_scale


def _add_embedding_adapter(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    if module.lora_off:
        return output
    a, b = module.lora_A, module.lora_B
    return output + (nn.functional.embedding(args[0], b) @ a).to(output.dtype) * module.lora_scale


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model for the duration (the reference policy with LoRA): adapters are skipped."""
    adapted = [m for m in model.modules() if hasattr(m, "lora_off")]
    for m in adapted:
        m.lora_off = True
    try:
        yield
    finally:
        for m in adapted:
            m.lora_off = False


def merged_weight(base: Tensor, a: Tensor, b: Tensor, scale: float, dtype: torch.dtype | None = None) -> Tensor:
    """W0 + scale * B A computed in fp32 from the untouched base and cast once to `dtype` (never a
    merge into the base and an unmerge: in bf16 that rounds the update away)."""
    out = base.float() + scale * (b.float() @ a.float())
    return out.to(dtype or base.dtype)


def adapter_scales(model: nn.Module) -> dict[str, float]:
    """Each adapted module's name (without wrappers' prefixes) and its alpha / rank."""
    return {plain_name(name): m.lora_scale for name, m in model.named_modules() if hasattr(m, "lora_scale")}


def save_peft_adapter(out: str | Path, adapter: dict[str, Tensor], *, rank: int, alpha: float, dropout: float,
                      targets: list[str], base_model: str, tied_head: str | None = None,
                      vision: bool = False) -> Path:
    """Write `adapter` ({module.lora_A|lora_B: full tensor}) as a PEFT LoRA directory:
    adapter_config.json and adapter_model.safetensors with PEFT's tensor names. An embedding's
    adapter is written as PEFT's `lora_embedding_A` = B^T and `lora_embedding_B` = A^T (the same
    delta); `tied_head` (the head sharing an adapted embedding's matrix) gets that adapter too,
    as a linear one, so PEFT computes what the trainer did. `vision`: the base model has an image
    encoder, which PEFT is told to leave alone (its layers share leaf names with the adapted ones)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in adapter.items():
        module, leaf = name.rsplit(".", 1)
        t = t.detach().contiguous().cpu()
        if module.rsplit(".", 1)[-1] in INPUT_EMBEDDINGS:
            peft_leaf = "lora_embedding_B" if leaf == "lora_A" else "lora_embedding_A"
            tensors[f"base_model.model.{module}.{peft_leaf}"] = t.t().contiguous()
            if tied_head is not None:
                tensors[f"base_model.model.{tied_head}.{leaf}.weight"] = t
        else:
            tensors[f"base_model.model.{name}.weight"] = t
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    leaves = {name.rsplit(".", 2)[-2] for name in adapter}
    if tied_head is not None and leaves & set(INPUT_EMBEDDINGS):
        leaves.add(tied_head.rsplit(".", 1)[-1])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": dropout, "target_modules": sorted(leaves),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "modules_to_save": None, "use_rslora": False, "base_model_name_or_path": base_model}
    if vision:
        config["exclude_modules"] = VISION_EXCLUDE
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def plain_name(name: str) -> str:
    """A parameter or module name without the wrappers' prefixes (activation checkpointing, compile)."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def adapter_shapes(model: nn.Module, rank: int, targets: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """The adapter tensors `apply_lora` gives `model` (an unadapted model of the same
    architecture, on any device, meta too), in module order: (module.lora_A, [rank, in]),
    (module.lora_B, [out, rank]). What a split weight sync carries with LoRA."""
    out = []
    for name, m in target_linears(model, targets).items():
        rows, cols = m.weight.shape  # [out, in]; an embedding's [vocab, dim]
        out += [(f"{name}.lora_A", (rank, cols)), (f"{name}.lora_B", (rows, rank))]
    return out
