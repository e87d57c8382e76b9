"""Expert-parallel generation (`rollout.parallel.ep`, asyncrl.rollout.experts) on two gloo CPU ranks:
each rank keeps the block of experts it trains (FSDP2's dp shard of the fused experts; megatron's
EP rank's experts) and decodes its own rows, and the tokens, log-probs and recorded experts equal
a whole model's on the same rows, with the ranks' rows and lengths different (one rank drains
while the other still decodes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.gloo_ranks import run_ranks
from tests.rl.test_moe import tiny_qwen3_moe

EOS, PAD = 2, 0


def _prompts(rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank-specific prompts: a different number of rows and budget on each rank, one row left-padded."""
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(3, 64, (3 + 2 * rank, 7), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    return ids, mask, 5 if rank == 0 else 12


def _generate(model, rank: int) -> dict[str, torch.Tensor]:
    from asyncrl.rollout.engine import RolloutEngine, SamplingParams

    ids, mask, budget = _prompts(rank)
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    return engine.generate(ids, mask, SamplingParams(greedy=True, max_tokens=budget, n=1), record_routes=True)


def _expert_generation(rank: int, full, shards: dict[str, torch.Tensor], group) -> dict:
    """Generate this rank's rows with its generation shards, experts split over `group`; then the
    whole model's generation of the same rows."""
    from asyncrl.rollout.tp import GenerationModel

    generation = GenerationModel(full.config, full, expert_group=group)
    experts = generation.experts
    generation.bind(shards)
    out = _generate(generation.model, rank)
    served = experts.drain()
    experts.experts = 1 << 25  # more experts than fp32 holds exactly: tokens, experts and weights gathered apart
    apart = _generate(generation.model, rank)
    experts.drain()
    whole = _generate(full, rank)
    assert torch.equal(apart["responses"], out["responses"]) and torch.equal(apart["rollout_log_probs"],
                                                                           out["rollout_log_probs"])
    return {"out": out, "whole": whole, "served": served, "range": experts.expert_range(),
            "shapes": {k: tuple(v.shape) for k, v in shards.items() if ".experts." in k},
            "exchanged": experts.stats.bytes_sent}


def _layouts(world_size: int) -> tuple:
    """The training layout (data parallel over every rank) and its expert-parallel generation layout."""
    from asyncrl.single_controller.parallel import (
        GenerationParallelConfig,
        ParallelConfig,
        ParallelLayout,
        generation_layout,
    )
    from asyncrl.train import init_distributed

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), world_size)
    return layout, generation_layout(layout, GenerationParallelConfig(ep=world_size))


def _fsdp_job(rank: int, world_size: int, out_dir: Path) -> dict:
    from tests.rl.test_fsdp_engine import OPTIM, build_engine

    layout, gen = _layouts(world_size)
    engine = build_engine(tiny_qwen3_moe(), OPTIM, layout)
    full = tiny_qwen3_moe()
    resharder = engine.resharder(gen, full, torch.float32, keep_experts=True)
    shards = resharder.reshard()
    trained = {k: v for k, v in engine.model.named_parameters() if ".experts." in k}
    aliased = all(shards[k].data_ptr() == v.to_local().data_ptr() for k, v in trained.items())
    res = _expert_generation(rank, full, shards, engine.expert_group())
    res.update(received=resharder.stats.bytes_received, expected=resharder.expected_bytes_received(), aliased=aliased)
    bf16 = engine.resharder(gen, full, torch.bfloat16, keep_experts=True)
    res["bf16"] = {k: (tuple(v.shape), v.dtype) for k, v in bf16.reshard().items() if ".experts." in k}
    return res


def _megatron_job(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.train.megatron.engine import MegatronEngine

    layout, gen = _layouts(world_size)
    engine = MegatronEngine(str(out_dir / "model"), layout, optim=None, device="cpu", dtype=torch.float32, seed=0,
                            ep=world_size)
    resharder = engine.resharder(gen, None, torch.float32, keep_experts=True)
    res = _expert_generation(rank, tiny_qwen3_moe(), resharder.reshard(), engine.expert_group())
    res.update(received=resharder.stats.bytes_received, expected=resharder.expected_bytes_received())
    return res


def _check(results: list[dict]) -> None:
    """Each rank's tokens, log-probs and experts equal the whole model's; each rank held its half of the
    experts, and the rank with fewer, shorter rows served the other's remaining forwards."""
    for rank, r in enumerate(results):
        out, whole = r["out"], r["whole"]
        assert torch.equal(out["responses"], whole["responses"]), rank
        assert (out["rollout_log_probs"] - whole["rollout_log_probs"]).abs().max() <= 1e-5, rank
        assert torch.equal(out["routed_experts"], whole["routed_experts"]), rank
        assert r["range"] == range(2 * rank, 2 * rank + 2)
        assert r["shapes"] and all(shape[0] == 2 for shape in r["shapes"].values()), r["shapes"]
        assert r["received"] == r["expected"]
        assert r["exchanged"] > 0
    assert results[0]["served"] > 0 and results[1]["served"] == 0, [r["served"] for r in results]


def test_fsdp2_ranks_generate_with_the_experts_they_train_as_the_whole_model_does(tmp_path):
    """FSDP2 shards the fused experts [E, ...] by rows over the dp ranks, so each rank's training
    shard is its generation block: the reshard gathers only the dense weights (bytes as
    HybridFlow's Table 2 without the experts), hands the experts over without a copy at fp32 and
    casts them in place of a gather at bf16; generation equals the whole model's (greedy tokens,
    log-probs within 1e-5, recorded experts)."""
    results = run_ranks(_fsdp_job, 2, tmp_path, timeout_s=120)
    _check(results)
    for r in results:
        assert r["aliased"]
        assert all(shape[0] == 2 and dtype == torch.bfloat16 for shape, dtype in r["bf16"].values())
    full = tiny_qwen3_moe()
    dense = sum(p.numel() * 4 for n, p in full.named_parameters() if ".experts." not in n)
    assert results[0]["received"] == dense // 2  # the other rank's half of every dense weight


def test_megatron_expert_parallel_ranks_generate_with_their_own_experts(tmp_path):
    """From a megatron ep=2 layout: each rank's generation experts are the ones its EP rank trains
    (nothing gathered: tp=1), and generation equals the whole model's."""
    pytest.importorskip("megatron.core")
    tiny_qwen3_moe().save_pretrained(tmp_path / "model")
    results = run_ranks(_megatron_job, 2, tmp_path, timeout_s=200)
    _check(results)
    assert all(r["received"] == 0 for r in results)
