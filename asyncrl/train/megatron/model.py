"""megatron-core's `GPTModel` from an HF config (`GPTShape`), and `HFView`: the model called the
way the roles call a Hugging Face causal LM."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.train.megatron.convert import COPY, ROW, GPTShape, Rule


def moe_config(shape: GPTShape, ep: int, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
               replay: bool = False) -> dict:
    """The `TransformerConfig` fields of a mixture of experts (none for a dense model): HF's router
    (softmax over the top-k logits = the top-k probabilities renormalised; without `norm_topk`,
    the softmax over all experts first), dropless, sequential experts (no grouped GEMM kernel), the
    all-gather token dispatcher (it runs on gloo and NCCL alike)."""
    if not shape.experts:
        return {}
    return {"num_moe_experts": shape.experts, "moe_router_topk": shape.topk, "moe_ffn_hidden_size": shape.moe_ffn,
            "moe_router_pre_softmax": not shape.norm_topk, "expert_model_parallel_size": ep,
            "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "aux_loss" if aux_loss_coef else "none",
            "moe_aux_loss_coeff": aux_loss_coef, "moe_z_loss_coeff": z_loss_coef or None,
            "moe_router_dtype": "fp32", "moe_enable_routing_replay": replay}


def transformer_config(shape: GPTShape, tp: int, pp: int, dtype: torch.dtype, recompute: bool, moe: dict | None = None):
    """The `TransformerConfig` of `shape` at (tp, pp): the HF model's maths, no fused kernels
    that need Transformer Engine or apex (`moe`: `moe_config`'s fields). A mixture of experts
    under TP runs sequence-parallel (megatron requires it there)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **(moe or {}), sequence_parallel=bool(shape.experts) and tp > 1,
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
        batch_p2p_sync=torch.cuda.is_available(),  # a CUDA stream sync after pipeline sends: none on CPU
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None, recompute_num_layers=1 if recompute else None,
    )


def sdpa_attention():
    """megatron's core attention computed by torch's `scaled_dot_product_attention` (memory-efficient
    kernels on CUDA, no [batch, heads, seq, seq] scores kept for the backward): the local spec's
    `DotProductAttention` materialises them in fp32, which at 1,024 tokens took more memory than
    the weights. The mask is megatron's (True: not attended)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
            allowed = None if attention_mask is None else ~attention_mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=attention_mask is None,
                                                 scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SDPAttention


def layer_spec(shape: GPTShape, sequence_parallel: bool = False):
    """The local spec (no Transformer Engine) with `sdpa_attention` as its core attention; under
    sequence parallelism, norms whose weight gradients megatron sums over TP (`sp_rms_norm`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, num_experts=shape.experts or None,
                                    moe_grouped_gemm=False)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = sdpa_attention()
    if sequence_parallel:
        norm = sp_rms_norm()
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        if shape.qk_norm:
            attention.q_layernorm = attention.k_layernorm = norm
    return spec


def sp_rms_norm():
    """torch's RMSNorm (what megatron's local spec uses) built the way megatron builds its norms,
    for sequence parallelism, which megatron's torch wrapper refuses: each TP rank normalises its
    part of the sequence, so its weight's gradient is a partial sum that megatron's grad
    finalisation adds up over TP (the `sequence_parallel` mark)."""

    class SequenceParallelRMSNorm(torch.nn.RMSNorm):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
            super().__init__(hidden_size, eps=eps)
            self.weight.sequence_parallel = config.sequence_parallel

    return SequenceParallelRMSNorm


