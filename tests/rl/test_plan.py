"""asyncrl-plan: the cost model's physics, the searches against each other, the CLI's plans as
launchable overrides, the profiler, and its errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.plan.cli import main as plan_main
from asyncrl.plan.cost import (
    Mesh,
    Strategy,
    forward_backward,
    generate,
    offloaded_bytes,
    resident_bytes,
)
from asyncrl.plan.hardware import load_profile
from asyncrl.plan.search import ROLLOUT, SearchSpace, exhaustive, hybridflow, mcmc, set_partitions
from asyncrl.plan.workload import KNOWN_MODELS, Call, Workload, rl_calls

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"

LLAMA7 = KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]
H100 = load_profile("h100")


def ppo(model=LLAMA7, sequences=256, prompt=512, response=512, mbs=(4,)) -> Workload:
    calls = rl_calls("ppo", critic=True, ref=True, reward_model=False, recompute=False, actor_epochs=1, actor_minis=1)
    return Workload(models={"actor": model, "critic": model.as_value_model(), "ref": model}, calls=calls,
                    sequences=sequences, prompt_len=prompt, response_len=response, micro_batch_sizes=mbs)


def test_model_shapes_count_parameters_like_the_checkpoints():
    assert LLAMA7.params == 6_738_415_616  # Llama-2-7b-hf's published count
    assert KNOWN_MODELS["meta-llama/Llama-2-13b-hf"].params == 13_015_864_320
    assert KNOWN_MODELS["Qwen/Qwen2.5-0.5B"].params == pytest.approx(494_032_768, rel=1e-3)


def test_set_partitions_are_the_bell_numbers():
    assert [len(list(set_partitions(tuple("abcde"[:n])))) for n in range(1, 6)] == [1, 2, 5, 15, 52]
    for part in set_partitions(("a", "b", "c", "d")):
        assert sorted(u for s in part for u in s) == ["a", "b", "c", "d"]


def test_costs_follow_the_physics():
    w = ppo()
    train = Call("actor", "train", "train")
    t = {d: forward_backward(LLAMA7, Strategy(d, 1, 1, 4), w, train, Mesh(d, 8), H100).time_s for d in (2, 4, 8)}
    assert t[2] > t[4] > t[8] and t[2] / t[8] < 4.0  # more devices help, never better than linearly
    inside = forward_backward(LLAMA7, Strategy(2, 8, 1, 4), w, train, Mesh(16, 8), H100).time_s
    across = forward_backward(LLAMA7, Strategy(1, 16, 1, 4), w, train, Mesh(16, 16), replace(H100, devices_per_node=8))
    assert across.time_s > inside  # tensor parallelism over the network is slower than inside a node
    big = KNOWN_MODELS["meta-llama/Llama-2-70b-hf"]
    assert math.isinf(generate(big, Strategy(1, 1), w, Mesh(1, 8), H100, H100.mem_bytes).time_s)  # 140 GB of weights
    few = generate(LLAMA7, Strategy(1, 1), replace(w, sequences=8), Mesh(1, 8), H100, H100.mem_bytes).time_s
    many = generate(LLAMA7, Strategy(1, 1), replace(w, sequences=64), Mesh(1, 8), H100, H100.mem_bytes).time_s
    assert few < many < 8 * few  # decoding is memory-bound: 8x the rows costs far less than 8x


def test_the_planner_prices_held_out_waves_of_decode_slots_rows():
    """The native engine decodes `rollout.decode_slots` held-out rows at once whatever a batch's
    rows: a planned rollout's memory is the larger of its wave and an evaluation wave."""
    from asyncrl.plan.memory import Knobs

    w = replace(ppo(), sequences=8)
    at = {rows: generate(LLAMA7, Strategy(1, 1), w, Mesh(1, 8), H100, H100.mem_bytes,
                         Knobs(compute_bytes=2, all_rows=True, decode_rows=rows)).memory_bytes for rows in (0, 4, 64)}
    assert at[4] < at[0]  # a batch of 8 in waves of 4, and evaluation waves no larger
    assert at[64] > 1.5 * at[0]  # 64 held-out rows at once cost more than the batch's 8


