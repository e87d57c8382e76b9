"""Mixture-of-experts weights: transformers 5 fuses a layer's experts in memory and stores them per
expert; asyncrl's loaders fuse (`asyncrl.train.experts`), its exports write per expert."""

from __future__ import annotations

import torch

from asyncrl.train.experts import fuse_experts, per_expert


def tiny_qwen3_moe(vocab: int = 64, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def test_checkpoint_experts_fuse_into_the_models_tensors_and_back(tmp_path):
    """save_pretrained's per-expert tensors, fused by asyncrl's loader, equal the model's own
    fused parameters bit for bit; `per_expert` gives the checkpoint's tensors back."""
    from safetensors.torch import load_file

    from asyncrl.train.load import read_checkpoint, tied_aliases

    model = tiny_qwen3_moe()
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in disk and "model.layers.0.mlp.experts.gate_up_proj" not in disk
    loaded = read_checkpoint(str(tmp_path), tied_aliases(model), torch.float32)
    own = model.state_dict()
    assert set(loaded) == set(own) and all(torch.equal(loaded[k], own[k]) for k in own)
    back = {n: t for k, v in own.items() for n, t in per_expert(k, v)}
    assert set(back) == set(disk) and all(torch.equal(back[k], disk[k]) for k in disk)
    fused = dict(disk)
    fuse_experts(fused, set(own))
    assert all(torch.equal(fused[k], own[k]) for k in own)
