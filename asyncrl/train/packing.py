"""Packed sequences: a micro-batch's rows concatenated into one row without padding, positions
restarting per row, attention kept inside each row (varlen attention), outputs scattered back.

Transformers does not isolate packed rows from `position_ids` alone under `sdpa` / `eager` on
CPU (tests/rl/test_packing.py checks it still does not), so `enable_packing` registers an attention
implementation of our own: given `cu_seq_lens_q` (the rows' cumulative lengths, passed through
the model's forward kwargs so that activation checkpointing's recompute sees them too) it runs
causal attention per row — `torch.nn.attention.varlen.varlen_attn` on CUDA where torch has it,
one `scaled_dot_product_attention` per distinct row length elsewhere; without them it is `sdpa`,
unchanged.
With Ulysses sequence parallelism (`asyncrl.train.ulysses`) each rank holds a slice of the packed
row and the heads are exchanged around this same function.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.single_controller.batch import Batch

ATTENTION = "asyncrl_packed"
# the columns as wide as prompt + response (the rest are response-wide or per row)
SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids", "routed_experts", "old_routed_experts")


class PackingError(ValueError):
    """Packing was asked for a model or batch it cannot serve."""


def packing_unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run packed rows (None: it can): a Hugging Face model whose attention
    goes through transformers' attention interface has a varlen path."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return f"{type(model).__name__} is not a Hugging Face model"
    if not getattr(type(model), "_supports_attention_backend", False):
        return f"{type(model).__name__}'s attention does not go through transformers' attention interface"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model"
    return None


def enable_packing(model: nn.Module) -> None:
    """Route `model`'s attention through the packed-aware implementation (exactly `sdpa` for
    unpacked batches); raises PackingError when the model has no varlen path."""
    reason = packing_unsupported(model)
    if reason is not None:
        raise PackingError(reason)
    _register()
    model.set_attn_implementation(ATTENTION)


def resolve_packing(model: nn.Module, setting: bool | None, at: str, pipelined: bool = False) -> bool:
    """Set `model` up for packed micro-batches per the `{at}pack_sequences` setting (None: where
    it can); whether it packs. Raises PackingError when true is asked of a model that cannot."""
    if setting is False:
        return False
    reason = "pipeline stages exchange one padded shape" if pipelined else packing_unsupported(model)
    if reason is not None:
        if setting:
            raise PackingError(f"{at}pack_sequences=true: {reason}; set it to null (pack where possible) or false")
        return False
    enable_packing(model)
    setattr(model, AUTO_ATTR, setting is None)
    return True


def worth_packing(model: nn.Module, attention_mask: torch.Tensor) -> bool:
    """Whether a micro-batch runs packed: always where packing was asked for (`true`); where it
    was left to asyncrl (`null`), only when padding is over PACK_WHEN_PADDED of its grid (short,
    even rows run padded: one batched kernel beats per-length calls on CPU, and little is saved)."""
    if not getattr(model, AUTO_ATTR, False):
        return True
    grid = attention_mask.numel()
    return grid > 0 and 1.0 - float(attention_mask.sum()) / grid > PACK_WHEN_PADDED


_ROW_BOUNDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
AUTO_ATTR = "_asyncrl_pack_auto"  # set on a model whose packing was left to asyncrl (pack_sequences=null)
# the padded share of a micro-batch's grid above which `null` packs it (the quickstart's rows: ~0.2,
# padded 1.14x faster on CPU; long-tailed responses: 0.5-0.9)
PACK_WHEN_PADDED = 1 / 3


def is_packing(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTENTION


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def _mask(**kwargs):
    """sdpa's mask, except none for a batch given without one (packed rows: attention is
    isolated per row by `packed_attention`, no [tokens, tokens] mask is built)."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None and not kwargs.get("q_offset") and not kwargs.get("kv_offset"):
        return None
    return sdpa_mask(**kwargs)


