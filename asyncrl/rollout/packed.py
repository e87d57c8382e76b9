"""oneDNN-packed linear layers for a compiled decode on CPU.

At decode's shapes (a few dozen rows) torch's CPU matmul runs well below what the cores can do:
oneDNN's kernels on a weight reordered into its blocked layout ran 2.75x faster for a
[32, 896] x [896, 4864] fp32 linear on this project's 2-core machine (what vLLM's CPU backend
and inductor's `freezing` use). Inductor's freezing folds the weights into the graph, so every
weight update would compile again; here a custom op takes the weight as an input and packs it
itself, once per call of `generate` and again whenever the weight changes (its version counter:
weights loaded in place between decode steps are seen). The packed copies live for one call (in a
continuous batch: while its rows are live; inside `kept()`: until it ends, as for a multi-turn
rollout's waves of calls).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor, nn

_packed: dict[tuple[int, tuple[int, ...]], tuple[Tensor, int | None, Tensor]] = {}
_active = 0  # compiled decodes running (a call, a continuous batch): plain fp32 linears use the packed op
_kept = 0  # `kept()` blocks open: packed weights outlive the calls that made them
_lock = threading.Lock()


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# an operator of a plain `torch.library.Library`, not `torch.library.custom_op`: the latter's
# Python wrapper cost 16 us a call here (169 calls a decode step of the 0.5B shape), this ~1 us
_LIBRARY = torch.library.Library("asyncrl", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)` through oneDNN with `weight` packed (cached while it is unchanged)."""
    key, version = (weight.data_ptr(), tuple(weight.shape)), _version(weight)
    hit = _packed.get(key)
    if hit is None or hit[1] != version:
        hit = (weight, version, _reorder(weight, x.numel() // x.shape[-1]))
        _packed[key] = hit  # holds the weight too: its address cannot pass to another tensor meanwhile
    return torch.ops.mkldnn._linear_pointwise(x, hit[2], bias, "none", [], "")


def _reorder(weight: Tensor, rows: int) -> Tensor:
    """`weight` in oneDNN's blocked layout for `rows`-row inputs (a new copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=rows)


def _version(weight: Tensor) -> int | None:
    """The weight's version counter (moves with every in-place change); None for an inference
    tensor, which has none (packed once a call then: a change within the call goes unseen)."""
    try:
        return weight._version
    except RuntimeError:
        return None


_LIBRARY.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("asyncrl::packed_linear", lib=_LIBRARY)
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackableLinear(nn.Linear):
    """An `nn.Linear` that runs `packed_linear` while a compiled CPU decode is active."""

    def forward(self, x: Tensor) -> Tensor:
        if _active and self.weight.dtype == torch.float32 and x.dtype == torch.float32:
            return torch.ops.asyncrl.packed_linear(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` a `PackableLinear` (same parameters); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackableLinear
            count += 1
    return count


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Packed linears for the decode steps inside (nested, or in several threads at once: until
    the last leaves); their packed weights are dropped after."""
    global _active
    with _lock:
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if not _active and not _kept:
                _packed.clear()


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Packed weights made inside outlive their calls until the last `kept` block ends (calls with
    the same weights pack each once; a weight changed in place is repacked as ever, but an
    inference tensor, which has no version counter, not: change none inside)."""
    global _kept
    with _lock:
        _kept += 1
    try:
        yield
    finally:
        with _lock:
            _kept -= 1
            if not _kept and not _active:
                _packed.clear()
