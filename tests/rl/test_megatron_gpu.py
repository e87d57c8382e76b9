"""actor.backend=megatron on one GPU (marker `gpu`; run first whenever a GPU is lent): bf16 logits
against Hugging Face, and GRPO steps through the launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]
pytest.importorskip("megatron.core", reason="megatron-core is in the test extra: pip install -e '.[test]'")


def test_bf16_logits_are_as_close_to_fp32_as_hf_own_bf16(tmp_path):
    """Megatron in bf16 against the HF model in fp32 deviates no more than HF's own bf16 does (x2)."""
    from asyncrl.train import init_distributed
    from benchmarks.megatron import bf16_logits

    init_distributed()
    for name, d in bf16_logits(tmp_path).items():
        assert d["megatron_vs_fp32"] <= 2 * d["hf_bf16_vs_fp32"] + 1e-2, (name, d)


def test_grpo_steps_with_the_megatron_backend_on_one_gpu(tmp_path):
    """The quickstart's GRPO job, actor.backend=megatron, 20 steps on the GPU: it runs to the end
    and its held-out reward is a number (learning is checked on CPU, where CI runs)."""
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart", "actor.backend=megatron",
           "trainer.total_steps=20", "trainer.n_workers=1", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out reward" in out.stderr + out.stdout
