"""Packed sequences on one GPU (marker `gpu`; run first whenever a GPU is lent): torch's varlen
flash-attention kernel against the padded forward, in bf16 and fp32, and a packed GRPO job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.rl.test_packing import BATCH, lengths_batch, qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_packed_log_probs_on_cuda_equal_padded(dtype, tol):
    """fp32 within 1e-4 (the flash kernel's summation order), bf16 within 0.1 (bf16's 8-bit
    mantissa on logits of magnitude ~10; the padded path's own bf16 error is of that order)."""
    from asyncrl.roles.forward import response_forward
    from asyncrl.train.packing import _cuda_varlen, enable_packing

    model = qwen2(hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda().to(dtype)
    mb = lengths_batch(**BATCH).to("cuda")
    mask = mb["response_mask"].bool()
    with torch.no_grad():
        padded, _ = response_forward(model, mb)
        enable_packing(model)
        packed, _ = response_forward(model, mb)
    assert _cuda_varlen() is not None, "this torch has no torch.nn.attention.varlen: packing ran per row"
    assert float((padded - packed)[mask].abs().max()) < tol


def test_a_packed_grpo_job_on_one_gpu(tmp_path):
    """The quickstart on one GPU with packing on (the default) runs to its end and learns."""
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart", "trainer.total_steps=30",
           "trainer.n_workers=1", f"trainer.output_dir={tmp_path}/run", f"model.path={tmp_path}/model",
           "trainer.loggers=[jsonl]", "actor.pack_sequences=true"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert len(steps) == 30 and all("perf/dp_token_imbalance" in r for r in steps), steps[-1]
