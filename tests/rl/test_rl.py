"""RL end to end on CPU: every algorithm config trains a few steps; resume continues; the
checkpoint loads in transformers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms import advantage
from asyncrl.single_controller.batch import Batch
from daemons.proc import kill_group
from tests.helpers import forked

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "asyncrl.launch"]
SMALL = ["data.batch_size=4", "rollout.n=2", "rollout.max_tokens=4", "data.synthetic.n_train=64",
         "data.synthetic.n_val=8", "actor.optim.lr=1e-2", "critic.optim.lr=1e-2"]


def _env(out: Path) -> dict[str, str]:
    """The launcher's state file beside (not inside) the run directory."""
    return {**os.environ, "ASYNCRL_STATE_DIR": str(out.parent / f"{out.name}.state"), "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=64,
                             layers=2, heads=4, sft_steps=0)


def _launch(config: str, out: Path, model: Path, extra: list[str], timeout: float = 240,
            small: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`asyncrl-launch` forked from the test session's pre-imported server (tests/helpers/forked.py)."""
    args = ["--config-name", config, f"trainer.output_dir={out}", f"model.path={model}",
            "model.build_tiny=null", *(SMALL if small else []), *extra]
    return forked.launch(args, env={**_env(out), **(env or {})}, cwd=REPO, timeout=timeout)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """An HF export's tensors: one model.safetensors or its shards (pipeline stages write their own)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("config,extra", [
    ("grpo", []), ("ppo", []), ("remax", []), ("rloo", []), ("reinforce_pp", []), ("safe_rlhf", []),
    ("grpo", ["algorithm.estimator=drgrpo", "actor.loss_agg_mode=seq-mean-token-sum-norm"]),
    # a model-based cost (RewardModelWorker on the tiny LM with a fresh scalar head)
    ("safe_rlhf", ["cost_model.enable=true", "reward.cost_fn=null"]),
    # 3 prompts on 2 ranks: DP padding with n samples per prompt, and cross-rank pulls
    ("remax", ["data.batch_size=3"]),
    # the 3D-HybridEngine: TP=2 training, generation at tg=1 (micro-DP gather) and tg=2 (in place)
    ("grpo", ["actor.parallel.tp=2"]),
    ("ppo", ["actor.parallel.tp=2", "critic.parallel.tp=2", "rollout.parallel.tp=2"]),
    # pipeline stages (the tied tiny model is untied), with the reference model's KL loss
    ("grpo", ["actor.parallel.pp=2", "actor.use_kl_loss=true"]),
    # the memory knobs through FSDP2 workers: token-budget micro-batches (update, log-probs, values)
    # and activation checkpointing, actor and critic
    ("ppo", ["actor.max_tokens_per_micro_batch=40", "actor.log_prob_max_tokens_per_micro_batch=40",
             "actor.gradient_checkpointing=true", "critic.max_tokens_per_micro_batch=40",
             "critic.gradient_checkpointing=true"]),
    # bf16 compute over fp32 master weights on CPU ranks, the reference policy stored in bf16; the
    # update's token budget sized by each worker from the memory estimate
    ("grpo", ["model.dtype=bfloat16", "actor.use_kl_loss=true", "actor.max_tokens_per_micro_batch=-1"]),
    # AdamW's state in host memory between its steps, the weights while the rollout generates
    # (actor.offload=all), through a checkpoint
    ("grpo", ["actor.offload=all"]),
    # two-turn trajectories with an environment: observation tokens masked out of the loss
    ("grpo", ["rollout.multi_turn.enable=true", "rollout.multi_turn.env=tests/helpers/agent_envs.py:CountOnes",
              "rollout.multi_turn.max_turn_tokens=4", "rollout.max_tokens=16", "actor.use_kl_loss=true"]),
    # the megatron-core backend: actor and reference as GPTModels at tp=2, generation resharded into tp=2
    # (its views of the training buffers copied while the buffers wait in host memory: actor.offload=all)
    ("grpo", ["actor.backend=megatron", "actor.parallel.tp=2", "rollout.parallel.tp=2", "actor.use_kl_loss=true",
              "actor.offload=all"]),
    # ... and its pipeline stages (megatron's 1F1B schedule; the tied embedding and head on two stages)
    # (~20 s each, slow: tests/rl/test_megatron.py checks the stages' training and the critic by default)
    pytest.param("grpo", ["actor.backend=megatron", "actor.parallel.pp=2", "actor.use_kl_loss=true"],
                 marks=pytest.mark.slow),
    # the losses of 2025, each with a rollout correction (recipes under configs/ where whole)
    ("gspo", ["actor.rollout_correction.mode=tis"]),
    ("cispo", ["actor.rollout_correction.mode=icepop"]),
    # (~12 s each, slow: their numerics are checked by hand and against verl in tests/rl/test_policy_losses.py)
    pytest.param("grpo", ["actor.policy_loss=clip_cov", "actor.ppo_mini_batches=2", "actor.rollout_correction.mode=mis",
                          "actor.rollout_correction.level=sequence"], marks=pytest.mark.slow),
    pytest.param("grpo", ["actor.policy_loss=kl_cov", "actor.ppo_mini_batches=2",
                          "actor.rollout_correction.mode=geo_mask"], marks=pytest.mark.slow),
    # PPO with both the actor and the critic on megatron-core
    pytest.param("ppo", ["actor.backend=megatron", "critic.backend=megatron", "actor.parallel.tp=2",
                         "critic.parallel.tp=2"], marks=pytest.mark.slow),
], ids=["grpo", "ppo", "remax", "rloo", "reinforce_pp", "safe_rlhf", "drgrpo", "safe_rlhf_cost_model",
        "remax_uneven", "grpo_tp2", "ppo_tp2_gen_tp2", "grpo_pp2", "ppo_token_budget_checkpointing",
        "grpo_bf16", "grpo_offload", "grpo_multi_turn", "grpo_megatron_tp2_gen_tp2", "grpo_megatron_pp2",
        "gspo_tis", "cispo_icepop", "clip_cov_seq_mis", "kl_cov_geo_mask", "ppo_megatron_actor_critic_tp2"])
def test_algorithm_trains_a_few_steps(config, extra, tiny_model, tmp_path):
    """Each algorithm trains through the real trainer; its actor updates must make better-scored
    responses likelier (a flipped advantage sign anywhere makes `policy_gain` negative)."""
    out = tmp_path / config
    res = _launch(config, out, tiny_model, ["trainer.total_steps=2", "trainer.eval_every=2",
                                            "trainer.save_every=2", "trainer.loggers=[console,jsonl]",
                                            "trainer.stats_every=1", "job.entry=tests/helpers/rl_probe.py:main",
                                            *extra])
    assert res.returncode == 0, res.stderr[-3000:]
    if "actor.max_tokens_per_micro_batch=-1" in extra:  # rank 0 logs the budget it sized
        logs = "".join(p.read_text() for p in (out / "logs").rglob("worker-actor_rollout_ref-0-*.log"))
        assert "actor.max_tokens_per_micro_batch=-1: " in logs and "tokens a micro-batch" in logs
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["algorithm"] == {"gspo": "grpo", "cispo": "grpo"}.get(config, config) and summary["steps"] == 2
    assert len(summary["policy_gain"]) == 2 and sum(summary["policy_gain"]) > 0, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    losses = [v for r in steps for k, v in r.items() if "loss" in k or "grad_norm" in k]
    assert losses and all(math.isfinite(v) for v in losses), steps
    assert all(r["timing/gen_s"] > 0 and r["timing/update_actor_s"] > 0 and r["timing/overhead_s"] >= 0
               for r in steps)
    assert all(0.1 < r["perf/peak_rss_gib"] < 20 for r in steps)  # the actor's largest rank (trainer.stats_every=1)
    # the engine's mismatch with the trainer, every step of every run: the k3 KL is a mean of
    # exp(d) - 1 - d over tokens whose |d| is at most the logged maximum, so it is at most that at the maximum
    assert all(r["rollout/logprob_diff_max"] >= r["rollout/logprob_diff_mean"] >= 0
               and r["rollout/k3_kl"] <= math.expm1(r["rollout/logprob_diff_max"]) - r["rollout/logprob_diff_max"] + 1e-7
               for r in steps), steps
    _kept_rollouts_agree_with_the_engine(out, steps, pipelined=any("pp=2" in e for e in extra))
    if any("rollout_correction" in e for e in extra):  # fp32, an agreeing engine: nothing capped or masked
        assert all(r["rollout/logprob_diff_max"] < 1e-3 and r["rollout/correction_masked_token_frac"] == 0
                   for r in steps), steps
    if not extra:  # advantages where the rows live: no rank pulls another's rows for them
        assert all(r["perf/advantage_cross_rank_mb"] == 0 and r["perf/compute_reward_cross_rank_mb"] == 0
                   for r in steps), steps
    if "actor.offload=all" in extra:  # the moments' and weights' bytes held in host memory, the time moving them
        assert all(r["perf/offload_host_gib"] > 0 and r["perf/offload_s"] > 0 for r in steps), steps
    if "rollout.multi_turn.enable=true" in extra:  # every trajectory ran its two turns
        assert all(r["agent/num_turns_mean"] == 2.0 for r in steps), steps
        # the environment's own info number against its reward, relayed apart: each trajectory's
        # reward is its "1"s over its words, so the mean count of "1"s is at least the mean score
        assert all(r["agent/ones_mean"] >= r["critic/score_mean"] - 1e-6 for r in steps), steps
        assert all((r["agent/ones_mean"] > 0) == (r["critic/score_mean"] > 0) for r in steps), steps
    before, after = _weights(tiny_model), _weights(Path(summary["checkpoint"]))
    if "model.dtype=bfloat16" in extra:  # the export is in the compute dtype, and says so
        config = json.loads((Path(summary["checkpoint"]) / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) == "bfloat16" and all(t.dtype == torch.bfloat16 for t in after.values())
        before = {k: v.to(torch.bfloat16) for k, v in before.items()}
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, f"only {changed} changed"


def _kept_rollouts_agree_with_the_engine(out: Path, steps: list[dict], pipelined: bool) -> None:
    """The kept rollouts (trainer.keep_rollouts) hold the trainer's log-probs of every row — the
    recomputed ones, or an on-policy update's own pass — within the step's logged mismatch of the
    engine's (a pipeline's first stage computes none: its rows may have none)."""
    import pyarrow.parquet as pq

    rows = [r for f in sorted(out.glob("rollouts/rank*/*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert {r["step"] for r in rows} == {1, 2}, sorted(out.rglob("*.parquet"))
    worst = {r["step"]: r["rollout/logprob_diff_max"] for r in steps}
    for r in rows:
        if r["trainer_log_probs"] is None:
            assert pipelined, r
            continue
        pairs = [(a, b) for a, b, m in zip(r["trainer_log_probs"], r["rollout_log_probs"], r["model_token"],
                                           strict=True) if m]
        assert pairs and max(abs(a - b) for a, b in pairs) <= worst[r["step"]] + 1e-5, (r, worst)
    assert pipelined or all(r["trainer_log_probs"] is not None for r in rows)
    _the_inspector_shows_them(out, rows)


def _the_inspector_shows_them(out: Path, rows: list[dict]) -> None:
    """`asyncrl inspect`'s pages over the run: every kept row in its table, one of them token by
    token in the run's own tokenizer's words, a multi-turn one as a conversation."""
    from starlette.testclient import TestClient

    from asyncrl.inspector.app import build_app
    from asyncrl.inspector.runs import open_runs

    web = TestClient(build_app(open_runs([str(out)])), raise_server_exceptions=False)
    table = web.get("/runs/0/rollouts?per_page=500")
    assert table.status_code == 200 and table.text.count('class="row"') == len(rows), table.text[-2000:]
    row = max(rows, key=lambda r: (r["num_turns"] or 0, r["step"]))
    page = web.get(f"/runs/0/rollouts/{row['step']}/{row['rank']}/{row['row']}")
    assert page.status_code == 200 and page.text.count('<span class="tok') == len(row["response_ids"]), page.text[-2000:]
    assert "[" + str(row["response_ids"][0]) + "]" not in page.text  # decoded, not shown as ids
    assert ('id="conversation"' in page.text) == bool(row["num_turns"] and row["num_turns"] > 1)


@pytest.mark.parametrize("replay", ["rollout", "old_policy"])
def test_a_mixture_of_experts_model_trains_and_exports_per_expert(replay, tiny_model, tmp_path):
    """GRPO on a tiny Qwen3-MoE (8 experts, top-2) built with the quickstart's tokenizer: FSDP2 and
    the native engine, 2 steps (old log-probs recomputed) that make better-scored responses
    likelier, replaying the rollout's experts (one mini-batch: the update's routers agree with the
    rollout's; generated expert-parallel, each rank with the 4 experts it trains) or the old policy's (two mini-batches; after one optimizer step this tiny model's
    near-uniform routers agree with the rollout's on ~0.2 of their choices); the router losses and
    expert load are logged; the export holds the experts as checkpoints do (per expert) and loads
    in transformers."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model_dir = tmp_path / "moe"
    Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    res = _launch("grpo", out, model_dir, ["trainer.total_steps=2", "trainer.eval_every=2", "trainer.save_every=2",
                                          "trainer.loggers=[console,jsonl]", "job.entry=tests/helpers/rl_probe.py:main",
                                          f"actor.moe.router_replay={replay}", "actor.recompute_log_prob=always",
                                          f"actor.ppo_mini_batches={1 if replay == 'rollout' else 2}",
                                          "actor.moe.aux_loss_coef=0.01", "actor.moe.z_loss_coef=0.001",
                                          *(["rollout.parallel.ep=2"] if replay == "rollout" else [])])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert sum(summary["policy_gain"]) > 0, summary
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    # the busiest expert's load over the mean: above 1 for a random router over a finite batch, at
    # most experts / top-k (each token picks 2 distinct experts of 8)
    assert all(r["rollout/logprob_diff_max"] < 1e-5 and 1.0 < r["moe/expert_load_max"] <= 8 / 2
               and 0.5 < r["moe/aux_loss"] < 8 and r["moe/z_loss"] > 0 for r in steps), steps
    if replay == "rollout":  # on-policy: the update's own routing is the rollout's (its experts split over 2 ranks)
        assert all(r["moe/routing_agreement"] == 1.0 and r["perf/expert_exchange_mb"] > 0 for r in steps), steps
    # the recorded experts stay with their rows: no rank pulls another's for its passes
    stats = [r for r in steps if "perf/update_actor_cross_rank_mb" in r]
    assert stats and all(r["perf/update_actor_cross_rank_mb"] == 0 and r["perf/compute_log_prob_cross_rank_mb"] == 0
                         for r in stats), stats
    exported = _weights(Path(summary["checkpoint"]))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported
    assert not any(k.endswith("gate_up_proj") for k in exported)
    assert type(AutoModelForCausalLM.from_pretrained(summary["checkpoint"])).__name__ == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("pool", [[], ["teacher.backend=megatron", "teacher.parallel.pp=2"],
                                  pytest.param(["teacher.n_workers=1", "cluster.cpu_devices=3"], marks=pytest.mark.slow)],
                         ids=["colocated", "megatron_pp2", "own_pool"])  # own_pool: ~16 s, on a pool of its own
def test_on_policy_distillation_moves_the_student_toward_the_teacher(pool, tiny_model, tmp_path):
    """OPD with a teacher of the same tokenizer (another init): every update raises the tokens the
    teacher prefers (`policy_gain` per token), the teacher's log-probs are the Hugging Face
    teacher's (FSDP2, or megatron-core in two pipeline stages beside the FSDP2 actor), the reverse
    KL is logged, the teacher's pool where asked. A teacher of another vocabulary is refused before
    a worker starts (exit 2)."""
    from asyncrl.models.tiny import ensure_tiny_model

    teacher = ensure_tiny_model(tmp_path / "teacher", task="sort", hidden=64, layers=2, heads=4, sft_steps=0, seed=1)
    out = tmp_path / "opd"
    res = _launch("opd", out, tiny_model, [f"teacher.path={teacher}", "trainer.total_steps=2", "trainer.eval_every=2",
                                           "trainer.save_every=2", "trainer.loggers=[jsonl]",
                                           "job.entry=tests/helpers/rl_probe.py:main", *pool])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["algorithm"] == "opd" and len(summary["policy_gain"]) == 2 and min(summary["policy_gain"]) > 0, summary
    assert len(summary["teacher_gap"]) == 2 and max(summary["teacher_gap"]) < 1e-4, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["distill/reverse_kl"]) and r["timing/teacher_log_prob_s"] > 0 for r in rows if r["step"] > 0)
    if pool:
        return
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny import build_tokenizer

    bad = tmp_path / "bad_teacher"  # the teacher's weights with a tokenizer of one more token
    AutoModelForCausalLM.from_pretrained(teacher).save_pretrained(bad)
    tok = build_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(bad)
    res = _launch("opd", tmp_path / "bad", tiny_model, [f"teacher.path={bad}"])
    assert res.returncode == 2 and "its tokenizer differs from the student's" in res.stderr, res.stderr[-2000:]


