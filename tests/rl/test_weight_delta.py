"""Weight deltas (`asyncrl.train.delta`): bit-exact rebuilds, the smaller encoding, typed
mismatches, and deltas far smaller than the weights after a real optimizer step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.train.delta import SPARSE_BELOW, DeltaMismatchError, apply, encode, frame, unframe


def _changed(base: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    pick = torch.rand(base.shape, generator=g) < fraction
    new[pick] = new[pick] + torch.randn(int(pick.sum()), generator=g).to(base.dtype)
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.005, 0.1, 0.6])
def test_a_delta_rebuilds_the_new_tensor_bit_for_bit(dtype, fraction):
    base = torch.randn(256, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    new = _changed(base, fraction)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    both = {k: encode("w", new, base, version=4, base_version=3, only=k) for k in ("xor", "sparse")}
    chosen = encode("w", new, base, version=4, base_version=3)
    if fraction < SPARSE_BELOW:  # both tried: the smaller one is sent
        assert chosen.nbytes == min(d.nbytes for d in both.values())
    else:  # the XOR alone (finding the changed elements costs more time than their bytes save)
        assert chosen.kind == "xor"
    for delta in (*both.values(), chosen):
        held = base.clone()
        apply(delta, held, held_version=3)
        assert torch.equal(held.view(bits), new.view(bits)), delta.kind
    full = encode("w", new, None, version=4, base_version=None)
    assert full.kind == "full" and chosen.nbytes < full.nbytes
    fresh = torch.zeros_like(new)
    apply(full, fresh, held_version=None)  # a receiver with no base takes the full tensor
    assert torch.equal(fresh, new)


def test_a_delta_for_another_base_is_a_typed_error_not_wrong_weights():
    base = torch.randn(64, 64).to(torch.bfloat16)
    new = _changed(base, 0.02)
    delta = encode("w", new, base, version=2, base_version=1)
    with pytest.raises(DeltaMismatchError, match="from version 1 for a receiver at version 0"):
        apply(delta, base.clone(), held_version=0)
    other = _changed(base, 0.02, seed=5)  # says version 1, holds other bits
    with pytest.raises(DeltaMismatchError, match="checksum differs"):
        apply(delta, other, held_version=1)
    with pytest.raises(DeltaMismatchError, match="do not fit"):
        apply(dataclasses.replace(delta, payload=encode("w", new[:8], base[:8], 2, 1).payload, kind="xor"),
              base.clone(), held_version=1)
    with pytest.raises(DeltaMismatchError, match="holds"):
        apply(delta, base.float(), held_version=1)


def test_after_a_small_adamw_step_most_bf16_weights_keep_their_bits():
    """Smoke test of what the deltas are for: one AdamW step at lr 1e-6 on a small MLP changes
    few bf16 bit patterns, so the delta is a small part of the weights (deterministic on a CPU;
    the benchmark measures the 0.5B shape, `python -m benchmarks.weight_sync --delta`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    before = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    model(torch.randn(32, 256)).pow(2).mean().backward()
    opt.step()
    sent = full = 0
    for n, p in model.named_parameters():
        new = p.detach().to(torch.bfloat16)
        delta = encode(n, new, before[n], version=1, base_version=0)
        held = before[n].clone()
        apply(delta, held, held_version=0)
        assert torch.equal(held, new)
        sent, full = sent + delta.nbytes, full + new.numel() * 2
    assert sent < 0.5 * full, (sent, full)


def test_deltas_travel_as_a_header_and_one_payload_and_come_back_whole():
    torch.manual_seed(0)
    olds = [torch.randn(6, 4).bfloat16(), torch.randn(3).bfloat16(), torch.randn(5, 2).bfloat16()]
    news = [o.clone() for o in olds]
    news[0][2, 1] += 1  # a few elements change: sparse; one tensor not at all; one in full (no base)
    deltas = [encode("a", news[0], olds[0], 2, 1), encode("b", news[1], olds[1], 2, 1), encode("c", news[2], None, 2, None)]
    header, payload = frame(deltas)
    assert header.shape == (3, 4) and header.dtype == torch.int64 and payload.dtype == torch.uint8
    pieces = [(d.name, torch.bfloat16, d.shape) for d in deltas]
    back = unframe(header.clone(), payload.clone(), pieces, version=2)
    assert back == deltas
    held = [olds[0].clone(), olds[1].clone(), torch.zeros(5, 2, dtype=torch.bfloat16)]
    for d, t in zip(back, held, strict=True):
        apply(d, t, held_version=1)
    assert all(torch.equal(a, b) for a, b in zip(held, news, strict=True))
    with pytest.raises(DeltaMismatchError, match="frame of 3 tensors"):
        unframe(header, payload, pieces[:2], version=2)
    with pytest.raises(DeltaMismatchError, match="frame of 3 tensors"):
        unframe(header, payload[:-1], pieces, version=2)