def test_searches_agree_with_exhaustive_search_on_small_clusters():
    w = ppo()
    space = SearchSpace(w, H100, 1, 8, deployable=False, allow_split=False)
    brute = exhaustive(space)
    assert brute.best is not None
    hf = hybridflow(SearchSpace(w, H100, 1, 8, deployable=False, allow_split=False))
    mc = mcmc(SearchSpace(w, H100, 1, 8, deployable=False, allow_split=False), seconds=3.0, seed=0)
    assert brute.cost.step_s <= hf.cost.step_s <= 1.05 * brute.cost.step_s
    assert brute.cost.step_s <= mc.cost.step_s <= 1.05 * brute.cost.step_s
    assert space.cost(brute.best).step_s == pytest.approx(brute.cost.step_s)


def test_deployable_plans_keep_to_what_asyncrl_launch_runs():
    space = SearchSpace(ppo(), H100, 2, 8, deployable=True)
    parts = list(space.placements())
    assert sorted(len(p) for p in parts) == [1, 2] and ((ROLLOUT,) in parts[1] or (ROLLOUT,) in parts[0])
    assert all(s.pp == 1 for s in space.strategies("critic", 16))
    assert all(s.tp % s.gen_tp == 0 for s in space.strategies("actor", 16))
    assert {s.gen_tp for s in space.strategies(ROLLOUT, 8)} == {1}


