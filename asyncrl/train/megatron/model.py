"""megatron-core's `GPTModel` from an HF config (`GPTShape`), and `HFView`: the model called the
way the roles call a Hugging Face causal LM."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.train.megatron.convert import COPY, ROW, GPTShape


def transformer_config(shape: GPTShape, tp: int, pp: int, dtype: torch.dtype, recompute: bool):
    """The `TransformerConfig` of `shape` at (tp, pp): the HF model's maths, no fused kernels
    that need Transformer Engine or apex."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        normalization="RMSNorm", layernorm_epsilon=shape.eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=shape.init_std,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None, recompute_num_layers=1 if recompute else None,
    )


def build_gpt(shape: GPTShape, tp: int, pp: int, dtype: torch.dtype, recompute: bool = False) -> nn.Module:
    """This rank's `GPTModel` (its TP shard; weights uninitialised: they are loaded next)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(shape, tp, pp, dtype, recompute)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm),
                    vocab_size=shape.padded_vocab(tp), max_sequence_length=shape.max_positions,
                    share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope",
                    rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
                    parallel_output=True)
    mark_tensor_parallel(gpt, shape)
    return gpt


def mark_tensor_parallel(gpt: nn.Module, shape: GPTShape) -> None:
    """Set megatron's `tensor_model_parallel` / `partition_dim` on every split weight: its
    layers set them only when they initialise the weights (`perform_initialization`), which a
    model loaded from a checkpoint skips; the distributed optimizer's grad norm needs them."""
    params = dict(gpt.named_parameters())
    for rule in shape.rules():
        if rule.kind != COPY:
            param = params[rule.megatron]
            param.tensor_model_parallel, param.partition_stride = True, 1
            param.partition_dim = 1 if rule.kind == ROW else 0


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """Megatron's [B, 1, S, S] mask (True: not attended) from HF's [B, S] padding mask."""
    seq = attention_mask.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    return future[None, None] | ~attention_mask.bool()[:, None, None, :]


class HFView(nn.Module):
    """`gpt` called as the roles call an HF causal LM: `input_ids`, `attention_mask`,
    `logits_to_keep` (a count or position indices) -> `.logits` [B, kept, vocab], the vocabulary
    gathered over the TP ranks and trimmed of its padding. Rotary positions count from the first
    column: RoPE scores depend only on position differences, so left padding changes nothing."""

    def __init__(self, gpt: nn.Module, shape: GPTShape) -> None:
        super().__init__()
        self.gpt = gpt
        self.vocab = shape.vocab

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int | Tensor = 0, **_: object) -> SimpleNamespace:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        gpt = self.gpt
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = gpt.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        rope = gpt.rotary_pos_emb(input_ids.shape[1])
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=causal_padding_mask(attention_mask),
                             rotary_pos_emb=rope)
        hidden = _keep(hidden, logits_to_keep)
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(hidden, weight=weight)
        logits = gather_from_tensor_model_parallel_region(logits)[..., :self.vocab]
        return SimpleNamespace(logits=logits.transpose(0, 1))


def _keep(hidden: Tensor, keep: int | Tensor) -> Tensor:
    """The positions [S, B, H] whose logits are asked for (HF's `logits_to_keep`)."""
    if isinstance(keep, Tensor):
        return hidden.index_select(0, keep)
    return hidden[-keep:] if keep else hidden
