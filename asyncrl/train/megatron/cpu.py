"""megatron-core on CPU ranks (gloo): its CUDA-only calls, adapted. Nothing is patched where CUDA
is available; on CPU only the megatron-core versions listed here are adapted (another one is a
clear error, not a silent patch).

What is adapted, and why:
- `torch.cuda.current_device()` -> "cpu": the rotary embedding and the DDP grad buffers place
  their tensors on it.
- `torch.cuda.{get,set}_rng_state`, `torch.cuda.manual_seed` and megatron's
  `tensor_parallel.random._{get,set}_cuda_rng_state`: the tensor-parallel RNG tracker keeps a
  CUDA generator state per region; on CPU it is the CPU generator's.
- `CudaOnCpu` (a torch function mode, entered only around building the distributed optimizer
  and its step): `device="cuda"` literals in the optimizer become "cpu", `Tensor.type()`
  answers `torch.cuda.*Tensor` (the distributed optimizer sorts its parameters by that string),
  `Tensor.cuda()` is the tensor itself (loading an optimizer state).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from asyncrl.errors import AsyncRLError

ADAPTED_VERSIONS = ("0.16.",)  # megatron-core versions whose CUDA-only calls this module knows
ANY_VERSION_ENV = "ASYNCRL_ANY_MEGATRON"

_adapted = False


class MegatronVersionError(AsyncRLError):
    """megatron-core of a version whose CPU adaptation is unknown."""


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def adapt_for_cpu() -> None:
    """Adapt megatron-core's CUDA-only calls for this process (once; a no-op with CUDA, but for
    the MoE router's reference to Transformer Engine's GEMM, unbound in 0.16 without TE)."""
    global _adapted
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # NameError in the router's forward otherwise
        moe_utils.te_general_gemm = None
    if _adapted or not on_cpu():
        return
    import megatron.core
    import megatron.core.tensor_parallel.random as mrandom

    version = megatron.core.__version__
    if not version.startswith(ADAPTED_VERSIONS) and not os.environ.get(ANY_VERSION_ENV):
        raise MegatronVersionError(
            f"megatron-core {version} on CPU ranks: asyncrl adapts the CUDA-only calls of "
            f"{', '.join(v + 'x' for v in ADAPTED_VERSIONS)} only; install 'megatron-core==0.16.1', "
            f"or set {ANY_VERSION_ENV}=1 to try this version unadapted beyond the known calls")
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    _adapted = True


class CudaOnCpu(TorchFunctionMode):
    """CUDA device literals and type names, answered on CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """`CudaOnCpu` on CPU ranks; nothing with CUDA."""
    if not on_cpu():
        yield
        return
    with CudaOnCpu():
        yield
