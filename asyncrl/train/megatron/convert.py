"""Hugging Face <-> megatron-core weights for Llama / Qwen2 / Qwen3 decoders (the local layer
spec): each rule maps HF tensors to one Megatron tensor and its tensor-parallel split.

- q, k, v fuse per query group into `linear_qkv` (group g: its heads' q rows, then its k, then
  its v); a TP rank holds whole groups, so its shard is built from contiguous q/k/v rows.
- gate and up fuse into `linear_fc1` per TP rank: [gate shard; up shard].
- o_proj and down_proj split along their input dim; norms are replicated.
- the embedding and an untied LM head split over a vocabulary padded to a multiple of tp.

`megatron_shard` builds a rank's shard from HF tensors read in parts; `hf_tensors` turns
consecutive TP shards back into the HF tensors (or the slice of them) they cover — the whole
group gives the whole tensors, `k` consecutive shards of `t` the `k/t` slice a generation
tensor-parallel rank holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from asyncrl.train.experts import QWEN, ExpertNames, expert_names
from transport.checks import ConfigError

COPY, ROW, COL, QKV, FC1, VOCAB = "copy", "row", "col", "qkv", "fc1", "vocab"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")

# read(name, dim, index, count): part `index` of `count` of HF tensor `name` along `dim` (None: whole)
Reader = Callable[[str, int | None, int, int], Tensor]


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # the HF tensors (a layer's names relative to model.layers.{i}.)
    megatron: str  # the Megatron tensor (relative to decoder.layers.{i}.)
    kind: str


@dataclass(frozen=True)
class GPTShape:
    """What megatron-core needs of an HF decoder's config.json, checked against what it can map."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    eps: float
    rope_theta: float
    max_positions: int
    init_std: float
    value_head: bool = False  # the critic: a one-output token head (HF's `score`) instead of the LM head
    experts: int = 0  # a mixture of experts in every layer: routed experts (0: a dense MLP)
    topk: int = 0
    moe_ffn: int = 0  # each expert's width
    norm_topk: bool = True  # the top-k gate weights renormalised (Qwen3-MoE's norm_topk_prob, Mixtral)
    names: ExpertNames = QWEN  # how the checkpoint names the MoE block and its experts

    @classmethod
    def from_hf(cls, config: Any) -> GPTShape:
        _check_architecture(config)
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
        moe = {} if not experts else {
            "experts": experts, "topk": config.num_experts_per_tok, "names": expert_names(config),
            "moe_ffn": getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
            "norm_topk": bool(getattr(config, "norm_topk_prob", True))}
        return cls(**moe, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn=config.intermediate_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
                   qk_norm=config.model_type in ("qwen3", "qwen3_moe"), eps=float(config.rms_norm_eps), rope_theta=float(theta),
                   max_positions=int(config.max_position_embeddings),
                   init_std=float(getattr(config, "initializer_range", 0.02)))

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of `tp` (each rank an equal slice)."""
        return -(-self.vocab // tp) * tp

    def check_tp(self, tp: int, pp: int = 1) -> None:
        if self.experts and tp > 1 and pp > 1:
            raise ConfigError(f"actor.parallel.tp={tp} with pp={pp} for a mixture-of-experts model on megatron: "
                              "a MoE under TP runs sequence-parallel, which asyncrl's pipeline stages do not pass "
                              "on yet; use pp=1 (or tp=1)")
        mlp = ("moe_intermediate_size", self.moe_ffn) if self.experts else ("intermediate_size", self.ffn)
        bad = [f"{k}={v}" for k, v in (("num_attention_heads", self.heads), ("num_key_value_heads", self.groups),
                                       mlp) if v % tp]
        if bad:
            raise ConfigError(f"actor.parallel.tp={tp} must divide the model's {', '.join(bad)} "
                              "(Megatron splits heads, query groups and the MLP over TP ranks); choose "
                              "a tp among their common divisors")

    def check_ep(self, ep: int) -> None:
        if ep > 1 and (not self.experts or self.experts % ep):
            what = f"the model's {self.experts} experts" if self.experts else "a dense model (it has no experts)"
            raise ConfigError(f"actor.moe.ep={ep} must divide {what}: expert parallelism gives each of the ep "
                              "ranks as many whole experts; choose an ep that divides the experts (1 for a dense model)")

    def mlp_rules(self, ep_rank: int = 0, ep: int = 1) -> list[Rule]:
        """A layer's MLP: the dense one, or the router and this EP rank's experts (each expert's
        gate and up fused into its fc1, split over TP as the dense MLP is)."""
        if not self.experts:
            return [Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight", FC1),
                    Rule(("mlp.down_proj.weight",), "mlp.linear_fc2.weight", ROW)]
        n, b = self.names, self.names.block
        rules = [Rule((f"{b}.gate.weight",), "mlp.router.weight", COPY)]
        local = self.experts // ep
        for i, e in enumerate(range(ep_rank * local, (ep_rank + 1) * local)):
            rules += [Rule((f"{b}.experts.{e}.{n.gate}.weight", f"{b}.experts.{e}.{n.up}.weight"),
                           f"mlp.experts.local_experts.{i}.linear_fc1.weight", FC1),
                      Rule((f"{b}.experts.{e}.{n.down}.weight",), f"mlp.experts.local_experts.{i}.linear_fc2.weight", ROW)]
        return rules

    def layer_rules(self, ep_rank: int = 0, ep: int = 1) -> list[Rule]:
        rules = [Rule(("input_layernorm.weight",), "input_layernorm.weight", COPY),
                 Rule(tuple(f"self_attn.{x}_proj.weight" for x in "qkv"), "self_attention.linear_qkv.weight", QKV),
                 Rule(("self_attn.o_proj.weight",), "self_attention.linear_proj.weight", ROW),
                 Rule(("post_attention_layernorm.weight",), "pre_mlp_layernorm.weight", COPY),
                 *self.mlp_rules(ep_rank, ep)]
        if self.qkv_bias:
            rules.append(Rule(tuple(f"self_attn.{x}_proj.bias" for x in "qkv"), "self_attention.linear_qkv.bias", QKV))
        if self.qk_norm:
            rules += [Rule(("self_attn.q_norm.weight",), "self_attention.q_layernorm.weight", COPY),
                      Rule(("self_attn.k_norm.weight",), "self_attention.k_layernorm.weight", COPY)]
        return rules

    def check_pp(self, pp: int) -> None:
        if self.layers % pp:
            fits = [k for k in range(1, self.layers + 1) if self.layers % k == 0]
            raise ConfigError(f"actor.parallel.pp={pp} must divide the model's num_hidden_layers={self.layers} "
                              f"(Megatron gives each stage as many layers); choose pp among {fits}")

    def rules(self, stage: int = 0, stages: int = 1, ep_rank: int = 0, ep: int = 1) -> Iterator[Rule]:
        """The tensors pipeline stage `stage` of `stages` holds (the whole model by default) with
        expert-parallel rank `ep_rank`'s experts: HF names in full, Megatron names as the stage
        numbers them (its layers from 0, its experts from 0). A tied head on a last stage of its
        own is its copy of the embedding."""
        per = self.layers // stages
        first, last = stage == 0, stage == stages - 1
        if first:
            yield Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", VOCAB)
        for local, i in enumerate(range(stage * per, (stage + 1) * per)):
            for r in self.layer_rules(ep_rank, ep):
                yield Rule(tuple(f"model.layers.{i}.{h}" for h in r.hf), f"decoder.layers.{local}.{r.megatron}", r.kind)
        if last:
            yield Rule(("model.norm.weight",), "decoder.final_layernorm.weight", COPY)
            if self.value_head:
                yield from (Rule((f"score.{leaf}",), f"value_head.{leaf}", COPY) for leaf in ("weight", "bias"))
            elif not self.tied:
                yield Rule(("lm_head.weight",), "output_layer.weight", VOCAB)
            elif not first:  # a tied head on a later stage: megatron's copy of the embedding
                yield Rule(("model.embed_tokens.weight",), "output_layer.weight", VOCAB)

    def hf_numel(self, rule: Rule) -> int:
        """Elements of the HF tensors of `rule`, all of them (no parallelism)."""
        d, h = self.head_dim, self.hidden
        leaf = rule.megatron.rsplit(".", 2)[-2]
        ffn = self.moe_ffn if ".local_experts." in rule.megatron else self.ffn
        sizes = {"linear_qkv": (self.heads + 2 * self.groups) * d * (h if rule.hf[0].endswith("weight") else 1),
                 "linear_proj": h * self.heads * d, "linear_fc1": 2 * ffn * h, "linear_fc2": ffn * h,
                 "router": self.experts * h,
                 "word_embeddings": self.vocab * h, "output_layer": self.vocab * h,
                 "q_layernorm": d, "k_layernorm": d}
        return sizes.get(leaf, h)


def _check_architecture(config: Any) -> None:
    kind = getattr(config, "model_type", "?")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"actor.backend=megatron maps {', '.join(ARCHITECTURES)} decoders; this model is "
                          f"{kind!r}: use actor.backend=fsdp2")
    unsupported = {
        "hidden_act": getattr(config, "hidden_act", "silu") != "silu",
        "mlp_only_layers (dense layers among the MoE ones)": bool(getattr(config, "mlp_only_layers", None))
        or getattr(config, "decoder_sparse_step", 1) != 1,
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        "attention_bias (an o_proj bias)": kind == "llama" and bool(getattr(config, "attention_bias", False)),
        "use_sliding_window": bool(getattr(config, "use_sliding_window", False)),
        "rope_scaling": _rope_type(config) not in (None, "default"),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ConfigError(f"actor.backend=megatron cannot map this {kind} model's {', '.join(bad)} yet; use "
                          "actor.backend=fsdp2 for it")


def _rope_type(config: Any) -> str | None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type"))


# HF -> Megatron -----------------------------------------------------------------------------------

def megatron_shard(rule: Rule, read: Reader, shape: GPTShape, tp: int, rank: int) -> Tensor:
    """TP rank `rank`'s shard of `rule.megatron`, from its HF tensors."""
    if rule.kind == COPY:
        return read(rule.hf[0], None, 0, 1)
    if rule.kind == ROW:
        return read(rule.hf[0], 1, rank, tp)
    if rule.kind == COL:
        return read(rule.hf[0], 0, rank, tp)
    if rule.kind == FC1:
        return torch.cat([read(name, 0, rank, tp) for name in rule.hf])
    if rule.kind == QKV:
        q, k, v = (read(name, 0, rank, tp) for name in rule.hf)
        groups = shape.groups // tp
        parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])
    return _vocab_rows(read(rule.hf[0], None, 0, 1), shape, tp, rank)  # VOCAB


