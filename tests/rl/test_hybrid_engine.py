"""The 3D-HybridEngine: generation layouts (HybridFlow §5.3, Figure 8), the micro-DP all-gather
reshard on gloo CPU ranks, and tensor-parallel generation from the resharded weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.single_controller.parallel import (
    MICRO_DP_DIMS,
    GenerationParallelConfig,
    LayoutError,
    ParallelConfig,
    ParallelLayout,
    generation_layout,
)
from asyncrl.train.reshard import STAGING_FLOOR
from tests.helpers.gloo_ranks import run_ranks


def layouts(world: int, *, t: int, p: int = 1, tg: int = 1, pg: int = 1) -> tuple[ParallelLayout, ParallelLayout]:
    train = ParallelLayout.from_config(ParallelConfig(pp=p, tp=t), world)
    return train, generation_layout(train, GenerationParallelConfig(pp=pg, tp=tg))


# layouts and groups against hand-built rank lists ---------------------------------------------------
def test_figure_8_one_four_two_to_one_two_two_two():
    """HybridFlow Figure 8: 1-4-2 training on 8 ranks -> 1-2-2-2 generation."""
    train, gen = layouts(8, t=4, tg=2)
    assert gen.describe() == "pp=1 x micro_pp=1 x dp=2 x tp=2 x micro_tp=2"
    assert train.groups(("tp",)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gen.groups(("tp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # stride t/tg
    assert gen.groups(MICRO_DP_DIMS) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive ranks
    assert gen.collect_ranks() == [0, 1, 4, 5]  # generation-TP rank 0 of each data shard
    assert [gen.data_index(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]


@pytest.mark.parametrize("world,p,t,pg,tg,gen_tp,micro_dp", [
    (4, 1, 4, 1, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),  # everything gathered
    (4, 1, 4, 1, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),  # same layout: no reshard traffic
    (4, 1, 2, 1, 1, [[0], [1], [2], [3]], [[0, 1], [2, 3]]),  # 1-2-2 -> 1-1-2-2
    (8, 2, 2, 1, 1, [[r] for r in range(8)], [[0, 1, 4, 5], [2, 3, 6, 7]]),  # pp folds into micro-DP
    (4, 2, 2, 2, 1, [[0], [1], [2], [3]], [[0, 1], [2, 3]]),  # pg = p: micro-DP over tp only
    (8, 1, 8, 1, 2, [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_generation_groups_by_hand(world, p, t, pg, tg, gen_tp, micro_dp):
    train, gen = layouts(world, t=t, p=p, tg=tg, pg=pg)
    assert gen.groups(("tp",)) == gen_tp
    assert gen.groups(MICRO_DP_DIMS) == micro_dp
    assert gen.size("pp") * gen.size("tp") * len(micro_dp[0]) == p * t  # pg·tg·dg = p·t


@pytest.mark.parametrize("world,p,t,pg,tg", [(8, 1, 4, 1, 2), (8, 2, 2, 1, 2), (16, 2, 4, 2, 2), (8, 1, 8, 1, 4)])
def test_each_generation_shard_contains_the_training_shard(world, p, t, pg, tg):
    """A rank's generation TP/PP coordinate covers its training one: tp = g·(t/tg) + m."""
    train, gen = layouts(world, t=t, p=p, tg=tg, pg=pg)
    for rank in range(world):
        tc, gc = train.coords(rank), gen.coords(rank)
        assert tc["tp"] // (t // tg) == gc["tp"] and tc["tp"] % (t // tg) == gc["micro_tp"]
        assert tc["pp"] // (p // pg) == gc["pp"] and tc["dp"] == gc["dp"]
        # the micro-DP group holds the rest of this rank's generation shard
        group = gen.group_of(rank, MICRO_DP_DIMS)
        assert sorted(train.coord(r, "tp") for r in group if train.coord(r, "pp") == tc["pp"]) == \
            list(range(gc["tp"] * (t // tg), (gc["tp"] + 1) * (t // tg)))


def test_generation_layout_errors_name_the_setting():
    train = ParallelLayout.from_config(ParallelConfig(tp=4), 4)
    with pytest.raises(LayoutError, match=r"rollout.parallel.tp=3 must divide actor.parallel.tp=4.*\[1, 2, 4\]"):
        generation_layout(train, GenerationParallelConfig(tp=3))
    with pytest.raises(LayoutError, match="rollout.parallel.pp=2 must divide actor.parallel.pp=1"):
        generation_layout(train, GenerationParallelConfig(pp=2))


def test_config_rejects_layouts_that_do_not_fit():
    from asyncrl.config import rl_config
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.parallel.tp=2 must divide actor.parallel.tp=1"):
        rl_config({"rollout": {"parallel": {"tp": 2}}})
    with pytest.raises(ConfigError, match=r"actor.parallel pp=1 x tp=3 .* world size 2.*trainer.n_workers=2"):
        rl_config({"actor": {"parallel": {"tp": 3}}})
    with pytest.raises(ConfigError, match="critic.parallel.pp=2: pipeline stages need an LM head"):
        rl_config({"critic": {"parallel": {"pp": 2}}})
    with pytest.raises(ConfigError, match="rollout.parallel.pp=2: pipeline-parallel generation is not implemented"):
        rl_config({"actor": {"parallel": {"pp": 2}}, "rollout": {"parallel": {"pp": 2}}})
    assert rl_config({"actor": {"parallel": {"pp": 2}}}).actor.parallel.pp == 2
    assert rl_config({"actor": {"parallel": {"tp": 2}}}).actor.parallel.tp == 2


def test_the_rollout_protocol_splits_over_dp_and_micro_dp():
    from asyncrl.single_controller.batch import Batch
    from asyncrl.single_controller.protocols import THREE_D_ALL_MICRO_DP, CallContext, get_protocol

    _, gen = layouts(8, t=4, tg=2)
    proto = get_protocol(THREE_D_ALL_MICRO_DP)
    ctx = CallContext("actor", "generate_sequences", 8, {"rollout": gen})
    batch = Batch({"x": torch.arange(8).unsqueeze(1)})
    calls = proto.distribute(ctx, (batch,), {})
    rows = {r: calls[r][0][0]["x"].flatten().tolist() for r in range(8)}
    assert rows[0] == rows[2] == [0, 1] and rows[1] == rows[3] == [2, 3]  # broadcast in a gen TP group
    assert rows[4] == rows[6] == [4, 5] and rows[5] == rows[7] == [6, 7]
    outs = {r: Batch({"x": calls[r][0][0]["x"] * (1 if r in (0, 1, 4, 5) else -1)}) for r in range(8)}
    assert proto.collect(ctx, outs)["x"].flatten().tolist() == list(range(8))  # from gen-TP rank 0


# the reshard on 4 gloo ranks ---------------------------------------------------------------------------
SCENARIOS = {  # name: (train tp, generation tp, vocab, tied, train pp)
    "t4-tg2": (4, 2, 64, True, 1),  # Table 2's case at d=1: Shard(0) gathered in place, Shard(1) bucketed
    "t2-d2-tg1": (2, 1, 64, False, 1),
    "t2-d2-tg2-odd-vocab": (2, 2, 31, True, 1),  # replicated embedding/head, gathered over dp only
    "t1-d4": (1, 1, 64, True, 1),  # the default: pure FSDP, full gather per rank
    "p2-t2-tg1": (2, 1, 64, False, 2),  # pipeline stages: gathered within each, then across
    "p2-d2": (1, 1, 64, False, 2),
}


def _model(vocab: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=tied, eos_token_id=vocab - 1, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _reshard_scenarios(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.rollout import RolloutEngine, SamplingParams
    from asyncrl.rollout.tp import GenerationModel
    from asyncrl.train import init_distributed, parallelize
    from asyncrl.train.reshard import Resharder
    from asyncrl.train.tp import planned_shard_dim

    init_distributed()
    prompts = torch.randint(1, 30, (3, 5), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(prompts)
    greedy = SamplingParams(greedy=True, max_tokens=6)
    results = {}
    for name, (t, tg, vocab, tied, p) in SCENARIOS.items():
        train, gen = layouts(world_size, t=t, tg=tg, p=p)
        model, plain = _model(vocab, tied), _model(vocab, tied)
        model = parallelize(model, train)
        tp_group = None
        for ranks in gen.groups(("tp",)):
            g = torch.distributed.new_group(ranks) if len(ranks) > 1 else None
            tp_group = g if rank in ranks else tp_group
        generation = GenerationModel(plain.config, model, tp_group)
        resharder = Resharder(model, train, gen, full_model=generation.model)
        engine = RolloutEngine(generation.model, eos_token_id=vocab - 1, pad_token_id=0)
        mismatched, split_bytes = [], 0
        for rounds in range(2):  # the second round checks that a training update reaches generation
            shards = resharder.reshard()
            for pname, full in plain.named_parameters():  # every stage's weights
                k = planned_shard_dim(pname, plain, t)
                want = full if k is None else full.chunk(tg, dim=k)[gen.coord(rank, "tp")]
                if not torch.equal(shards[pname], want):
                    mismatched.append((rounds, pname))
                if rounds == 0 and k is not None:
                    split_bytes += full.numel() * full.element_size()
            generation.bind(shards)
            out = engine.generate(prompts, mask, greedy)
            ref = RolloutEngine(plain, eos_token_id=vocab - 1, pad_token_id=0).generate(prompts, mask, greedy)
            stats = resharder.stats
            generation.unbind()
            resharder.release()
            with torch.no_grad():  # a "training step": the same change to the sharded and the plain model
                for q in plain.parameters():
                    q.mul_(0.5)
                for q in model.parameters():
                    q.to_local().mul_(0.5)
        # the same reshard in bf16 from the fp32 masters: the cast shards, half the bytes
        half = Resharder(model, train, gen, full_model=generation.model, dtype=torch.bfloat16)
        shards = half.reshard()
        bf16_wrong = [pname for pname, full in plain.named_parameters()
                      if shards[pname].dtype != torch.bfloat16 or not torch.equal(shards[pname], (
                          full if (k := planned_shard_dim(pname, plain, t)) is None
                          else full.chunk(tg, dim=k)[gen.coord(rank, "tp")]).to(torch.bfloat16))]
        generation.bind(shards)
        bf16_out = engine.generate(prompts, mask, greedy)
        generation.unbind()
        results[name] = {
            "bf16_mismatched": bf16_wrong, "bf16_received": half.stats.bytes_received,
            "bf16_expected": half.expected_bytes_received(), "bf16_buffer": half.stats.buffer_bytes,
            "bf16_logp_finite": bool(torch.isfinite(bf16_out["rollout_log_probs"]).all()),
            "mismatched": mismatched, "tokens_equal": torch.equal(out["responses"], ref["responses"]),
            "logp_diff": (out["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max().item(),
            "received": stats.bytes_received, "expected": resharder.expected_bytes_received(),
            "split_bytes": split_bytes, "buffer": stats.buffer_bytes, "peak": stats.peak_extra_bytes,
            "weightless_after": all(p.is_meta for p in generation.model.parameters()),
        }
    return results


@pytest.fixture(scope="module")
def reshard_job(tmp_path_factory) -> list[dict]:
    return run_ranks(_reshard_scenarios, 4, tmp_path_factory.mktemp("reshard"), timeout_s=110)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reshard_is_bit_identical_to_a_full_gather(reshard_job, name):
    for rank, res in enumerate(reshard_job):
        assert res[name]["mismatched"] == [], f"rank {rank}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_greedy_generation_from_resharded_weights_matches_the_plain_model(reshard_job, name):
    for res in reshard_job:
        assert res[name]["tokens_equal"] and res[name]["logp_diff"] < 1e-5
        assert res[name]["weightless_after"]  # unbind dropped the weights


def test_reshard_bytes_match_hybridflow_table_2(reshard_job):
    """t=4, tg=2, d=1: each rank receives (t·p − tg·pg)/(tg·pg·t·p)·M; its only extra memory
    is the generation shard M/(tg·pg) (plus a bucket in flight)."""
    res = reshard_job[0]["t4-tg2"]
    m = res["split_bytes"]
    assert res["received"] == res["expected"] == (4 - 2) * m // (2 * 4)
    assert res["buffer"] == m // 2
    # p=2, t=2 -> tg=1: this rank's stage gathered inside its TP pair, then the other stage's
    # half of the model broadcast across stages: every rank ends up receiving M - M/(t·p)·(share)
    for r in reshard_job:
        assert r["p2-t2-tg1"]["buffer"] >= r["p2-t2-tg1"]["split_bytes"]
    for r in reshard_job:
        for name in SCENARIOS:
            assert r[name]["received"] == r[name]["expected"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bf16_generation_weights_from_fp32_masters_move_half_the_bytes(reshard_job, name):
    """Training in bf16 over fp32 master weights, the generation weights are the masters cast to
    bf16 on each rank before the gather: the same values, half the bytes received and held."""
    for rank, res in enumerate(reshard_job):
        got = res[name]
        assert got["bf16_mismatched"] == [], f"rank {rank}"
        assert got["bf16_received"] == got["bf16_expected"] == got["received"] // 2
        assert got["bf16_buffer"] * 2 >= got["buffer"] and got["bf16_logp_finite"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reshard_peak_is_the_generation_shard_plus_one_bucket(reshard_job, name):
    for r in reshard_job:
        got = r[name]
        assert got["buffer"] <= got["peak"] <= got["buffer"] + max(STAGING_FLOOR, got["buffer"] // 32)


def test_pure_fsdp_reshard_gathers_the_whole_model(reshard_job):
    res = reshard_job[0]["t1-d4"]
    full = res["buffer"]
    assert res["received"] == pytest.approx(full * 3 / 4, rel=0.01)  # (N−1)/N·M, padding aside


# on a GPU ------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _cuda_reshard(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.rollout import RolloutEngine, SamplingParams
    from asyncrl.rollout.tp import GenerationModel
    from asyncrl.train import init_distributed
    from asyncrl.train.fsdp import apply_fsdp
    from asyncrl.train.reshard import Resharder

    init_distributed()
    train, gen = layouts(1, t=1)
    model, plain = _model(64, True).cuda(), _model(64, True).cuda()
    apply_fsdp(model, train.submesh("dp"))
    resharder = Resharder(model, train, gen)
    generation = GenerationModel(plain.config, model)
    t0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0[0].record()
    generation.bind(resharder.reshard())
    t0[1].record()
    torch.cuda.synchronize()
    prompts = torch.randint(1, 30, (3, 5), generator=torch.Generator().manual_seed(7)).cuda()
    greedy = SamplingParams(greedy=True, max_tokens=6)
    out = RolloutEngine(generation.model, eos_token_id=63, pad_token_id=0, device="cuda").generate(
        prompts, torch.ones_like(prompts), greedy)
    ref = RolloutEngine(plain, eos_token_id=63, pad_token_id=0, device="cuda").generate(
        prompts, torch.ones_like(prompts), greedy)
    return {"equal": torch.equal(out["responses"], ref["responses"]), "bytes": resharder.stats.bytes_received,
            "ms": t0[0].elapsed_time(t0[1]), "device": str(next(iter(generation.model.parameters())).device)}


@pytest.mark.gpu
@gpu
def test_reshard_and_generate_on_cuda(tmp_path):
    """One GPU: the layouts coincide, so the generation weights are the training shards (no bytes
    move) and greedy generation equals the plain model's."""
    (res,) = run_ranks(_cuda_reshard, 1, tmp_path)
    print("cuda reshard:", res)
    assert res["equal"] and res["bytes"] == 0 and res["device"].startswith("cuda")


@pytest.mark.parametrize("torch_before_2_13", [False, True])
def test_the_reshards_all_gather_runs_on_torch_before_2_13(torch_before_2_13, monkeypatch):
    """torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single`; the CUDA builds of vLLM
    pin an older torch, where the reshard must use the old name (it failed there: AttributeError)."""
    import datetime

    import torch.distributed as dist

    from asyncrl.train.reshard import all_gather_single

    if torch_before_2_13:
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
    try:
        out = torch.zeros(4)
        all_gather_single(out, torch.arange(4.0))
        assert torch.equal(out, torch.arange(4.0))
    finally:
        dist.destroy_process_group()
