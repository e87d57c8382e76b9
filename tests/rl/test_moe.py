"""Mixture-of-experts weights: transformers 5 fuses a layer's experts in memory and stores them per
expert; asyncrl's loaders fuse (`asyncrl.train.experts`), its exports write per expert."""

from __future__ import annotations

import torch

from asyncrl.train.experts import fuse_experts, per_expert
from tests.helpers import forked


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


# routing: record, replay, router losses ---------------------------------------------------------
def _sampled(model, dtype=torch.float32, rows: int = 4, seed: int = 0):
    """A native-engine rollout of `model` (a copy in `dtype`) that records each token's experts."""
    import copy

    from asyncrl.rollout.engine import RolloutEngine, SamplingParams

    engine = RolloutEngine(copy.deepcopy(model).to(dtype), eos_token_id=2, pad_token_id=0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (rows, 10), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # a left-padded prompt
    return engine.generate(ids, mask, SamplingParams(temperature=1.0, max_tokens=8, n=2), generator=gen,
                           record_routes=True)


def _trainer_pass(model, out, replay=None, grad=False):
    from asyncrl.roles.forward import response_forward
    from asyncrl.single_controller.batch import Batch
    from asyncrl.train.moe import flat_routes, tap_of

    tap = tap_of(model)
    tap.start(replay=None if replay is None else flat_routes(replay), record=True)
    with torch.set_grad_enabled(grad):
        logp, _ = response_forward(model, Batch(out))
    used, own = tap.chosen(used=True), tap.chosen()
    if not grad:
        tap.stop()
    return logp, used, own


def test_the_native_engine_records_the_experts_the_trainer_routes_to():
    """Every prompt and response token's experts per layer; -1 for left padding, finished rows and
    the last token (no forward read it). In fp32 the trainer routes every recorded token alike
    and replaying the routes changes no log-prob bit."""
    from asyncrl.train.moe import flat_routes

    model = tiny_qwen3_moe().eval()
    out = _sampled(model)
    routes = out["routed_experts"]
    assert routes.dtype == torch.int8 and routes.shape == (*out["input_ids"].shape, 2, 2)
    assert (routes[0:2, :3] == -1).all() and (routes[:, -1] == -1).all()  # padding, last token
    assert ((routes >= 0).all(-1).all(-1) == out["attention_mask"].bool()).sum() >= routes[:, :-1].shape[0] * 10
    free, used, _ = _trainer_pass(model, out)
    replayed, _, _ = _trainer_pass(model, out, replay=routes)
    recorded = flat_routes(routes)
    valid = (recorded >= 0).all(-1).all(-1)
    assert torch.equal(used[valid].sort(-1).values, recorded[valid].long().sort(-1).values)
    assert torch.equal(free, replayed)
    mask = out["response_mask"].bool()
    assert (free - out["rollout_log_probs"]).abs()[mask].max() < 1e-5


def test_replayed_experts_replace_top_k_and_the_router_keeps_its_gradient():
    """Recorded routes (here: random ones) are the experts the forward uses, weighted by the live
    router's renormalised probabilities, and the loss still reaches the router's weights."""
    from asyncrl.train.moe import flat_routes, tap_of

    model = tiny_qwen3_moe().eval()
    out = _sampled(model)
    gen = torch.Generator().manual_seed(1)
    random_routes = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(out["input_ids"].numel() * 2)])
    random_routes = random_routes.reshape(*out["input_ids"].shape, 2, 2).to(torch.int8)
    free, _, _ = _trainer_pass(model, out)
    logp, used, _ = _trainer_pass(model, out, replay=random_routes, grad=True)
    assert torch.equal(used, flat_routes(random_routes).long())
    assert (logp - free).abs().max() > 1e-3  # other experts: other log-probs
    logp.sum().backward()
    tap_of(model).stop()
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in tap_of(model).routers)
    # gate weights of a replayed token: its recorded experts' softmax probabilities, renormalised
    from asyncrl.train.moe import replay_scores

    router = tap_of(model).routers[0]
    logits = torch.randn(3, 4)
    w, idx = replay_scores(router, logits, torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long),
                           torch.tensor([[3, 1], [-1, -1], [0, 2]]))
    p = logits.softmax(-1)
    assert torch.equal(idx, torch.tensor([[3, 1], [0, 0], [0, 2]]))  # -1: the router's own choice stays
    assert torch.allclose(w[0], p[0, [3, 1]] / p[0, [3, 1]].sum())