def build_gpt(shape: GPTShape, tp: int, pp: int, dtype: torch.dtype, recompute: bool = False,
              stage: int = 0, moe: dict | None = None) -> nn.Module:
    """This rank's `GPTModel` (its TP shard, its EP rank's experts; weights uninitialised: they are
    loaded next; its norms on the CPU until the caller moves the model)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = transformer_config(shape, tp, pp, dtype, recompute, moe)
    tied = shape.tied and not shape.value_head
    spec = layer_spec(shape, config.sequence_parallel)
    if config.sequence_parallel:  # the final norm too (pp = 1: every layer on this rank)
        spec = TransformerBlockSubmodules(layer_specs=[spec] * shape.layers, layer_norm=sp_rms_norm())
    gpt = GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=shape.padded_vocab(tp), max_sequence_length=shape.max_positions,
                    share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                    rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
                    parallel_output=True, pre_process=stage == 0, post_process=stage == pp - 1)
    if shape.value_head and gpt.post_process:  # the critic: a replicated one-output head, no LM head
        gpt.output_layer = None
        gpt.value_head = nn.Linear(shape.hidden, 1, dtype=dtype)
    return gpt


def keep_padding_row(gpt: nn.Module, pad_token_id: int | None) -> None:
    """Hugging Face's embeddings never train the padding token's row (`padding_idx`): a lookup of
    it passes no gradient back. megatron's embedding has no such index, so its lookups of the
    padding token are detached here (a real token of that id, such as a sampled one, otherwise
    trained a row HF keeps, at zero: 100x the other gradients through the first norm)."""
    if pad_token_id is None or not getattr(gpt, "pre_process", False):
        return

    def detach_padding(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        pad = args[0] == pad_token_id  # [b, s]
        if module.reduce_scatter_embeddings:  # sequence parallelism: out is [s / tp, b, h], this rank's part
            pad = pad.t().chunk(module.tp_group.size())[module.tp_group.rank()]
        return torch.where(pad[..., None], out.detach(), out)

    gpt.embedding.word_embeddings.register_forward_hook(detach_padding)


def mark_tensor_parallel(gpt: nn.Module, rules: list[Rule]) -> None:
    """Set megatron's `tensor_model_parallel` / `partition_dim` on every split weight: its
    layers set them only when they initialise the weights (`perform_initialization`), which a
    model loaded from a checkpoint skips; the distributed optimizer's grad norm needs them."""
    params = dict(gpt.named_parameters())
    for rule in rules:
        if rule.kind != COPY:
            param = params[rule.megatron]
            param.tensor_model_parallel, param.partition_stride = True, 1
            param.partition_dim = 1 if rule.kind == ROW else 0


class MegatronRoutes:
    """`asyncrl.train.moe.RouterTap`'s record and replay on megatron's routers (its
    `RouterReplay`, one per MoE layer of this model): routes are [tokens, layers, k] over a
    forward's rows × columns as asyncrl orders them (megatron's tokens run sequence-major);
    positions with nothing recorded (-1: padding, a last token, whose outputs no log-prob reads)
    replay experts 0..k-1. Router losses stay megatron's own (`moe_aux_loss_coeff`)."""

    hf = False  # no router logits for `asyncrl.roles.routing.router_terms`

    def __init__(self, instances: list, shape: GPTShape, tp: int = 1, tp_rank: int = 0, tp_group=None) -> None:
        self.instances, self.layers, self.top_k, self.num_experts = instances, shape.layers, shape.topk, shape.experts
        self.rows, self.pad = 0, 0
        # sequence parallelism (a MoE under TP): each TP rank routes its own part of the sequence
        self.tp, self.tp_rank, self.tp_group = tp, tp_rank, tp_group

    def start(self, replay: Tensor | None = None, record: bool = False, keep_logits: bool = False,
              rows: int = 1, columns: int = 1) -> None:
        """For the next forward over `rows` × `columns` tokens: replay `replay` [tokens, layers, k],
        or record the routers' own top-k."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.rows, self.pad = rows, sp_padding(columns, self.tp)  # a sequence-parallel forward's left padding
        if replay is not None and self.pad:
            replay = F.pad(replay.reshape(rows, columns, *replay.shape[1:]), (0, 0, 0, 0, self.pad, 0), value=-1)
            replay = replay.reshape(-1, *replay.shape[2:])
        for layer, inst in enumerate(self.instances):
            inst.clear_indices()
            if replay is not None:
                idx = replay[:, layer].long()
                own = torch.arange(self.top_k, device=idx.device).expand_as(idx)
                inst.set_target_indices(self._megatron_order(torch.where(idx >= 0, idx, own)))
            inst.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD if replay is not None
                                          else RouterReplayAction.RECORD)

    def chosen(self, used: bool = False) -> Tensor:
        """The experts of the last forward [tokens, layers, k], in asyncrl's order."""
        got = [inst.target_topk_idx if inst.target_topk_idx is not None else inst.get_recorded_indices()
               for inst in self.instances]
        return torch.stack([self._asyncrl_order(self._whole(t)) for t in got], 1)

    def _whole(self, t: Tensor) -> Tensor:
        """A TP rank's part of the sequence's routes, with the other ranks' (sequence parallelism)."""
        if self.tp == 1:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    def stop(self) -> None:
        for inst in self.instances:
            inst.clear_indices()
            inst.clear_router_replay_action()

    def take_logits(self) -> list[Tensor]:
        return []

    def _megatron_order(self, t: Tensor) -> Tensor:  # [B*S, k] row-major -> [S*B, k] (this TP rank's part)
        t = t.reshape(self.rows, -1, t.shape[-1]).transpose(0, 1).reshape(-1, t.shape[-1])
        return t.chunk(self.tp)[self.tp_rank] if self.tp > 1 else t

    def _asyncrl_order(self, t: Tensor) -> Tensor:  # [S*B, k] -> [B*S, k], without the padding
        t = t.reshape(-1, self.rows, t.shape[-1])[self.pad:]
        return t.transpose(0, 1).reshape(-1, t.shape[-1])


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """Megatron's [B, 1, S, S] mask (True: not attended) from HF's [B, S] padding mask."""
    seq = attention_mask.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    own = torch.eye(seq, dtype=torch.bool, device=attention_mask.device)
    # a padding position attends to itself: no row is all masked (a NaN in a kernel's softmax)
    return (future[None, None] | ~attention_mask.bool()[:, None, None, :]) & ~own


