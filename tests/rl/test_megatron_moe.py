"""Mixture-of-experts models on the Megatron backend: Qwen3-MoE and Mixtral checkpoints map to
megatron-core's MoE layers (router, experts split over expert-parallel ranks and TP) and back
exactly; on two gloo CPU ranks at expert parallelism 2 and at TP 2 (sequence-parallel) the logits
and the weights equal Hugging Face's, the generation reshard holds every expert, training steps
learn, routes replay as Hugging Face's do, and a checkpoint resumes on one rank with the export
equal to the trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from asyncrl.train.megatron.convert import GPTShape, dict_reader, hf_tensors, megatron_shard  # noqa: E402
from tests.helpers import forked  # noqa: E402
from tests.helpers.gloo_ranks import run_ranks  # noqa: E402

SEQ = 9  # odd: a sequence-parallel forward pads it to a multiple of tp


def hf_moe(arch: str):
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=0)
    if arch == "mixtral":
        config, cls = T.MixtralConfig(**common, intermediate_size=16, num_local_experts=4), T.MixtralForCausalLM
    else:
        config = T.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                  norm_topk_prob=arch == "qwen3_moe")
        cls = T.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # norms away from 1 and a router with clear preferences, so a mix-up shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("gate.weight"):
                p.normal_(0, 1.0)
    return model


ARCHS = ("qwen3_moe", "qwen3_moe_unnormalised", "mixtral")


def _table_2_bytes(sd: dict[str, torch.Tensor], tp: int, ep: int) -> int:
    """HybridFlow's Table 2 for a reshard into generation TP 1, from the HF tensors: each rank
    receives (t - 1)/t of every fp32 tensor the training layout splits t ways (each expert's
    weights over ep x tp, the attention projections and embeddings over tp); norms and routers
    are whole on every rank."""
    def ways(name: str) -> int:
        if "norm" in name or name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
            return 1
        return tp * ep if ".experts." in name else tp

    return sum(v.numel() * 4 * (ways(k) - 1) // ways(k) for k, v in sd.items())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_moe_checkpoints_map_to_megatron_and_back_exactly(arch: str, tp: int, ep: int, tmp_path) -> None:
    """Every checkpoint tensor (per expert, under the family's names) survives HF -> Megatron
    (tp shards of each EP rank's experts) -> HF bit for bit, each expert on exactly one EP rank."""
    from safetensors.torch import load_file

    model = hf_moe(arch)
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    shape = GPTShape.from_hf(model.config)
    read, experts, dense = dict_reader(disk), [], set()
    for ep_rank in range(ep):
        for rule in shape.rules(ep_rank=ep_rank, ep=ep):
            shards = [megatron_shard(rule, read, shape, tp, r) for r in range(tp)]
            for name, t in hf_tensors(rule, shards, shape, tp).items():
                assert torch.equal(t, disk[name]), name
                experts.append(name) if ".experts." in name else dense.add(name)
    assert len(experts) == len(set(experts)) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert set(experts) | dense == set(disk)


def probe() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (3, SEQ), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


def _job(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.config import OptimConfig
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.megatron.engine import MegatronEngine

    init_distributed()
    tp, ep = (int(x) for x in (out_dir / "layout").read_text().split())
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp), world_size)
    optim = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6)
    res = {}
    for arch in ARCHS:
        engine = MegatronEngine(str(out_dir / arch), layout, optim=optim, device="cpu", dtype=torch.float32, seed=0,
                                ep=ep, aux_loss_coef=0.01)
        ids, mask = probe()
        with torch.no_grad():
            res[f"{arch}/logits"] = engine.model(input_ids=ids, attention_mask=mask).logits
        res[f"{arch}/sd"] = engine.full_state_dict(rank0_only=False)
        from asyncrl.single_controller.parallel import GenerationParallelConfig, generation_layout

        resharder = engine.resharder(generation_layout(layout, GenerationParallelConfig(tp=1)), None, torch.float32)
        res[f"{arch}/reshard"] = {k: v.clone() for k, v in resharder.reshard().items()}
        res[f"{arch}/reshard_bytes"] = (resharder.stats.bytes_received, resharder.expected_bytes_received())
        resharder.release()
    res.update(_replay(out_dir, layout, ep))
    arch = "qwen3_moe"  # training: the same rows on both ranks, the loss falls; a checkpoint resumes at ep=1
    engine = MegatronEngine(str(out_dir / arch), layout, optim=optim, device="cpu", dtype=torch.float32, seed=0, ep=ep)
    rows = torch.randint(0, 64, (4, SEQ), generator=torch.Generator().manual_seed(3))
    steps = [engine.train_step([rows], _lm_loss) for _ in range(4)]
    res["losses"], res["grad_norm"] = [m["loss"] for m in steps], steps[0]["grad_norm"]
    engine.save_checkpoint(out_dir / "ckpt", extra={}, export_dtype=torch.float32)
    res["trained"] = engine.full_state_dict(rank0_only=False)
    return res


