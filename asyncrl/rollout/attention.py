"""A CPU rollout's attention: a compiled decode step's as two small matrix multiplies, a packed
prefill's prompt by prompt.

At one query token a row, torch's CPU SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`)
cost ~1.2 ms a layer for 32 rows x 14 heads over a 96-column KV cache on this project's 2-core
machine: 1.85 s of a 19 s `generate` of the 0.5B shape (32 rows x 64 tokens). Scores by a
matmul of each KV head's group of query heads with its keys, a masked softmax and a matmul with
the values are the same maths in a few kernels inductor fuses around; the call took 16.1–17.4 s.
A packed prefill (prompts laid end to end, `cu_seq_lens_q` their bounds) runs SDPA's causal
kernel on each prompt alone: the block-diagonal mask over the whole pack cost 23 ms a layer for
32 prompts of 8-32 tokens (711 in all) on that machine, the prompts alone 4.4 ms, and the mask's
cost grows with the square of the pack. Anything this does not cover (no mask, soft-capping,
sinks, sliding windows, dropout, a cache already holding tokens) goes to transformers' own SDPA
function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "asyncrl_decode"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [rows, heads, 1, dim], key and value [rows, kv
    heads, columns, dim], a boolean mask [rows, 1, 1, columns]; returns [rows, 1, heads, dim]."""
    rows, heads, q_len, dim = query.shape
    unusual = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "sliding_window"))
    bounds = kwargs.get("cu_seq_lens_q")
    if (bounds is not None and rows == 1 and key.shape[2] == q_len and getattr(module, "is_causal", True)
            and not dropout and not unusual):
        return prompt_by_prompt(query, key, value, bounds.tolist(), scaling), None
    plain_mask = attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
    if q_len != 1 or not plain_mask or dropout or unusual:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, columns = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query head h reads KV head h // group
    scale = dim ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(rows, kv_heads, group, dim), key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~attention_mask.reshape(rows, 1, 1, columns), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # [rows, kv heads, group, dim]
    return out.reshape(rows, 1, heads, dim), None


def prompt_by_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                     scaling: float | None) -> torch.Tensor:
    """Causal attention within each packed prompt (tokens `bounds[i]` to `bounds[i + 1]`): query
    [1, heads, tokens, dim], key and value [1, kv heads, tokens, dim]; returns [1, tokens, heads, dim]."""
    out = query.new_empty(query.shape)
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        part = slice(start, end)
        out[:, :, part] = F.scaled_dot_product_attention(query[:, :, part], key[:, :, part], value[:, :, part],
                                                         is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s attention layers use `decode_attention` inside (where they read SDPA's; nested: the
    outermost restores)."""
    config = model.config
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
