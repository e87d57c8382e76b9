"""Training backends and rollout engines by name (asyncrl.engines): a backend and an engine from
another package, through their entry points, run a job without a line of asyncrl changed;
unknown names say which there are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.engines import backend, backends, rollout_engine, rollout_engines
from transport.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
import os

from asyncrl.engines import RolloutEngineKind, TrainBackend
from asyncrl.roles.actor import fsdp_engines
from asyncrl.roles.critic import fsdp_critic
from asyncrl.rollout import RolloutEngine


def _count(what):
    with open(os.environ["COUNTING_ENGINE_LOG"], "a") as f:
        f.write(f"{what}:{os.getpid()}\\n")


class CountingEngine(RolloutEngine):
    """The native engine, counting its generate calls in a file."""

    def generate(self, *args, **kwargs):
        _count("generate")
        return super().generate(*args, **kwargs)


def build(worker, model, colocated):
    tok = worker.tokenizer
    return CountingEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, device=worker.device)


def _counted(engine):
    """The engine, its training steps counted."""
    step = engine.train_step

    def train_step(*args, **kwargs):
        _count("train_step")
        return step(*args, **kwargs)

    engine.train_step = train_step
    return engine


def actor(worker, base, layout, one_copy):
    trained, ref = fsdp_engines(worker, base, layout, one_copy)
    return (_counted(trained) if trained is not None else None), ref


def critic(worker, path, layout):
    return _counted(fsdp_critic(worker, path, layout))


ENTRY = RolloutEngineKind("counting_engine:build", records_routes=True, continuous_batching=True)
BACKEND = TrainBackend("counting_engine:actor", "counting_engine:critic", packing=True, feeds_split_pool=True)
'''


def test_a_backend_and_a_rollout_engine_of_another_package_run_a_job_by_their_names(tmp_path):
    from asyncrl.models.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", task="sort", hidden=32, layers=1, heads=2, sft_steps=0)
    plugin = tmp_path / "plugin"
    (plugin / "counting_engine-0.1.dist-info").mkdir(parents=True)
    (plugin / "counting_engine.py").write_text(PLUGIN)
    (plugin / "counting_engine-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: counting-engine\nVersion: 0.1\n")
    (plugin / "counting_engine-0.1.dist-info" / "entry_points.txt").write_text(
        "[asyncrl.rollout_engines]\ncounting = counting_engine:ENTRY\n"
        "[asyncrl.backends]\ncounting_fsdp = counting_engine:BACKEND\n")
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(plugin)]), "COUNTING_ENGINE_LOG": str(calls),
           "ASYNCRL_STATE_DIR": str(tmp_path / "state")}
    args = [sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo", f"trainer.output_dir={tmp_path / 'run'}",
            f"model.path={model}", "model.build_tiny=null", "data.batch_size=4", "rollout.n=2", "rollout.max_tokens=4",
            "data.synthetic.n_train=16", "data.synthetic.n_val=4", "trainer.total_steps=2", "trainer.eval_every=100",
            "trainer.save_every=100", "trainer.loggers=[jsonl]"]
    res = subprocess.run([*args, "rollout.engine=counting", "actor.backend=counting_fsdp"], capture_output=True,
                         text=True, timeout=240, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    calls_by = {what: [line.split(":")[1] for line in calls.read_text().split() if line.startswith(what + ":")]
                for what in ("generate", "train_step")}
    for what, pids in calls_by.items():  # 2 steps (and evaluations) on each of 2 ranks
        assert len(pids) >= 2 * 2 and len(set(pids)) == 2, (what, pids)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    res = subprocess.run([*args, "rollout.engine=nope"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert res.returncode == 2 and "rollout.engine" in res.stderr and "must be one of native, vllm, counting" in res.stderr, res.stderr[-2000:]
    mentions = [str(p) for p in (REPO / "asyncrl").rglob("*.py") if "counting" in p.read_text()]
    assert not mentions, mentions  # nothing of asyncrl knows them


def test_unknown_names_list_the_known_ones():
    assert {"fsdp2", "megatron"} <= set(backends()) and {"native", "vllm"} <= set(rollout_engines())
    with pytest.raises(ConfigError, match="no rollout engine 'sglang'; known: native, vllm"):
        rollout_engine("sglang")
    with pytest.raises(ConfigError, match="no training backend 'deepspeed'; known: fsdp2, megatron"):
        backend("deepspeed")


def test_the_teacher_is_built_by_its_backend_and_one_without_a_teacher_engine_is_refused(monkeypatch):
    """Both backends build teachers, megatron with pipeline stages; a backend without a teacher
    engine is refused naming those that have one; a teacher on a megatron actor's workers shares
    its parallel layout (megatron-core keeps one a process), on a pool of its own it need not."""
    from dataclasses import replace

    from asyncrl.config import rl_config
    from asyncrl.engines import BACKENDS
    from asyncrl.launch import load_config

    def opd(*extra: str):
        return rl_config(load_config("opd", ["teacher.path=/models/teacher", *extra]))

    assert backend("fsdp2").teacher_engine == "asyncrl.roles.teacher:fsdp_teacher"
    assert backend("megatron").teacher_engine == "asyncrl.roles.teacher:megatron_teacher"
    monkeypatch.setitem(BACKENDS, "plain", replace(BACKENDS["fsdp2"], teacher_engine=None))
    with pytest.raises(ConfigError, match="teacher.backend=plain builds no teacher engine; use teacher.backend=fsdp2 or "
                                          "teacher.backend=megatron"):
        opd("teacher.backend=plain")
    with pytest.raises(ConfigError, match="teacher.backend=fsdp2 runs the teacher without pipeline stages; set it to 1, "
                                          "or teacher.backend=megatron"):
        opd("teacher.parallel.pp=2", "trainer.n_workers=2")
    assert opd("teacher.backend=megatron", "teacher.parallel.pp=2", "trainer.n_workers=2").teacher.parallel.pp == 2
    megatron_actor = ["actor.backend=megatron", "teacher.backend=megatron", "trainer.n_workers=2"]
    with pytest.raises(ConfigError, match=r"teacher.parallel.*must equal actor.parallel \(tp=2 pp=1\)"):
        opd(*megatron_actor, "actor.parallel.tp=2", "rollout.parallel.tp=2")
    assert opd(*megatron_actor, "actor.parallel.tp=2", "rollout.parallel.tp=2", "teacher.n_workers=1")
    assert opd(*megatron_actor, "actor.parallel.tp=2", "rollout.parallel.tp=2", "teacher.parallel.tp=2")
    with pytest.raises(ConfigError, match="a teacher on the actor's workers runs without expert parallelism"):
        opd(*megatron_actor, "actor.moe.ep=2")


def test_mapped_shared_memory_files_are_unlinked_and_others_left(tmp_path):
    """`unlink_mapped_shm` drops the names of the /dev/shm files this process maps (vLLM's CPU TP
    buffers), keeps the mapping, and leaves alone a file it does not map or whose name differs."""
    import mmap
    import uuid

    from asyncrl.rollout.vllm_engine import unlink_mapped_shm

    tag = uuid.uuid4().hex
    mapped, other, unmapped = (Path(f"/dev/shm/asyncrl-test-{tag}-{n}") for n in ("cpushm_0", "other_0", "cpushm_1"))
    maps = []
    try:
        for path in (mapped, other, unmapped):
            path.write_bytes(b"x" * 4096)
        for path in (mapped, other):
            with path.open("r+b") as f:
                maps.append(mmap.mmap(f.fileno(), 4096))
        assert unlink_mapped_shm(f"{tag}-cpushm") == [str(mapped)]
        assert not mapped.exists() and other.exists() and unmapped.exists()
        assert maps[0][:1] == b"x"  # still mapped
    finally:
        for m in maps:
            m.close()
        for path in (mapped, other, unmapped):
            path.unlink(missing_ok=True)
