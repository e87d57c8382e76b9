"""Loading a checkpoint into a sharded model (the actor, the reference, the critic) with one copy
of the weights per node, not one per rank: every rank builds the model's skeleton with its parameters on the meta device, shards it
(`parallelize`), allocates only its own shards (`materialize`), and rank 0 alone reads the
checkpoint files and broadcasts each tensor, every rank keeping its slice (`load_sharded`).

    model = parallelize(skeleton(path, torch.float32), layout, mp)
    materialize(model, device)
    engine = FSDPEngine(model, layout, optim=...)
    load_sharded(engine, path)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl.single_controller.memory import release_host_memory
from asyncrl.train.experts import expert_names_at, fuse_experts
from asyncrl.train.lora import plain_name

log = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init) and
    keep real buffers (rotary tables are computed at construction; no checkpoint holds them)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def lm_class(config: Any) -> Any:
    """The transformers auto class of `config`'s language model: a vision-language model's
    (`vision_config`: Qwen2.5-VL and the like) is an image-text-to-text model, not a causal LM."""
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def skeleton(path: str, dtype: torch.dtype, value_head: bool = False) -> nn.Module:
    """The causal LM of `path`'s config.json with parameters on the meta device, in `dtype`
    (`value_head`: the body with a one-output token head instead, the critic's layout)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if value_head:  # no dropout: training-mode values match the eval-mode ones they are clipped against
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
    else:
        config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():  # rotary tables stay fp32 whatever `dtype` is, as from_pretrained keeps them
        if value_head and getattr(config, "vision_config", None) is not None:  # no token classifier in transformers
            from asyncrl.train.value_model import vision_value_model

            return vision_value_model(config, dtype)
        kind = AutoModelForTokenClassification if value_head else lm_class(config)
        return kind.from_config(config, dtype=dtype)


def copy_shards(src: nn.Module, dst: nn.Module) -> None:
    """`dst`'s parameters from `src`'s, shard by shard (the same architecture, parallelised the
    same way; dtypes may differ): a second copy of a model without reading it again."""
    with torch.no_grad():
        for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
            if tuple(a.shape) != tuple(b.shape):
                raise ValueError(f"{name}: shapes differ ({tuple(a.shape)} vs {tuple(b.shape)})")
            b.copy_(a)


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate `model`'s (sharded) parameters on `device`, uninitialised, keeping its buffers."""
    buffers = dict(model.named_buffers())
    model.to_empty(device=device)
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        (model.get_submodule(owner) if owner else model)._buffers[leaf] = buf.to(device)


Fresh = Callable[[str, tuple[int, ...], torch.dtype], "Tensor | None"]


def load_sharded(engine: Any, path: str, fresh: Fresh | None = None) -> None:
    """Fill `engine`'s sharded model from the checkpoint at `path`: rank 0 reads it (one copy on
    the node) and broadcasts it tensor by tensor; the other ranks hold one tensor at a time.
    `fresh(name, shape, dtype)`: the initial value of a parameter the checkpoint does not hold (a
    new value head, LoRA adapters), drawn on rank 0; None for a name it does not know."""
    model = engine.model
    dtype = next(model.parameters()).dtype
    full = {}
    if dist.get_rank() == 0:
        shapes = {plain_name(n): tuple(p.shape) for n, p in model.named_parameters()}
        new = {n: fresh(n, shape, dtype) for n, shape in shapes.items()} if fresh is not None else {}
        new = {n: t for n, t in new.items() if t is not None}
        full = read_checkpoint(path, tied_aliases(model), dtype, missing_ok=lambda n: n in new)
        full.update({n: t for n, t in new.items() if n not in full})
    engine.load_full_state_dict(full, broadcast_from_rank0=True)
    del full
    release_host_memory()  # rank 0's read of the files, back to the OS


def load_streamed(engine: Any, path: str) -> None:
    """Fill a pipeline stage's sharded model (every rank holds only its stage, so no rank has the
    whole state dict to broadcast): rank 0 reads the checkpoint one tensor at a time and
    broadcasts each; the ranks whose stage owns it keep their shard. One tensor in flight per
    rank; one reader per node. A checkpoint with tied embeddings fills the untied LM head from
    the embedding."""
    from safetensors import safe_open

    from asyncrl.train.pipeline import broadcast_value

    own = {plain_name(n): t for n, t in engine.model.state_dict().items()}
    dtype = next(engine.model.parameters()).dtype
    device = next(engine.model.parameters()).device
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    index = _tensor_index(sorted(Path(path).glob("*.safetensors"))) if dist.get_rank() == 0 else None
    index = broadcast_value(index, 0, None, comm)  # names, files and shapes (msgpack, no pickle)
    if index is None:
        raise FileNotFoundError(f"{path} holds no *.safetensors files; save the model with "
                                "save_pretrained(safe_serialization=True)")
    targets = {name: [name] for name in index}
    if "lm_head.weight" not in index and "model.embed_tokens.weight" in index:
        targets["model.embed_tokens.weight"].append("lm_head.weight")  # tied in the checkpoint, untied here
    missing = sorted(set(own) - {t for ts in targets.values() for t in ts})
    if missing:
        raise KeyError(f"{path}: the checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''} "
                       "(its tensor names differ from the model's)")
    handles: dict[str, Any] = {}
    for name, (file, shape) in index.items():
        if dist.get_rank() == 0:
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            full = handles[file].get_tensor(name).to(device=comm, dtype=dtype)
        else:
            full = torch.empty(shape, dtype=dtype, device=comm)
        dist.broadcast(full, src=0)
        for target in targets[name]:
            if target in own:
                _copy_into(own[target], full)
        del full
    release_host_memory()


def _tensor_index(files: list[Path]) -> dict[str, tuple[str, list[int]]] | None:
    """name -> (file, shape) over a checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    if not files:
        return None
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[name] = (str(f), list(handle.get_slice(name).get_shape()))
    return out


@torch.no_grad()
def _copy_into(target: Tensor, full: Tensor) -> None:
    """This rank's part of `full` into `target` (a DTensor shard, sliced locally, or a plain tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        part = distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(full)


def new_head(prefixes: tuple[str, ...], std: float) -> Fresh:
    """A new head (names starting with `prefixes`) initialised as transformers does: weights
    normal(0, std), biases 0."""
    def init(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
        if not name.startswith(prefixes):
            return None
        return torch.zeros(shape, dtype=dtype) if name.endswith("bias") else torch.randn(shape, dtype=dtype) * std
    return init


def either(*inits: Fresh) -> Fresh:
    """The first of `inits` that initialises a name (a LoRA critic: its adapters, then its head)."""
    def init(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
        for fresh in inits:
            value = fresh(name, shape, dtype)
            if value is not None:
                return value
        return None
    return init


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's names (tied weights share one parameter under several names)."""
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(plain_name(name))
    return {names[0]: names for names in by_param.values()}


# vision-language checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL on the Hub, and transformers' own
# save_pretrained) name the language model and the vision tower as before transformers 4.52 did
LEGACY_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def rename_legacy(sd: dict[str, Tensor], wanted: set[str]) -> None:
    """Give each wanted name the checkpoint stores under its older layout's name (in place)."""
    for name in wanted - set(sd):
        for new, old in LEGACY_PREFIXES:
            if name.startswith(new) and (legacy := old + name.removeprefix(new)) in sd:
                sd[name] = sd.pop(legacy)
                break


def read_checkpoint(path: str, aliases: dict[str, list[str]], dtype: torch.dtype,
                    missing_ok: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """The checkpoint's tensors by the model's parameter names in `dtype`, safetensors files read
    one at a time; a tied weight stored once is given under each of its names (names for which
    `missing_ok` says so may be absent)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors files; save the model with "
                                "save_pretrained(safe_serialization=True)")
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(f)).items()})
    wanted = {n for names in aliases.values() for n in names}
    fuse_experts(sd, wanted, expert_names_at(path))
    rename_legacy(sd, wanted)
    for names in aliases.values():
        present = next((n for n in names if n in sd), None)
        for n in names:
            if present is not None and n not in sd:
                sd[n] = sd[present]
    missing = sorted(n for n in wanted - set(sd) if not (missing_ok and missing_ok(n)))
    if missing:
        raise KeyError(f"{path}: the checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''} "
                       "(its tensor names differ from the model's)")
    return {k: v for k, v in sd.items() if k in wanted}
