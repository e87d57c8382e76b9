"""A mixture-of-experts GRPO job on one GPU (marker `gpu`; run first whenever a GPU is lent):
the tiny Qwen3-MoE of `moe_quickstart` in bf16, on FSDP2 with routing replay and on Megatron."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_moe_grpo_steps_on_one_gpu(backend, tmp_path):
    """10 steps to the end; the router metrics are logged (FSDP2: the trainer's own routing agrees
    with the bf16 rollout's on most choices; replay makes it use the rollout's)."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    extra = (["actor.backend=megatron", "actor.moe.router_replay=none", "actor.moe.aux_loss_coef=0.001"]
             if backend == "megatron" else [])
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "moe_quickstart", "trainer.total_steps=10",
           "trainer.n_workers=1", f"trainer.output_dir={tmp_path}/run", f"model.path={tmp_path}/model",
           "trainer.loggers=[jsonl]", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert len(steps) == 10 and all("moe/aux_loss" in r for r in steps), steps[-1]
    if backend == "fsdp2":
        assert all(r["moe/routing_agreement"] > 0.95 for r in steps), [r["moe/routing_agreement"] for r in steps]