def test_checkpoint_loads_in_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "grpo"
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **{f"WANDB_{d}_DIR": str(tmp_path / d.lower())
                                                                  for d in ("CACHE", "CONFIG", "DATA")}}
    res = _launch("quickstart", out, tiny_model, ["trainer.total_steps=2", "trainer.eval_every=2",
                                                  "trainer.loggers=[console,jsonl,tensorboard,wandb]"], env=offline)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    tok = AutoTokenizer.from_pretrained(summary["checkpoint"])
    ids = tok("sort 3 1 2 0", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.*"))
    # wandb (offline): every step with the job's name; the held-out completions as a table
    from tests.helpers.wandb_records import history, run_info

    (run,) = (out / "wandb").glob("offline-run-*")
    assert run_info(run).display_name == "quickstart"
    rows = history(run)
    assert sorted({int(r["_step"]) for r in rows}) == [0, 1, 2]
    assert any("critic/score_mean" in r for r in rows) and any(r.get("samples/_type") for r in rows)
    for key in ("val_reward_start", "val_reward_end", "wall_s", "tokens_per_s", "checkpoint"):
        assert key in summary


def test_killed_run_resumes_where_it_stopped(tiny_model, tmp_path):
    """Saved asynchronously (the step-2 checkpoint is marked complete once its background write
    ends, while training goes on; the step-4 save waits for it), killed with SIGKILL once step 2
    is complete, resumed from the last complete checkpoint to the end. (With 4 steps in all the
    run could finish before the kill landed: seen once in CI, 2026-11-27.)"""
    out = tmp_path / "resume"
    args = [*LAUNCH, "--config-name", "quickstart", f"trainer.output_dir={out}", f"model.path={tiny_model}",
            "model.build_tiny=null", *SMALL, "trainer.total_steps=8", "trainer.save_every=2",
            "trainer.eval_every=4", "trainer.loggers=[console,jsonl]", "trainer.async_save=true"]
    proc = subprocess.Popen(args, cwd=REPO, env=_env(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        marker = out / "checkpoints" / "step_2" / "COMPLETE"
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "no checkpoint at step 2"
        os.killpg(proc.pid, signal.SIGKILL)  # the whole launch: driver, node daemon, workers
        proc.wait(30)
    finally:
        kill_group(proc, grace_s=1)
    rows = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= max(rows) < 8  # killed after the step-2 checkpoint, before the end
    res = forked.launch(args[len(LAUNCH):], env=_env(out), cwd=REPO, timeout=240)  # the resume: no cold imports
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert 3 in steps[steps.index(2) + 1:]  # step 3 ran after step 2 (before the kill, or resumed)
    assert steps[-1] == 8 and steps.count(1) == 1  # continued from a checkpoint, not restarted at 1
    state = json.loads((out / "checkpoints" / "step_8" / "trainer_state.json").read_text())
    assert state["loader"]["position"] + state["loader"]["epoch"] * 10**6 > 0


USER_STEP = """
from asyncrl.algorithms import advantage
from asyncrl.algorithms.registry import Algorithm
from asyncrl.metrics import mean_metrics


async def leave_one_out_step(roles, cfg, ctl, prompts):
    gen = roles.rollout.generate_sequences(prompts)
    batch = (await gen).union(await roles.reward.compute_reward(gen))
    adv = await roles.actor.apply(advantage.rloo, batch)
    actor = await roles.actor.update_actor(batch.union(adv))
    return {**adv.meta, **mean_metrics(actor), "mine/steps": 1.0}


ALGORITHM = Algorithm("my_algo:leave_one_out_step")
"""


def test_an_algorithm_of_your_own_is_a_step_and_one_entry(tiny_model, tmp_path):
    """A package of the user's holds a step function and one `asyncrl.algorithms` entry point:
    the config check takes its name, driver and workers find it, and the trainer runs its steps."""
    site = tmp_path / "site"
    meta = site / "my_algo-0.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: my-algo\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text("[asyncrl.algorithms]\nleave_one_out = my_algo:ALGORITHM\n")
    (site / "my_algo.py").write_text(USER_STEP)
    out = tmp_path / "mine"
    res = _launch("grpo", out, tiny_model, ["algorithm.name=leave_one_out", "trainer.total_steps=2",
                                            "trainer.eval_every=2", "trainer.save_every=2", "trainer.loggers=[jsonl]"],
                  env={"PYTHONPATH": os.pathsep.join([str(REPO), str(site)])})
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert [r["mine/steps"] for r in steps] == [1.0, 1.0] and all("critic/advantage_mean" in r for r in steps)


def test_grpo_advantage_task_on_a_batch():
    mask = torch.ones(4, 3)
    b = Batch({"response_mask": mask, "scores": torch.tensor([1.0, 0.0, 0.5, 0.5])},
              {"uid": ["a", "a", "b", "b"]})
    out = advantage.grpo(b)
    adv = out["advantages"][:, 0]
    assert adv[0] > 0 > adv[1] and adv[2] == 0 and adv[3] == 0
    assert out.meta["critic/score_mean"] == pytest.approx(0.5)
    dr = advantage.grpo(b, norm_by_std=False)  # Dr.GRPO: mean-centred only
    assert dr["advantages"][0, 0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="uid"):
        advantage.rloo(b.select("response_mask", "scores"))


# dp2 runs in `make test`; the TP and PP layouts' update direction is checked there too
# (test_algorithm_trains_a_few_steps[ppo_tp2_gen_tp2], [grpo_pp2]), their learning in test-all
@pytest.mark.parametrize("parallel", [[], pytest.param(["actor.parallel.tp=2"], marks=pytest.mark.slow),
                                      pytest.param(["actor.parallel.pp=2"], marks=pytest.mark.slow)],
                         ids=["dp2", "tp2", "pp2"])
def test_grpo_learns_by_default(parallel, tiny_model, tmp_path):
    """The quickstart recipe, shortened: GRPO must raise held-out greedy reward by a margin, also
    with a tensor- or pipeline-parallel actor resharded into generation every step. Spread of
    dp2 on the 2-core machine, seeds 0-9 (2026-11-26): gains 0.229-0.314 (0.0 -> 0.23-0.31)."""
    out = tmp_path / "learn"
    res = _launch("quickstart", out, tiny_model, ["trainer.total_steps=100", "trainer.eval_every=50",
                                                  "trainer.save_every=100", "trainer.loggers=[console,jsonl]",
                                                  *parallel],
                  timeout=600, small=False)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["val_reward_end"] - summary["val_reward_start"] >= 0.15, summary


MULTI_TURN = ["rollout.multi_turn.enable=true", "rollout.multi_turn.env=tests/helpers/agent_envs.py:CountOnes",
              "rollout.multi_turn.max_turn_tokens=4", "rollout.max_tokens=16"]


@pytest.mark.parametrize("extra", [[], pytest.param(MULTI_TURN, marks=pytest.mark.slow)],
                         ids=["single_turn", "multi_turn"])
def test_same_seed_same_metrics(extra, tiny_model, tmp_path):
    """Two runs with the same seed on this machine log the same numbers (timings aside): bit for
    bit with single-turn rollouts (one thread a rank, gloo's reductions in a fixed order); with
    multi-turn rollouts, whose decodes the environments' timing groups, the same tokens and
    log-probs equal to float rounding (a decode of other rows runs other kernel shapes; `slow`).
    The second run sends each step's generation only after the step before ended
    (rollout.launch_next_early=false): the first sent steps 3 and 4's behind the updates before."""
    def run(name: str, *more: str) -> list[dict]:
        out = tmp_path / name
        res = _launch("grpo", out, tiny_model, ["trainer.total_steps=4", "trainer.eval_every=4",
                                                "trainer.loggers=[console,jsonl]", *extra, *more])
        assert res.returncode == 0, res.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        timings = ("timing/", "perf/", "agent/env_s")  # env_s: the seconds environments took
        return [{k: v for k, v in r.items() if not k.startswith(timings)} for r in rows]

    a, b = run("a"), run("b", "rollout.launch_next_early=false")
    assert len(a) == len(b) == 5 and all(set(x) == set(y) for x, y in zip(a, b, strict=True))
    # multi-turn: within float rounding; an absolute 1e-6 for the metrics that are themselves
    # rounding-sized (rollout/logprob_diff_mean, ~8e-8, moved by 5e-9 between two runs)
    same = (lambda u, v: u == pytest.approx(v, rel=1e-6, abs=1e-6)) if extra else (lambda u, v: u == v)
    different = [(x["step"], k, x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x if not same(x[k], y[k])]
    assert not different, different[:10]


def test_mini_batches_cover_every_row_and_responses_pad_to_the_budget():
    from asyncrl.roles.actor import _pad_responses
    from asyncrl.roles.update import mini_batches

    b = Batch({"i": torch.arange(10)})
    parts = list(mini_batches(b, 4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert sorted(torch.cat([p["i"] for p in parts]).tolist()) == list(range(10))
    out = {"responses": torch.tensor([[5, 2]]), "response_mask": torch.tensor([[1, 1]]),
           "rollout_log_probs": torch.tensor([[-0.5, -0.1]]), "input_ids": torch.tensor([[7, 5, 2]]),
           "attention_mask": torch.tensor([[1, 1, 1]]), "position_ids": torch.tensor([[0, 1, 2]])}
    padded = _pad_responses(out, 4, pad_id=0)
    assert padded["responses"].tolist() == [[5, 2, 0, 0]]
    assert padded["response_mask"].tolist() == [[1, 1, 0, 0]]
    assert padded["position_ids"].tolist() == [[0, 1, 2, 3, 4]]


async def test_actor_workers_through_the_api(tiny_model, tmp_path):
    """generate → the SFT loss (no update) → update_pretrain lowers it."""
    from asyncrl.metrics import mean_metrics
    from asyncrl.roles.actor import ActorRolloutRefWorker
    from asyncrl.single_controller.context import local_cluster
    from asyncrl.single_controller.protocols import THREE_D_PROTO
    from tests.helpers.worker_probes import sft_loss

    cfg = {"model": {"path": str(tiny_model)}, "seed": 0, "trainer": {"torch_threads": 1},
           "rollout": {"n": 2, "max_tokens": 4}, "actor": {"optim": {"lr": 1e-2}, "pretrain_coef": 1.0}}
    async with local_cluster(cpu_devices=2, log_dir=tmp_path / "logs", insecure=True,
                             allowed_packages=("tests",)) as ctx:
        actor = await ctx.spawn_group(ctx.create_pool("a", world_size=2), ActorRolloutRefWorker, cfg,
                                      ("actor", "rollout"))
        ids = torch.tensor([[0, 5, 6], [7, 8, 9], [4, 5, 6]])
        prompts = ctx.put(Batch({"input_ids": ids, "attention_mask": (ids != 0).long()},
                                {"uid": ["a", "b", "c"]}, {"seed": 1}))
        gen = await actor.generate_sequences(prompts)
        assert len(gen) == 6 and gen.columns.count("responses") == 1
        before = mean_metrics(await actor.apply(sft_loss, gen, protocol=THREE_D_PROTO))
        assert math.isfinite(before["sft_loss"]) and before["tokens"] > 0
        for _ in range(3):
            await actor.update_pretrain(gen)
        after = mean_metrics(await actor.apply(sft_loss, gen, protocol=THREE_D_PROTO))
        assert after["sft_loss"] < before["sft_loss"]
        await gen.free()  # explicit free: the owners drop the objects now
        stats = [await h.call("store_stats") for h in actor.handles]
        assert sum(s["objects"] for s in stats) == 0


async def test_native_engine_decodes_in_waves_of_decode_slots(tiny_model, tmp_path):
    """rollout.decode_slots bounds the rows (the KV cache) the native engine decodes at once:
    the prompts go in waves and the joined greedy outputs equal one wave's; so do a compiled
    decode's (rollout.decode=compiled, over the weights the hybrid engine binds)."""
    from asyncrl.roles.actor import ActorRolloutRefWorker
    from asyncrl.single_controller.context import local_cluster

    def cfg(slots: int, decode: str) -> dict:
        return {"model": {"path": str(tiny_model)}, "seed": 0, "trainer": {"torch_threads": 1},
                "rollout": {"n": 2, "max_tokens": 5, "decode_slots": slots, "decode": decode}}

    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [4, 5, 6]])
    async with local_cluster(cpu_devices=3, log_dir=tmp_path / "logs", insecure=True) as ctx:
        outs = []
        for name, slots, decode in (("all", 0, "eager"), ("waves", 2, "eager"), ("compiled", 2, "compiled")):
            actor = await ctx.spawn_group(ctx.create_pool(name, world_size=1), ActorRolloutRefWorker,
                                          cfg(slots, decode), ("actor", "rollout"))
            prompts = ctx.put(Batch({"input_ids": ids, "attention_mask": (ids != 0).long()},
                                    {"uid": ["a", "b", "c"]}, {"greedy": True}))
            outs.append(await (await actor.generate_sequences(prompts)).fetch())
    one, waves, compiled = outs
    assert (one.meta["gen_waves"], waves.meta["gen_waves"]) == (1, 3)  # 2 slots, n=2: a prompt per wave
    for other in (waves, compiled):
        for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
            assert torch.equal(one[key], other[key]), key
        torch.testing.assert_close(one["rollout_log_probs"], other["rollout_log_probs"], atol=1e-5, rtol=0)


async def test_held_out_prompts_decode_in_waves_of_a_training_batch(tiny_model, tmp_path):
    """Evaluation's memory must not grow with the held-out set: its prompts decode at most a
    training batch's rows at a time on a rank (data.batch_size 2 x rollout.n 2 = 4 rows), 8 or 40
    of them alike, in a phase of their own; a training-sized call stays one wave."""
    from asyncrl.roles.actor import ActorRolloutRefWorker
    from asyncrl.single_controller.context import local_cluster

    cfg = {"model": {"path": str(tiny_model)}, "seed": 0, "trainer": {"torch_threads": 1},
           "data": {"batch_size": 2}, "rollout": {"n": 2, "max_tokens": 5}}
    g = torch.Generator().manual_seed(0)
    async with local_cluster(cpu_devices=1, log_dir=tmp_path / "logs", insecure=True) as ctx:
        actor = await ctx.spawn_group(ctx.create_pool("a", world_size=1), ActorRolloutRefWorker, cfg,
                                      ("actor", "rollout"))

        async def generate(rows: int, meta: dict) -> Batch:
            ids = torch.randint(3, 9, (rows, 3), generator=g)
            batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"uid": list(range(rows))}, meta)
            return await (await actor.generate_sequences(ctx.put(batch))).fetch()

        assert (await generate(2, {}))["responses"].shape[0] == 4
        for rows in (8, 40):
            out = await generate(rows, {"greedy": True, "n": 1, "evaluation": True})
            assert out["responses"].shape[0] == rows and out.meta["gen_waves"] == rows // 4, out.meta
        assert (await generate(2, {})).meta["gen_waves"] == 1
        phases = (await actor.memory_stats())[0]["phases"]
        assert {"generate", "evaluate"} <= set(phases), phases


def test_phase_summary_reports_median_phases_and_shares(tmp_path):
    from asyncrl.metrics import phase_summary

    rows = [{"step": s, "timing/step_s": 1.0, "timing/gen_s": 0.25, "timing/update_actor_s": 0.5,
             "timing/overhead_s": 0.25} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = phase_summary(tmp_path / "metrics.jsonl", skip=2)
    assert out["steps"] == 3 and out["share/update_actor"] == 0.5 and out["gen_s"] == 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_grpo_steps_on_cuda(tiny_model, tmp_path):
    """A TP=1 RL run on one GPU: FSDP2 with bf16 compute, the reshard (aliasing on one rank),
    generation and the update all on CUDA."""
    out = tmp_path / "cuda"
    res = _launch("quickstart", out, tiny_model, ["trainer.n_workers=1", "trainer.total_steps=4",
                                                  "trainer.eval_every=2", "trainer.loggers=[console,jsonl]"])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 4 and all(math.isfinite(r["actor/pg_loss"]) for r in steps)
    print("cuda step timings:", {k: v for k, v in steps[-1].items() if k.startswith("timing/")})


def test_tensor_parallel_sizes_are_checked_against_the_model(tiny_model):
    """Before any worker starts: the tiny model has 4 heads, so tp=8 cannot split them."""
    from asyncrl.config import rl_config
    from asyncrl.preflight import check_inputs
    from transport.checks import ConfigError

    cfg = rl_config({"model": {"path": str(tiny_model)}, "trainer": {"n_workers": 8},
                     "actor": {"parallel": {"tp": 8}}})
    with pytest.raises(ConfigError, match=r"actor.parallel.tp=8 must divide the model's num_attention_heads=4"):
        check_inputs(cfg)
    check_inputs(rl_config({"model": {"path": str(tiny_model)}, "actor": {"parallel": {"tp": 2}}}))


@pytest.mark.slow  # ~42 s (suite time); grpo_pp2 and tests/rl/test_memory.py cover pipeline loads by default
def test_resume_in_another_parallel_layout(tiny_model, tmp_path):
    """A run saved with a pure-DP actor (dp=2, tied embeddings) resumes with pipeline stages
    (pp=2: the embedding and LM head untie, the head's optimizer state comes from the tied
    weight's); going back to the tied model is refused, since one trained weight would be lost."""
    out = tmp_path / "relayout"
    common = ["trainer.save_every=2", "trainer.eval_every=2", "trainer.loggers=[console,jsonl]"]
    res = _launch("grpo", out, tiny_model, ["trainer.total_steps=2", *common])
    assert res.returncode == 0, res.stderr[-3000:]
    res = _launch("grpo", out, tiny_model, ["trainer.total_steps=4", "actor.parallel.pp=2", *common])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr and "actor.parallel.pp: 1 → 2" in res.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows if r["step"] > 2)
    res = _launch("grpo", out, tiny_model, ["trainer.total_steps=6", *common])
    assert res.returncode != 0 and "trained the token embedding and the LM head as two weights" in res.stderr


def test_trimmed_micro_batches_give_the_same_loss_and_gradients(tiny_model):
    """Dropping the columns that are padding in every row of a micro-batch changes nothing a
    masked loss sees: same per-token log-probs on real tokens, same loss, same gradients."""
    from transformers import AutoModelForCausalLM

    from asyncrl.algorithms import core
    from asyncrl.data.dataset import positions_from_mask
    from asyncrl.roles.forward import response_forward
    from asyncrl.roles.update import trim_padding

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    rows, prompt, width = 4, 6, 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 20, (rows, prompt + width), generator=gen)
    mask = torch.zeros_like(ids)
    starts, lengths = [2, 3, 2, 4], [3, 1, 5, 2]  # every prompt left-padded by >= 2, responses <= 5 of 8
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        mask[i, s:prompt + n] = 1
    resp_mask = mask[:, prompt:].clone()
    mb = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
                "responses": ids[:, prompt:], "response_mask": resp_mask,
                "advantages": torch.randn(rows, width, generator=gen) * resp_mask,
                "old_log_probs": torch.randn(rows, width, generator=gen) * 0.1 - 3, "prompts": ids[:, :prompt]})
    small = trim_padding(mb)
    assert small["input_ids"].shape == (rows, prompt - 2 + 5) and small["responses"].shape == (rows, 5)
    assert small["prompts"].shape == (rows, prompt)

    def loss_and_grads(b: Batch) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logp, _ = response_forward(model, b)
        loss, _ = core.ppo_policy_loss(b["old_log_probs"], logp, b["advantages"], b["response_mask"].float())
        loss.backward()
        return loss.detach(), logp.detach() * b["response_mask"], [p.grad.clone() for p in model.parameters()]

    full, trimmed = loss_and_grads(mb), loss_and_grads(small)
    assert torch.allclose(full[0], trimmed[0], atol=1e-6)
    assert torch.allclose(full[1][:, :5], trimmed[1], atol=1e-5) and full[1][:, 5:].eq(0).all()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full[2], trimmed[2], strict=True))