def test_the_7b_plan_runs_as_launch_overrides(capsys):
    user = ["cluster.nnodes=16", "cluster.gpus_per_node=8", "cluster.key_dir=/etc/asyncrl/keys",
            "model.path=meta-llama/Llama-2-7b-hf",
            "plan.device=h100", "plan.time_limit_s=3"]
    assert plan_main(["--config-name", "ppo", "--json", *user]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"] == "h100" and out["nnodes"] == 16 and out["devices_per_node"] == 8
    assert out["search_s"] < 10 and out["step_s"] > 0
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config

    cfg = rl_config(load_config("ppo", [*user, *out["overrides"]]))  # asyncrl-launch takes them as they are
    used = cfg.trainer.n_workers + (cfg.rollout.n_workers if cfg.trainer.placement == "split" else 0)
    assert used == 128  # no idle devices
    par = cfg.actor.parallel
    assert par.dp * par.tp * par.pp == cfg.trainer.n_workers


def test_the_search_moves_the_optimizer_to_host_memory_only_when_the_devices_need_it(capsys):
    """Qwen2.5-7B's GRPO on 2 H100s fits only with AdamW's state in host memory between its steps:
    the plan says so (actor.offload=optimizer, its command passes the config check), its estimate
    holds the state for the optimizer's step alone and prices moving it; on 4 H100s it stays put."""
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.memory import OFFLOADED, Knobs, worker_memory

    user = ["cluster.nnodes=1", "model.path=Qwen/Qwen2.5-7B", "data.max_prompt_len=1024", "rollout.max_tokens=2048",
            "plan.device=h100"]
    plans = {}
    for gpus in (2, 4):
        assert plan_main(["--config-name", "grpo", "--json", *user, f"cluster.gpus_per_node={gpus}"]) == 0
        plans[gpus] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "actor.offload=optimizer" in plans[2]["overrides"] and "actor.offload=optimizer" not in plans[4]["overrides"]
    cfg = rl_config(load_config("grpo", [*user, "cluster.gpus_per_node=2", *plans[2]["overrides"]]))
    assert cfg.actor.offload == "optimizer"
    spec = KNOWN_MODELS["Qwen/Qwen2.5-7B"]
    moved, kept = (worker_memory(c, spec, True, H100.mem_bytes) for c in (cfg, replace(cfg, actor=replace(
        cfg.actor, offload="none"))))
    adam = moved.parts[OFFLOADED]
    assert adam == kept.parts["Adam moments (fp32 shard)"] == 8 * spec.params / 2
    assert moved.phases["update"] == kept.phases["update"] - adam and moved.phases["optimizer step"] <= kept.total
    assert moved.host["steps (offloaded optimizer, each rank)"] == adam
    s = Strategy(dp=1, tp=2, micro_batch=2, gen_tp=2)
    calls = rl_calls("grpo", critic=False, ref=False, reward_model=False, recompute=False, actor_epochs=1, actor_minis=1)
    w = Workload(models={"actor": spec}, calls=calls, sequences=512, prompt_len=1024, response_len=2048)
    train = next(c for c in w.calls if c.kind == "train")
    plain, off = (forward_backward(spec, replace(s, offload=o), w, train, Mesh(2, 8), H100) for o in (False, True))
    assert off.time_s - plain.time_s == pytest.approx(train.optimizer_steps * 2 * adam / H100.host_bw)
    # megatron moves its distributed optimizer's Adam moments the same way
    mcfg = replace(cfg, actor=replace(cfg.actor, backend="megatron"))
    mmoved, mkept = (worker_memory(c, spec, True, H100.mem_bytes) for c in (mcfg, replace(mcfg, actor=replace(
        mcfg.actor, offload="none"))))
    assert mmoved.parts[OFFLOADED] == mkept.parts["Adam moments (over DP)"] > 0
    assert mmoved.phases["update"] == mkept.phases["update"] - mmoved.parts[OFFLOADED]
    mknobs = Knobs(compute_bytes=2, megatron=True)
    assert (resident_bytes(spec, s, True, mknobs, "actor") - resident_bytes(spec, replace(s, offload=True), True, mknobs,
                                                                             "actor") == offloaded_bytes(spec, replace(s, offload=True), mknobs) > 0)


def test_table_and_explain_name_the_plan(capsys):
    assert plan_main(["--config-name", "ppo", "--explain", "cluster.gpus_per_node=8",
                      "model.path=Qwen/Qwen2.5-1.5B", "plan.device=h200"]) == 0
    text = capsys.readouterr().out
    assert "placement" in text and "where the step's time goes" in text and "asyncrl-launch --config-name ppo" in text


@pytest.mark.parametrize("override, says", [
    ("plan.devcie=h100", "plan.device"),  # a typo, with the closest key
    ("plan.device=tpu9", "no such profile"),
    ("plan.search=annealing", "plan.search"),
    ("model.path=/nowhere/model", "not a known model name"),
])
def test_bad_plan_input_is_a_usage_error(override, says, capsys):
    assert plan_main(["--config-name", "ppo", "cluster.gpus_per_node=8", override]) == 2
    assert says in capsys.readouterr().err


def test_cpu_plan_without_a_profile_says_how_to_measure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert plan_main(["--config-name", "quickstart", f"model.path={tmp_path / 'm'}"]) == 2
    assert "asyncrl-plan profile" in capsys.readouterr().err


def test_profile_measures_this_machine_and_plans_with_it(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cpu.json"
    assert plan_main(["profile", "--quick", "--out", str(out), f"model.path={tmp_path / 'm'}"]) == 0
    prof = json.loads(out.read_text())
    assert prof["kind"] == "cpu" and prof["peak_flops"] > 1e8 and prof["intra_bw"] > 1e6
    assert 0 < prof["train_efficiency"] <= 1 and 0 < prof["infer_efficiency"] <= 1 and prof["intra_latency_s"] > 0
    assert not (tmp_path / "m").exists()  # planning reads the model's shape, never builds it
    capsys.readouterr()
    assert plan_main(["--config-name", "quickstart", f"plan.device={out}", f"model.path={tmp_path / 'm'}"]) == 0
    assert "trainer.placement=" in capsys.readouterr().out


def test_a_profile_fit_on_a_busy_machine_keeps_a_positive_per_token_cost():
    """The per-token slope comes from the two largest token counts; where another process made the
    largest timed no slower than the next (a CI run's profile once read infer_efficiency -8.4),
    the largest count's time per token stands in for it."""
    from asyncrl.plan.profile import _fit

    assert _fit([8, 256, 1024], [1.0, 2.0, 4.0]) == (1.0 - 8 * 2 / 768, 2 / 768)  # the plain case
    fixed, slope = _fit([8, 256, 1024], [0.5, 2.0, 1.9])  # 1024 tokens timed faster than 256
    assert slope == 1.9 / 1024 and fixed == 0.5 - 8 * slope


# memory per device (asyncrl.plan.memory) ------------------------------------------------------
def test_the_7b_recipe_fits_8_h100s_by_the_numbers(capsys):
    assert plan_main(["--config-dir", str(EXAMPLES), "--config-name", "grpo_math_qwen7b", "--json",
                      "model.path=Qwen/Qwen2.5-7B-Instruct", "cluster.nnodes=1", "cluster.gpus_per_node=8",
                      "plan.device=h100"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < out["memory_gib_per_device"] < 80, out
    parts = out["parts_gib"]
    assert parts["Adam moments (fp32 shard)"] == pytest.approx(2 * parts["gradients (fp32 shard)"], rel=1e-3)
    assert "vLLM (weights + KV cache)" in parts and out["peak_phase"] in out["phases_gib"]


@pytest.mark.parametrize("engine", ["vllm", "native", "lora"])
def test_the_search_prices_memory_with_the_preflights_model(engine, capsys):
    """The `GiB/dev` the search ranks plans by is `asyncrl.plan.memory`'s estimate of the same plan
    (one memory model): for every plan it prints, the config it launches gives the same bytes."""
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.memory import worker_memory

    user = ["model.path=Qwen/Qwen2.5-7B-Instruct", "cluster.nnodes=1", "cluster.gpus_per_node=8", "plan.device=h100",
            f"rollout.engine={'vllm' if engine == 'lora' else engine}", "plan.runners_up=3"]
    user += {"native": ["data.batch_size=64"],
             "lora": ["actor.lora.rank=32", "actor.parallel.tp=1", "rollout.parallel.tp=1"]}.get(engine, [])
    assert plan_main(["--config-dir", str(EXAMPLES), "--config-name", "grpo_math_qwen7b", "--json", *user]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = rl_config(load_config("grpo_math_qwen7b", [*user, *out["overrides"]], str(EXAMPLES)))
    estimate = worker_memory(cfg, KNOWN_MODELS["Qwen/Qwen2.5-7B-Instruct"], on_gpu=True, device_bytes=H100.mem_bytes)
    (searched,) = out["memory"].values()
    assert searched == pytest.approx(estimate.total, rel=1e-6), (searched / 2**30, estimate.phases)
    assert out["memory_gib_per_device"] == pytest.approx(searched / 2**30, abs=1e-3)
    assert ("vLLM (weights + KV cache)" in estimate.parts) == (engine != "native")
    if engine == "lora":  # adapters train, the base is the reference: Adam's share a few percent of the base's
        parts = estimate.parts
        assert parts["reference policy (shard)"] == 0.0
        assert parts["Adam moments (fp32 shard)"] < 0.05 * 2 * parts["weights (fp32 master shard)"]


def test_a_model_that_cannot_fit_exits_nonzero_with_the_number_and_the_knob(tmp_path, capsys):
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
              "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))  # Qwen2.5-72B's shape, no weights
    assert plan_main(["--config-dir", str(EXAMPLES), "--config-name", "grpo_math_qwen7b", f"model.path={tmp_path}",
                      "cluster.nnodes=1", "cluster.gpus_per_node=8", "plan.device=h100"]) == 1
    err = capsys.readouterr().err
    assert "135.4 GiB per device" in err and "cluster.nnodes" in err, err


def test_the_memory_estimate_follows_the_knobs():
    from asyncrl.config import rl_config
    from asyncrl.plan.memory import worker_memory
    from asyncrl.plan.workload import ModelSpec

    spec = ModelSpec("qwen0.5b-shape", 24, 896, 14, 2, 4864, 151936, tied=True)
    base = {"data": {"batch_size": 16, "max_prompt_len": 256}, "rollout": {"n": 4, "max_tokens": 512},
            "actor": {"micro_batch_size": 8}}

    def est(n_workers: int, **actor):
        cfg = rl_config({**base, "trainer": {"n_workers": n_workers}, "actor": {**base["actor"], **actor}})
        return worker_memory(cfg, spec, on_gpu=True)

    dp2, dp4 = est(2), est(4)
    assert dp2.parts["Adam moments (fp32 shard)"] == pytest.approx(2 * dp4.parts["Adam moments (fp32 shard)"])
    assert est(4, gradient_checkpointing=True).parts["update activations"] < dp4.parts["update activations"] / 5
    small = est(4, max_tokens_per_micro_batch=1536)  # two rows of 768 tokens instead of eight
    assert small.parts["update logits and their gradient"] < 0.6 * dp4.parts["update logits and their gradient"]
    assert dp4.total == max(dp4.phases.values()) and len(dp4.lines()) == len(dp4.parts) + 1 + len(dp4.host)
    assert set(dp4.host) == {"load (rank 0)", "save (rank 0)"}  # on a GPU: host memory, not the device's
    waves = rl_config({**base, "trainer": {"n_workers": 4}, "rollout": {**base["rollout"], "decode_slots": 4}})
    kv = "KV cache (native engine)"
    assert worker_memory(waves, spec, on_gpu=True).parts[kv] == pytest.approx(dp4.parts[kv] / 4)  # 16 rows -> 4
    staged = sum(dp4.parts[k] for k in ("weights (fp32 master shard)", "gradients (fp32 shard)", "Adam moments (fp32 shard)"))
    cfg = rl_config({**base, "trainer": {"n_workers": 4, "async_save": True}})
    assert worker_memory(cfg, spec, on_gpu=True).host["save (rank 0)"] == pytest.approx(dp4.host["save (rank 0)"] + staged)


def test_a_filled_token_budget_is_the_largest_the_estimate_fits():
    """actor.max_tokens_per_micro_batch=-1 (`fill_token_budget`): the largest budget whose update
    phase the estimate prices within 85 % of the device — one token more would not fit, a smaller
    device gets a smaller budget, a roomy one stops at micro_batch_size rows — and a device too
    small for one row is a ConfigError naming the knobs; the critic cannot take -1."""
    from asyncrl.config import rl_config
    from asyncrl.plan.memory import FILL_FRACTION, GIB, fill_token_budget, worker_memory
    from asyncrl.plan.workload import ModelSpec
    from transport.checks import ConfigError

    spec = ModelSpec("qwen0.5b-shape", 24, 896, 14, 2, 4864, 151936, tied=True)
    cfg = rl_config({"data": {"batch_size": 64, "max_prompt_len": 256}, "rollout": {"n": 4, "max_tokens": 768},
                     "trainer": {"n_workers": 1}, "actor": {"micro_batch_size": 256, "max_tokens_per_micro_batch": -1}})
    longest = 1024
    budgets = []
    for gib in (24, 40):
        budget, peak = fill_token_budget(cfg, spec, True, gib * GIB)
        assert longest <= budget < 256 * longest and peak <= FILL_FRACTION * gib * GIB
        assert worker_memory(cfg, spec, True, gib * GIB, budget + 1).phases["update"] > FILL_FRACTION * gib * GIB
        budgets.append(budget)
    assert budgets[0] < budgets[1]
    assert fill_token_budget(cfg, spec, True, 10_000 * GIB)[0] == 256 * longest  # micro_batch_size rows at most
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        fill_token_budget(cfg, spec, True, 8 * GIB)
    with pytest.raises(ConfigError, match="critic.max_tokens_per_micro_batch"):
        rl_config({"critic": {"max_tokens_per_micro_batch": -1}})
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch"):
        rl_config({"actor": {"max_tokens_per_micro_batch": -2}})


def test_a_lora_critic_is_priced_by_its_adapters():
    """critic.lora: the planner prices the critic's training state by its adapters (a few percent
    of full fine-tuning's) and keeps its strategies to FSDP alone, as it does the actor's."""
    from asyncrl.config import rl_config
    from asyncrl.plan.cost import resident_bytes
    from asyncrl.plan.memory import Knobs

    spec = KNOWN_MODELS["Qwen/Qwen2.5-7B-Instruct"]
    cfg = rl_config({"algorithm": {"name": "ppo"}, "critic": {"lora": {"rank": 32}}})
    knobs = Knobs.from_config(cfg, True, H100.mem_bytes, spec)
    assert knobs.critic_lora_params > 0 and knobs.lora_params == 0
    full = resident_bytes(spec, Strategy(8, 1), True, Knobs.from_config(rl_config({}), True, H100.mem_bytes, spec),
                          unit="critic")
    adapted = resident_bytes(spec, Strategy(8, 1), True, knobs, unit="critic")
    actor = resident_bytes(spec, Strategy(8, 1), True, knobs, unit="actor")
    assert actor == full and adapted < 0.4 * full  # the frozen body's bf16/fp32 shard stays


def test_lora_params_count_an_adapted_embedding():
    """An adapted embedding costs rank x (vocab + hidden) parameters, counted as the trainer's
    apply_lora creates them (a tied head shares it; an untied lm_head adds its own)."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.plan.memory import lora_params
    from asyncrl.plan.workload import ModelSpec
    from asyncrl.train.lora import apply_lora

    for tied in (True, False):
        config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        targets = ["all-linear", "embed_tokens"] + ([] if tied else ["lm_head"])
        apply_lora(model, 4, 8.0, targets=targets)
        made = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        spec = ModelSpec("t", 2, 32, 4, 2, 64, 96, tied=tied)
        assert lora_params(spec, SimpleNamespace(rank=4, target_modules=targets)) == made


def test_sequence_parallelism_is_priced_and_offered_for_long_sequences():
    """sp divides a micro-batch's activations and scored positions over its ranks (plus the
    all-to-all buffers) and costs all-to-all time; the search offers it from 8 K tokens."""
    from asyncrl.config import rl_config
    from asyncrl.plan.memory import worker_memory
    from asyncrl.plan.workload import ModelSpec

    spec = ModelSpec("qwen0.5b-shape", 24, 896, 14, 2, 4864, 151936, tied=True)
    base = {"data": {"batch_size": 4, "max_prompt_len": 1024}, "rollout": {"n": 2, "max_tokens": 15360},
            "trainer": {"n_workers": 4}}

    def est(sp: int):
        return worker_memory(rl_config({**base, "actor": {"micro_batch_size": 1, "gradient_checkpointing": True,
                                                          "parallel": {"sp": sp}}}), spec, on_gpu=True)

    one, two = est(1), est(2)
    assert two.parts["update activations"] == pytest.approx(one.parts["update activations"] / 2)
    assert two.parts["Ulysses all-to-all buffers"] > 0 and "Ulysses all-to-all buffers" not in one.parts
    assert two.parts["log-prob logits"] < 0.6 * one.parts["log-prob logits"]
    w = replace(ppo(sequences=64, prompt=1024, response=15360), micro_batch_sizes=(1,))
    mesh = Mesh(8, 8)
    call = next(c for c in w.calls if c.kind == "train" and c.model == "actor")
    plain, sharded = (forward_backward(LLAMA7, Strategy(8, 1, sp=sp), w, call, mesh, H100) for sp in (1, 2))
    assert sharded.time_s > plain.time_s and sharded.memory_bytes < 0.7 * plain.memory_bytes
    space = SearchSpace(w, H100, 1, 8, deployable=True)
    assert any(s.sp == 2 for s in space.strategies("actor", 8))
    assert not any(s.sp > 1 for s in SearchSpace(ppo(), H100, 1, 8, deployable=True).strategies("actor", 8))