def replay_routes(ids: torch.Tensor) -> torch.Tensor:
    """Random routes [rows, columns, layers, k] (two distinct experts of 4), -1 in one row's padding."""
    first = torch.randint(0, 4, (*ids.shape, 2, 1), generator=torch.Generator().manual_seed(5))
    routes = torch.cat([first, (first + 1 + torch.randint(0, 3, first.shape, generator=torch.Generator().manual_seed(6)))
                        % 4], -1).to(torch.int8)
    routes[0, :4] = -1
    return routes


def _replay(out_dir: Path, layout, ep: int) -> dict:
    """Megatron's router replay (`MegatronRoutes`): own routes recorded, random routes replayed."""
    from asyncrl.roles import routing
    from asyncrl.single_controller.batch import Batch
    from asyncrl.train.megatron.engine import MegatronEngine
    from asyncrl.train.moe import flat_routes

    engine = MegatronEngine(str(out_dir / "qwen3_moe"), layout, optim=None, device="cpu", dtype=torch.float32,
                            seed=0, ep=ep, router_replay=True)
    ids, mask = probe()
    mb = Batch({"input_ids": ids, "attention_mask": mask, "routed_experts": replay_routes(ids)})
    from asyncrl.config import MoEConfig

    out = {}
    with torch.no_grad():
        tap = routing.start(engine.model, mb, MoEConfig(router_replay="rollout"), replay=None)
        engine.model(input_ids=ids, attention_mask=mask)
        out["replay/own"] = tap.chosen()
        tap = routing.start(engine.model, mb, MoEConfig(router_replay="rollout"), replay="routed_experts")
        out["replay/logits"] = engine.model(input_ids=ids, attention_mask=mask).logits
        out["replay/used"] = tap.chosen(used=True)
        tap.stop()
    out["replay/routes"] = flat_routes(mb["routed_experts"])
    return out


def _lm_loss(model, ids):
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return ce, {"ce": ce.detach()}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_moe")
    for arch in ARCHS:
        hf_moe(arch).save_pretrained(root / arch)
    return root