def test_replay_holds_when_activation_checkpointing_recomputes_a_layer():
    """Gradients with replayed routes equal with and without activation checkpointing (the
    recompute in the backward replays the same experts)."""
    from asyncrl.train.moe import tap_of

    out = _sampled(tiny_qwen3_moe().eval())
    routes = torch.randint(0, 4, (*out["input_ids"].shape, 2, 1), generator=torch.Generator().manual_seed(2))
    routes = torch.cat([routes, (routes + 1) % 4], -1).to(torch.int8)  # two distinct experts per token
    grads = []
    for checkpointing in (False, True):
        model = tiny_qwen3_moe().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logp, _, _ = _trainer_pass(model, out, replay=routes, grad=True)
        logp.sum().backward()
        tap_of(model).stop()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1])
    assert max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0]) < 1e-6


def test_replay_closes_most_of_a_bf16_rollouts_log_prob_gap():
    """A bf16 rollout routes some tokens elsewhere than the fp32 trainer (benchmarks.moe's model:
    agreement 0.997); replaying its routes makes the trainer use its experts (agreement 1.0) and
    shrinks the largest log-prob gap (0.025 -> 0.005 there; asserted: to under half)."""
    from benchmarks.moe import routing_numbers

    res = routing_numbers(torch.bfloat16)
    assert res["routing_agreement_replay"] == 1.0 and res["routing_agreement_no_replay"] < 1.0, res
    assert res["logprob_diff_replay"] < res["logprob_diff_no_replay"] / 2, res