def packed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """Attention over [1, heads, tokens, dim] packed rows bounded by `cu_seq_lens_q`; sdpa when
    the call carries no row bounds. Returns [1, tokens, heads, dim]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        # unpacked, or a bidirectional attention inside the packed forward (a vision tower's,
        # over its own patches): the language model's row bounds are not its own
        kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_BOUNDS}
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise PackingError(f"packed rows come as one row; got a batch of {query.shape[0]}")
    sp = getattr(module, "sequence_parallel", None)
    if sp is not None:  # Ulysses: [tokens/sp, heads] -> [tokens, heads/sp] and back
        query, key, value = sp.scatter_heads(query, key, value)
    out = varlen_causal(query[0], key[0], value[0], cu, int(kwargs.get("max_length_q") or 0), scaling,
                        dropout if module.training else 0.0)
    out = out.unsqueeze(0)  # [1, heads, tokens, dim]
    if sp is not None:
        out = sp.gather_heads(out)
    return out.transpose(1, 2).contiguous(), None


def varlen_causal(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float | None,
                  dropout: float = 0.0) -> Tensor:
    """Causal attention of [heads, tokens, dim] rows bounded by `cu` ([rows + 1], from 0), each
    row attending only to itself; kv heads may be fewer (grouped-query)."""
    if q.is_cuda and dropout == 0.0 and _cuda_varlen() is not None:
        return _cuda_varlen()(q, k, v, cu, max_len, scale)
    gqa = k.shape[0] != q.shape[0]
    lengths = cu[1:] - cu[:-1]
    out = q.new_empty(q.shape)
    for length in lengths.unique().tolist():  # rows of one length attend in one call (4-D [rows, heads,
        if length == 0:                       # length, dim]: the CPU flash kernel's layout)
            continue
        starts = cu[:-1][lengths == length].long()
        at = (starts[:, None] + torch.arange(length, device=cu.device)).reshape(-1)
        rows = [t[:, at].unflatten(1, (len(starts), length)).transpose(0, 1) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*rows, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
        out[:, at] = o.transpose(0, 1).flatten(1, 2)
    return out


@functools.cache
def _cuda_varlen():
    """torch's flash-attention varlen kernel adapted to [heads, tokens, dim] (None: this torch lacks it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in params  # torch 2.11's varlen_attn has no enable_gqa: kv heads repeated

    def run(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
        cu32 = cu.to(device=q.device, dtype=torch.int32)
        max_len = max_len or int((cu[1:] - cu[:-1]).max())
        gqa = {}
        if k.shape[0] != q.shape[0]:
            if native_gqa:
                gqa = {"enable_gqa": True}
            else:
                k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
        out = varlen_attn(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu32, cu32, max_len, max_len,
                          scale=scale, **causal, **gqa)
        return out.transpose(0, 1)
    return run


@dataclass
class Packed:
    """A micro-batch's attended tokens as one row: where each came from and the row bounds."""

    rows: Tensor  # [tokens]: the source row of each packed token
    cols: Tensor  # [tokens]: its source column
    cu: Tensor  # [rows + 1] cumulative row lengths (int32)
    shape: tuple[int, int]  # the padded micro-batch's [rows, columns]
    max_len: int

    @property
    def tokens(self) -> int:
        return int(self.rows.numel())

    def pack(self, t: Tensor) -> Tensor:
        """[rows, columns, ...] -> [1, tokens, ...]."""
        return t[self.rows, self.cols].unsqueeze(0)

    def unpack(self, t: Tensor, fill: float = 0) -> Tensor:
        """[1, tokens, ...] (or [tokens, ...]) -> [rows, columns, ...], `fill` where nothing was packed."""
        t = t.reshape(self.tokens, *t.shape[2:]) if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == self.tokens else t
        out = t.new_full((*self.shape, *t.shape[1:]), fill)
        out[self.rows, self.cols] = t
        return out

    def slots(self) -> Tensor:
        """[rows, columns]: each padded position's index in the packed row, -1 where not packed."""
        slot = torch.full(self.shape, -1, dtype=torch.long, device=self.rows.device)
        slot[self.rows, self.cols] = torch.arange(self.tokens, device=self.rows.device)
        return slot

    def model_kwargs(self, mb: Batch) -> dict:
        """The model's inputs for the packed row (ids, restarting positions, row bounds)."""
        return {"input_ids": self.pack(mb["input_ids"]), "position_ids": self.pack(mb["position_ids"]),
                "attention_mask": None, "cu_seq_lens_q": self.cu, "cu_seq_lens_k": self.cu,
                "max_length_q": self.max_len, "max_length_k": self.max_len}

    def view(self, mb: Batch) -> Batch:
        """`mb` with its sequence columns packed ([1, tokens, ...]) and an all-ones attention
        mask: what per-token hooks (routing replay, router losses) read for a packed forward."""
        tensors = {name: (self.pack(t) if name in SEQUENCE_COLUMNS and t.dim() >= 2 else t)
                   for name, t in mb.tensors.items()}
        tensors["attention_mask"] = torch.ones(1, self.tokens, dtype=mb["attention_mask"].dtype,
                                               device=self.rows.device)
        return Batch._make(tensors, mb.non_tensors, mb.meta)


def pack(mb: Batch) -> Packed:
    """The packing of micro-batch `mb`: its attended tokens (attention_mask 1), row by row."""
    mask = mb["attention_mask"].bool()
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: each row's tokens together, in order
    lengths = mask.sum(-1)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return Packed(rows, cols, cu, tuple(mask.shape), int(lengths.max()) if len(lengths) else 0)


def predicting_slots(pk: Packed, width: int) -> Tensor:
    """[rows, width]: the packed index of the position whose logits predict each of the last
    `width` columns (response token j is predicted at column S - width - 1 + j), -1 where that
    position is not attended (then the token is padding)."""
    columns = pk.shape[1]
    return pk.slots()[:, columns - width - 1:columns - 1]


__all__ = ["ATTENTION", "Packed", "PackingError", "enable_packing", "is_packing", "pack", "packed_attention",
           "packing_unsupported", "predicting_slots", "resolve_packing", "varlen_causal"]