def _resume_job(rank: int, world_size: int, out_dir: Path) -> dict:
    """The ep=2 job's checkpoint, resumed on one rank without expert parallelism."""
    from asyncrl.config import OptimConfig
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.megatron.engine import MegatronEngine

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), world_size)
    engine = MegatronEngine(str(out_dir / "qwen3_moe"), layout, optim=OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6),
                            device="cpu", dtype=torch.float32, seed=0)
    fresh = {}
    with torch.no_grad():  # (tp, ep) = (1, 1): the checkpoint's logits before loading the trained weights
        ids, mask = probe()
        fresh["logits"] = engine.model(input_ids=ids, attention_mask=mask).logits
    engine.load_checkpoint(out_dir / "ckpt")
    return {"resumed": engine.full_state_dict(rank0_only=False), **fresh}


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_moe_across_ranks_equals_hugging_face_and_trains(tp: int, ep: int, moe_checkpoints, tmp_path) -> None:
    """At (tp, ep) = (1, 2) (each rank half the experts) and (2, 1) (each expert split over TP, the
    sequence split over TP: megatron's sequence parallelism) on two gloo ranks, and (2, 2) on four
    (slow): logits within 1e-4 of
    Hugging Face's on left-padded rows, the full state dict and the tg=1 generation reshard equal
    the checkpoint's tensors (the other ranks' parts received: bytes as expected), four steps
    on the same rows lower the loss, and the checkpoint resumes on one rank (tp=ep=1) with the same
    weights, which the HF export holds too. Router replay (megatron's `RouterReplay`): its own
    routes are Hugging Face's top-k, and replaying random routes gives Hugging Face's logits under
    the same replay (`asyncrl.train.moe`)."""
    import shutil

    from transformers import AutoModelForCausalLM

    for arch in ARCHS:
        shutil.copytree(moe_checkpoints / arch, tmp_path / arch)
    (tmp_path / "layout").write_text(f"{tp} {ep}")
    results = run_ranks(_job, tp * ep, tmp_path, timeout_s=400)
    ids, mask = probe()
    for arch in ARCHS:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float32)
        with torch.no_grad():
            want = hf(input_ids=ids, attention_mask=mask).logits
        sd = hf.state_dict()
        for r in results:
            diff = (r[f"{arch}/logits"] - want).abs()[mask.bool()].max()
            assert diff < 1e-4, (arch, float(diff))
            for key in ("sd", "reshard"):
                assert set(r[f"{arch}/{key}"]) == set(sd), (arch, key)
                assert all(torch.equal(sd[k], v) for k, v in r[f"{arch}/{key}"].items()), (arch, key)
            got, expected = r[f"{arch}/reshard_bytes"]
            assert got == expected == _table_2_bytes(sd, tp, ep) > 0, (arch, got, expected, _table_2_bytes(sd, tp, ep))
    # router replay: megatron's own routes are HF's top-k; replayed random routes give HF's replayed logits
    from asyncrl.train.moe import flat_routes, tap_of

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3_moe", dtype=torch.float32)
    tap, routes = tap_of(hf), replay_routes(ids)
    with torch.no_grad():
        tap.start(record=True)
        hf(input_ids=ids, attention_mask=mask)
        own = tap.chosen()
        tap.start(replay=flat_routes(routes), record=True)
        replayed = hf(input_ids=ids, attention_mask=mask).logits
    tap.stop()
    keep = mask.reshape(-1).bool()  # padding attends differently in the two (its outputs are never read)
    for r in results:
        assert torch.equal(r["replay/own"][keep].sort(-1).values, own[keep].sort(-1).values)
        assert (r["replay/logits"] - replayed).abs()[mask.bool()].max() < 1e-4
        valid = (r["replay/routes"] >= 0).all(-1).all(-1)
        assert torch.equal(r["replay/used"][valid].long(), r["replay/routes"][valid].long())
    # the first step's gradient is HF's: a real token of the padding id (in these rows) trains no
    # embedding row (HF's padding_idx; its row is zero, and megatron trained it 100x harder before)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3_moe", dtype=torch.float32)
    rows = torch.randint(0, 64, (4, SEQ), generator=torch.Generator().manual_seed(3))
    assert (rows == 0).any() and hf.model.embed_tokens.weight[0].abs().sum() == 0
    _lm_loss(hf, rows)[0].backward()
    want = torch.sqrt(sum((p.grad ** 2).sum() for p in hf.parameters() if p.grad is not None))
    assert abs(results[0]["grad_norm"] - float(want)) < 1e-4 * float(want), (results[0]["grad_norm"], float(want))
    # four steps on the same 4 rows: Hugging Face's model (the same maths) drops 0.76-1.02 over
    # 10 seeds of the weights and rows (median 0.96); this seed 0.861, and megatron's run here
    # 0.861 at (tp, ep) = (1, 2) and (2, 1). A fit of fixed rows, not a learning claim
    losses = results[0]["losses"]
    assert losses[0] - losses[-1] > 0.5, losses
    trained = results[0]["trained"]
    one_rank = run_ranks(_resume_job, 1, tmp_path, timeout_s=120)[0]
    assert all(torch.equal(trained[k], v) for k, v in one_rank["resumed"].items())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3_moe", dtype=torch.float32)
    with torch.no_grad():
        assert (one_rank["logits"] - hf(input_ids=ids, attention_mask=mask).logits).abs()[mask.bool()].max() < 1e-4
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(trained[k], exported[k]) for k in trained)


def test_moe_quickstart_on_megatron_with_expert_parallelism_2(tmp_path) -> None:
    """`moe_quickstart` with actor.backend=megatron actor.moe.ep=2 through the launcher: 3 GRPO steps
    with the rollout's experts replayed (the native engine generates expert-parallel, each rank with the
    experts its EP rank trains: rollout.parallel.ep=2; the trainer's old log-probs equal the rollout's),
    megatron's router losses logged, the export per expert."""
    import json
    import sys

    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "moe_quickstart", "actor.backend=megatron",
           "actor.moe.ep=2", "rollout.parallel.ep=2", "actor.recompute_log_prob=always", "actor.moe.aux_loss_coef=0.001",
           "trainer.total_steps=3", "trainer.eval_every=3", f"trainer.output_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "trainer.loggers=[jsonl]"]
    res = forked.run(cmd, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert all(r["rollout/logprob_diff_max"] < 1e-5 and 0.5 < r["moe/aux_loss"] < 8 and r["perf/expert_exchange_mb"] > 0
               for r in steps), steps
    from safetensors import safe_open

    summary = json.loads(res.stdout.strip().splitlines()[-1])
    names = {n for f in Path(summary["checkpoint"]).glob("*.safetensors") for n in safe_open(str(f), "pt").keys()}  # noqa: SIM118
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