class HFView(nn.Module):
    """`gpt` called as the roles call an HF causal LM: `input_ids`, `attention_mask`,
    `logits_to_keep` (a count or position indices) -> `.logits` [B, kept, vocab], the vocabulary
    gathered over the TP ranks and trimmed of its padding. Rotary positions count from the first
    column: RoPE scores depend only on position differences, so left padding changes nothing
    (sequence parallelism pads rows on the left to a multiple of tp that way)."""

    def __init__(self, gpt: nn.Module, shape: GPTShape) -> None:
        super().__init__()
        self.gpt = gpt
        self.vocab = shape.vocab
        self.sp = gpt.config.sequence_parallel and gpt.config.tensor_model_parallel_size > 1
        self.tp = gpt.config.tensor_model_parallel_size
        self.routes = None  # `MegatronRoutes` when the model replays routes

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int | Tensor = 0, **_: object) -> SimpleNamespace:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pad = sp_padding(input_ids.shape[1], self.tp) if self.sp else 0
        if pad:
            input_ids, attention_mask = F.pad(input_ids, (pad, 0)), F.pad(attention_mask, (pad, 0))
            if isinstance(logits_to_keep, Tensor):
                logits_to_keep = logits_to_keep + pad
        logits = self.stage(input_ids, attention_mask, logits_to_keep)
        return SimpleNamespace(logits=logits[:, pad:] if pad and not _counted(logits_to_keep) else logits)

    def stage(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int | Tensor = 0) -> Tensor:
        """This pipeline stage's output: hidden states [S, B, H] (the next stage's input; a later
        stage reads its input from the schedule), or on the last stage the logits [B, kept, vocab]."""
        gpt = self.gpt
        hidden = gpt.embedding(input_ids=input_ids, position_ids=None) if gpt.pre_process else None
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=causal_padding_mask(attention_mask),
                             rotary_pos_emb=gpt.rotary_pos_emb(input_ids.shape[1]))
        if not gpt.post_process:
            return hidden
        if self.sp:  # the whole sequence on every TP rank (the backward keeps each rank's own part)
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.logits(_keep(hidden, logits_to_keep))

    def logits(self, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits [B, S, vocab] of hidden states [S, B, H] (a critic's values [B, S, 1])."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        gpt = self.gpt
        if getattr(gpt, "value_head", None) is not None:
            return gpt.value_head(hidden).transpose(0, 1)
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        head, head.sequence_parallel = gpt.output_layer, False  # `hidden` is whole already
        logits, _ = head(hidden, weight=weight)
        return gather_from_tensor_model_parallel_region(logits)[..., :self.vocab].transpose(0, 1)


def sp_padding(seq: int, tp: int) -> int:
    """Columns a sequence-parallel forward prepends so that the sequence splits over tp ranks."""
    return -seq % tp


def _counted(keep: int | Tensor) -> bool:
    return isinstance(keep, Tensor) or keep > 0


def _keep(hidden: Tensor, keep: int | Tensor) -> Tensor:
    """The positions [S, B, H] whose logits are asked for (HF's `logits_to_keep`)."""
    if isinstance(keep, Tensor):
        return hidden.index_select(0, keep)
    return hidden[-keep:] if keep else hidden