def _vocab_rows(full: Tensor, shape: GPTShape, tp: int, rank: int) -> Tensor:
    rows = shape.padded_vocab(tp) // tp
    part = full[rank * rows:(rank + 1) * rows]
    return torch.cat([part, part.new_zeros(rows - len(part), *part.shape[1:])]) if len(part) < rows else part


# Megatron -> HF -----------------------------------------------------------------------------------

def hf_tensors(rule: Rule, parts: list[Tensor], shape: GPTShape, tp: int) -> dict[str, Tensor]:
    """The HF tensors (or their slice) that consecutive TP shards `parts` of `rule.megatron` hold,
    out of `tp` shards in all. A vocabulary tensor is trimmed of its padding when `parts` is all
    of them."""
    if rule.kind == COPY:
        return {rule.hf[0]: parts[0]}
    if rule.kind == ROW:
        return {rule.hf[0]: torch.cat(parts, dim=1)}
    if rule.kind == COL:
        return {rule.hf[0]: torch.cat(parts)}
    if rule.kind == FC1:
        halves = [p.chunk(2) for p in parts]
        return {name: torch.cat([h[i] for h in halves]) for i, name in enumerate(rule.hf)}
    if rule.kind == QKV:
        per_group = shape.heads // shape.groups
        pieces = [p.reshape(shape.groups // tp, per_group + 2, shape.head_dim, *p.shape[1:]) for p in parts]
        q = torch.cat([g[:, :per_group].reshape(-1, *g.shape[3:]) for g in pieces])
        k = torch.cat([g[:, per_group].reshape(-1, *g.shape[3:]) for g in pieces])
        v = torch.cat([g[:, per_group + 1].reshape(-1, *g.shape[3:]) for g in pieces])
        return dict(zip(rule.hf, (q, k, v), strict=True))
    full = torch.cat(parts)  # VOCAB
    return {rule.hf[0]: full[:shape.vocab] if len(parts) == tp else full}


# reading HF checkpoints ---------------------------------------------------------------------------

class SafetensorsReader:
    """Parts of the tensors of an HF model directory, read from its safetensors files (memory
    mapped: a rank reads the rows it asks for)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        files = (sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
                 if index.exists() else sorted(path.glob("*.safetensors")))
        if not files:
            raise ConfigError(f"model.path={path}: no safetensors files; actor.backend=megatron reads "
                              "safetensors checkpoints (save the model with save_pretrained)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118

    def __call__(self, name: str, dim: int | None, index: int, count: int) -> Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        view = handle.get_slice(name)
        if dim is None:
            return view[:]
        size = view.get_shape()[dim] // count
        span = slice(index * size, (index + 1) * size)
        return view[span] if dim == 0 else view[:, span]


def dict_reader(tensors: dict[str, Tensor]) -> Reader:
    """A `Reader` over tensors in memory."""
    def read(name: str, dim: int | None, index: int, count: int) -> Tensor:
        t = tensors[name]
        return t if dim is None else t.chunk(count, dim=dim)[index]
    return read