def test_router_losses_and_load_by_hand():
    """Load-balancing loss 1.0 when balanced (Hugging Face's is k times ours), z-loss the mean
    squared log-partition, loads per expert, agreement as shared selections."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from asyncrl.algorithms import core

    logits = torch.zeros(4, 4)
    chosen = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    ones = torch.ones(4)
    assert float(core.load_balancing_loss(logits, chosen, ones)) == 1.0
    skewed, peaked = torch.tensor([[0, 1]] * 4), torch.tensor([[20.0, 20.0, -20.0, -20.0]] * 4)
    assert float(core.load_balancing_loss(logits, skewed, ones)) == 1.0  # the router spreads its probability
    assert abs(float(core.load_balancing_loss(peaked, skewed, ones)) - 2.0) < 1e-6  # 4/(4*2) * (4 + 4) * 1/2
    z = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    top = z.softmax(-1).topk(2).indices
    hf = load_balancing_loss_func((z,), num_experts=8, top_k=2)
    assert torch.allclose(hf, 2 * core.load_balancing_loss(z, top, torch.ones(6)), atol=1e-6)
    assert torch.allclose(core.router_z_loss(z, torch.ones(6)), (z.logsumexp(-1) ** 2).mean())
    load = core.expert_load(chosen[:, None, :], torch.tensor([1, 1, 1, 0]), 4)
    assert load.tolist() == [[2.0, 2.0, 1.0, 1.0]]
    a = torch.tensor([[[0, 1]], [[2, 3]]])
    assert core.routing_agreement(a, torch.tensor([[[1, 0]], [[2, 0]]]), torch.ones(2)) == 0.75


def test_router_replay_settings_that_cannot_work_exit_2(tmp_path, capsys):
    """vLLM, a split rollout pool, multi-turn rollouts and pipeline stages: one paragraph each."""
    from asyncrl.launch import main

    cases = [(["rollout.engine=vllm"], "rollout.engine=native"),
             (["actor.moe.ep=2"], "actor.backend=megatron"),  # FSDP2 has no expert parallelism
             (["trainer.placement=split", "trainer.n_workers=2", "rollout.n_workers=1"], "trainer.placement=colocated"),
             (["actor.parallel.pp=2", "trainer.n_workers=2"], "parallel.pp=1")]
    for extra, hint in cases:
        out = tmp_path / "out"
        assert main(["--config-name", "moe_quickstart", f"trainer.output_dir={out}", "actor.moe.router_replay=rollout",
                     *extra]) == 2, extra
        err = capsys.readouterr().err
        assert ("actor.moe.router_replay" in err or "actor.moe.ep" in err) and hint in err, (extra, err)
        assert not out.exists()


def test_moe_layouts_asyncrl_cannot_run_exit_2_before_anything_starts(tmp_path, capsys):
    """Tensor parallelism or FSDP2 pipeline stages of a MoE model (neither loads its experts yet), an
    expert-parallel size that does not divide the experts, expert-parallel generation over other ranks
    than training splits the experts over, compiled or in vLLM: exit 2 with one paragraph naming the key, before a worker
    starts (the model's config.json is read once the head is up, as for the other layout checks)."""
    from asyncrl.launch import main

    model = tmp_path / "moe"
    tiny_qwen3_moe().save_pretrained(model)  # 4 experts
    from asyncrl.models.tiny import build_tokenizer

    build_tokenizer().save_pretrained(model)
    cases = [(["actor.parallel.tp=2", "trainer.n_workers=2"], "actor.parallel.tp=2: "),
             (["actor.backend=megatron", "actor.moe.ep=3", "trainer.n_workers=3"], "actor.moe.ep=3 must divide"),
             (["rollout.parallel.tp=2", "actor.parallel.tp=2", "trainer.n_workers=2"], "without tensor parallelism"),
             (["actor.parallel.pp=2", "trainer.n_workers=2"], "actor.parallel.pp=2: "),
             (["rollout.parallel.ep=3", "trainer.n_workers=3"], "has 4 experts: set rollout.parallel.ep to a divisor"),
             (["rollout.parallel.ep=2", "trainer.n_workers=4"], "must equal the ranks the actor splits"),
             (["rollout.parallel.ep=2", "rollout.decode=compiled"], "rollout.decode=eager"),
             (["rollout.parallel.ep=2", "rollout.engine=vllm"], "runs in the native engine")]
    for extra, hint in cases:
        out = tmp_path / "out"
        assert main(["--config-name", "grpo", f"trainer.output_dir={out}", f"model.path={model}", *extra]) == 2, extra
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("asyncrl-launch: ") and hint in last, (extra, last)
        assert not list(out.glob("logs/*/*worker*")), extra


def test_the_planner_counts_a_mixture_of_experts_total_and_active_parameters():
    """Published counts (Qwen3-30B-A3B: 30.5B total, 3.3B active; Mixtral 8x7B: 46.7B, 12.9B), the
    tiny model's own numel from its config.json, and plans without TP for a MoE model."""
    from asyncrl.plan.workload import KNOWN_MODELS, ModelSpec

    qwen, mixtral = KNOWN_MODELS["Qwen/Qwen3-30B-A3B"], KNOWN_MODELS["mistralai/Mixtral-8x7B-v0.1"]
    # the model card's "3.3B activated" is 3.35 B counted (embedding and head included) cut to one decimal
    assert round(qwen.params / 1e9, 1) == 30.5 and int(qwen.active_params / 1e8) / 10 == 3.3
    assert round(mixtral.params / 1e9, 1) == 46.7 and round(mixtral.active_params / 1e9, 1) == 12.9
    model = tiny_qwen3_moe()
    spec = ModelSpec.from_hf_config("tiny", model.config.to_dict())
    norms = sum(p.numel() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n)
    assert spec.params == sum(p.numel() for p in model.parameters()) - norms
    assert spec.active_ffn == 2 * 16 and spec.experts == 4
    # expert parallelism on megatron: each rank holds its experts' weights and grad buffer only;
    # the optimizer state is the same share (an expert's over the dp / ep ranks that hold it)
    from asyncrl.plan.memory import megatron_state

    one, two = megatron_state(qwen, 1, 8, 2.0), megatron_state(qwen, 1, 8, 2.0, ep=8)
    saved = qwen.expert_params * (1 - 1 / 8)
    assert one["weights (TP x PP shard)"] - two["weights (TP x PP shard)"] == 2.0 * saved
    assert one["gradients (fp32 buffer)"] - two["gradients (fp32 buffer)"] == 4.0 * saved
    assert one["Adam moments (over DP)"] == two["Adam moments (over DP)"]


def test_qwen3_30b_a3b_plans_on_8_h100s_with_expert_parallel_generation_and_235b_is_refused(capsys):
    """Issue 63's bar: Qwen3-30B-A3B with 16 K-token responses on one node of 8 H100s gets a plan of
    at most 78 GiB a device, the search choosing expert-parallel generation (each rank its 16 of 128
    experts), the optimizer in host memory, recomputed activations and generation waves the KV cache
    holds, or the weights in host memory while the rollout runs (actor.offload=all: every row at
    once, the plan it prefers); its command passes the config check; a node's host memory bounds what is
    offloaded (plan.host_memory_gib). Qwen3-235B-A22B on 4 x 8 is refused with the figure (its training
    state alone, 16 bytes a parameter over 32 devices)."""
    import json

    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.cli import main as plan_main
    from asyncrl.plan.memory import Knobs, generation
    from asyncrl.plan.workload import KNOWN_MODELS

    user = ["cluster.nnodes=1", "cluster.gpus_per_node=8", "model.path=Qwen/Qwen3-30B-A3B", "data.max_prompt_len=1024",
            "rollout.max_tokens=16384"]
    assert plan_main(["--config-name", "grpo", "--json", *user]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["memory_gib_per_device"] <= 78, out
    for chosen in ("rollout.parallel.ep=8", "actor.offload=all", "actor.gradient_checkpointing=true"):
        assert chosen in out["overrides"], out["overrides"]
    cfg = rl_config(load_config("grpo", [*user, *out["overrides"]]))
    assert cfg.rollout.parallel.ep == cfg.actor.parallel.dp == 8 and cfg.actor.offload == "all"
    # the rollout beside the process alone: its generation weights and every row's KV cache at once
    phases = out["phases_gib"]
    assert phases["generate"] < phases["optimizer step"] == out["memory_gib_per_device"], phases
    spec = KNOWN_MODELS["Qwen/Qwen3-30B-A3B"]
    dense = spec.params - spec.expert_params
    weights = [next(iter(generation(spec, 8, 100, 1, Knobs(gen_ep=ep)).values())) for ep in (1, 8)]
    assert weights == [2 * spec.params, 2 * (dense + spec.expert_params / 8)], weights
    # a node's host memory holds what is offloaded (8 x 64 GiB with the weights, 8 x 28 GiB without):
    # with 600 GiB (480 usable) only the optimizer goes; with 200 nothing fits, and the refusal says why
    assert plan_main(["--config-name", "grpo", "--json", *user, "plan.host_memory_gib=600"]) == 0
    smaller = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["overrides"]
    assert "actor.offload=optimizer" in smaller and "rollout.parallel.ep=8" in smaller, smaller
    assert plan_main(["--config-name", "grpo", *user, "plan.host_memory_gib=200"]) == 1
    said = capsys.readouterr().err
    assert "actor.offload=optimizer) would need 227 GiB of host memory a node, more than the 160 GiB usable" in said, said
    big = ["cluster.nnodes=4", "cluster.gpus_per_node=8", "cluster.insecure=true", "model.path=Qwen/Qwen3-235B-A22B",
           "data.max_prompt_len=1024", "rollout.max_tokens=16384"]
    assert plan_main(["--config-name", "grpo", *big]) == 1
    said = capsys.readouterr().err
    assert "(235.09B parameters): its training state alone is 109.5 GiB per device" in said, said
    assert "with its experts split over all 32 (rollout.parallel.ep=32)" in said, said


def test_expert_parallelism_is_searched_and_priced_on_megatron(tmp_path, capsys):
    """A Qwen3-MoE shape (9.6 B, 64 experts, top-8) on 8 H100s with megatron: the search tries
    ep in {1, 2, 4, 8} (FSDP2: 1), each rank's state is megatron's with experts over ep, the two
    all-to-alls per MoE layer and pass cost time; a configured ep is kept, and the plan's command
    passes the config check."""
    import json

    from transformers import Qwen3MoeConfig

    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.cli import main as plan_main
    from asyncrl.plan.cost import Mesh, Strategy, forward_backward, resident_bytes
    from asyncrl.plan.hardware import load_profile
    from asyncrl.plan.memory import Knobs, megatron_state
    from asyncrl.plan.search import SearchSpace
    from asyncrl.plan.workload import ModelSpec, Workload, rl_calls

    config = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=28, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=64, num_experts_per_tok=8, tie_word_embeddings=False).to_dict()
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3MoeForCausalLM"]}))
    spec, h100 = ModelSpec.from_hf_config("moe", config), load_profile("h100")
    calls = rl_calls("grpo", critic=False, ref=True, reward_model=False, recompute=False, actor_epochs=1, actor_minis=1)
    w = Workload(models={"actor": spec, "ref": spec}, calls=calls, sequences=256, prompt_len=1024, response_len=2048)
    knobs = Knobs(compute_bytes=2, megatron=True)
    assert {s.ep for s in SearchSpace(w, h100, 1, 8, knobs=knobs).strategies("actor", 8)} == {1, 2, 4, 8}
    assert {s.ep for s in SearchSpace(w, h100, 1, 8, knobs=Knobs(compute_bytes=2)).strategies("actor", 8)} == {1}
    held = [resident_bytes(spec, Strategy(8, 1, ep=ep), True, knobs, "actor") for ep in (1, 8)]
    assert held[1] == sum(megatron_state(spec, 1, 8, 2, ep=8).values()) < held[0]
    train = next(c for c in calls if c.kind == "train")
    times = [forward_backward(spec, Strategy(8, 1, ep=ep), w, train, Mesh(8, 8), h100, knobs).time_s for ep in (1, 8)]
    assert times[1] > times[0]  # the all-to-alls
    user = ["cluster.nnodes=1", "cluster.gpus_per_node=8", "trainer.n_workers=8", f"model.path={tmp_path / 'moe'}",
            "actor.backend=megatron", "actor.moe.ep=4", "data.max_prompt_len=1024", "rollout.max_tokens=2048"]
    assert plan_main(["--config-name", "grpo", "--json", *user]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "actor.moe.ep=4" in out["overrides"]
    cfg = rl_config(load_config("grpo", [*user, *out["overrides"]]))
    assert cfg.actor.moe.ep == 4 and cfg.actor.parallel.dp % 4 == 0


def test_the_estimate_prices_the_recorded_experts_in_their_own_integer_type():
    """Routing replay carries each token's experts (every layer's top-k) with its row from generation
    to the update: Qwen3-30B-A3B's 128 experts take int16 (768 bytes a token, 0.4 GiB for a rank's 32
    rows of 17 K tokens), an 8-expert model's int8; nothing without replay."""
    from asyncrl.config import rl_config
    from asyncrl.plan.memory import ROUTES, worker_memory
    from asyncrl.plan.workload import KNOWN_MODELS, ModelSpec
    from asyncrl.train.moe import route_dtype

    assert route_dtype(128) == torch.int16 and route_dtype(8) == torch.int8 and route_dtype(127) == torch.int8
    spec = KNOWN_MODELS["Qwen/Qwen3-30B-A3B"]
    base = {"trainer": {"n_workers": 8}, "data": {"max_prompt_len": 1024}, "rollout": {"max_tokens": 16384}}
    kept = worker_memory(rl_config({**base, "actor": {"moe": {"router_replay": "rollout"}}}), spec, True, 80e9)
    plain = worker_memory(rl_config(base), spec, True, 80e9)
    rows, seq = 32 * 8 / 8, 1024 + 16384
    assert kept.parts[ROUTES] == rows * seq * 48 * 8 * 2 and ROUTES not in plain.parts
    assert kept.phases["update"] - plain.phases["update"] == kept.parts[ROUTES]
    tiny = ModelSpec.from_hf_config("tiny", tiny_qwen3_moe().config.to_dict())
    cfg = rl_config({"actor": {"moe": {"router_replay": "rollout"}}, "trainer": {"n_workers": 2}})
    rows, seq = cfg.data.batch_size * cfg.rollout.n / 2, cfg.data.max_prompt_len + cfg.rollout.max_tokens
    assert worker_memory(cfg, tiny, True, 80e9).parts[ROUTES] == rows * seq * tiny.layers * 2 * 1  # int8


def test_mixtral_checkpoints_load_and_export_under_their_own_names(tmp_path):
    """Mixtral's checkpoints name the block `block_sparse_moe` and its experts' projections w1 / w3
    / w2 (transformers 5 renames them at load): asyncrl's loader fuses them into the model's
    tensors and `per_expert` writes the checkpoint's names back."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    from asyncrl.train.experts import MIXTRAL, expert_names_at
    from asyncrl.train.load import read_checkpoint, tied_aliases

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in disk and expert_names_at(tmp_path) == MIXTRAL
    loaded = read_checkpoint(str(tmp_path), tied_aliases(model), torch.float32)
    own = model.state_dict()
    assert set(loaded) == set(own) and all(torch.equal(loaded[k], own[k]) for k in own)
    back = {n: t for k, v in own.items() for n, t in per_expert(k, v, MIXTRAL)}
    assert set(back) == set(disk) and all(torch.equal(back[k], disk[k]) for k in disk)


def test_qwen2_moe_routers_replay_beside_their_shared_expert():
    """Qwen2-MoE (a shared expert with its own sigmoid gate beside the routed ones, top-k without
    renormalisation): its routers are found, own routes replay bit for bit, random ones change
    the logits, and the shared expert's gate is not taken for a router."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from asyncrl.train.moe import flat_routes, tap_of

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).eval()
    tap = tap_of(model)
    assert tap.layers == 2 and tap.top_k == 2
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tap.start(record=True)
        free = model(ids).logits
        own = tap.chosen()
        tap.start(replay=own)
        assert torch.equal(model(ids).logits, free)
        tap.start(replay=flat_routes((own.reshape(2, 8, 2, 2) + 1) % 4))
        assert (model(ids).logits - free).abs().max() > 1e-4
    tap.stop()


def test_a_split_rollout_pool_receives_the_experts(tmp_path):
    """`moe_quickstart` with a rollout pool of its own (the split weight sync, experts fused as the
    trainer holds them): 3 steps, the trainer's old log-probs equal the pool's after every sync."""
    import json
    import sys

    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "moe_quickstart", "actor.moe.router_replay=none",
           "trainer.placement=split", "trainer.n_workers=1", "rollout.n_workers=1", "actor.recompute_log_prob=always",
           "trainer.total_steps=3", "trainer.eval_every=3", f"trainer.output_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "trainer.loggers=[jsonl]"]
    res = forked.run(cmd, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert len(steps) == 3 and all(r["rollout/logprob_diff_max"] < 1e-5 and r["perf/weight_sync_mb"] > 0
                                   for r in steps), steps


def test_the_tiny_moes_dense_twin_has_its_attention_and_its_active_parameters():
    """model.build_tiny.qk_norm=true builds a dense Qwen3: the attention of the tiny Qwen3-MoE
    (queries and keys normalised per head, the same tensors) and one MLP with the active experts'
    parameters; unset, the quickstart's Llama (no such norms); with experts it cannot be false."""
    import pytest

    from asyncrl.config import ConfigError, rl_config
    from asyncrl.models.tiny import build_config, build_tokenizer
    from asyncrl.train.load import lm_class

    tok = build_tokenizer([str(i) for i in range(10)])
    kinds = {name: build_config(tok, hidden=64, layers=2, heads=2, **kw)
             for name, kw in (("moe", {"experts": 8}), ("twin", {"qk_norm": True}), ("llama", {}))}
    models = {name: lm_class(c).from_config(c) for name, c in kinds.items()}
    assert [type(m).__name__ for m in models.values()] == ["Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"]
    shapes = {name: {k: tuple(v.shape) for k, v in m.state_dict().items()} for name, m in models.items()}
    attention = {k: v for k, v in shapes["moe"].items() if ".self_attn." in k}
    assert any("q_norm" in k for k in attention) and all(shapes["twin"][k] == v for k, v in attention.items())
    assert not any("_norm" in k for k in shapes["llama"] if ".self_attn." in k)
    def mlp(name: str, part: str = ".mlp.") -> int:
        return sum(v.numel() for k, v in models[name].state_dict().items() if part in k)

    assert mlp("moe", ".mlp.experts.") * 2 // 8 == mlp("twin") == mlp("llama")  # top-2 of 8 experts active
    with pytest.raises(ConfigError, match="qk_norm"):
        rl_config({"model": {"build_tiny": {"experts": 8, "qk_norm": False}}})
