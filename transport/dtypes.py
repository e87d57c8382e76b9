"""Torch dtypes by name and tensors as raw bytes: the one place every layer converts them.

A dtype travels as its short name (`"float32"`, `"bfloat16"`); only the dtypes listed here are
accepted from the wire, so a peer cannot make us resolve an arbitrary `torch` attribute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from transport.errors import CodecError

DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """`"float32"` -> `torch.float32`; CodecError for a name that is not a known dtype."""
    dt = DTYPES.get(name)
    if dt is None:
        raise CodecError(f"unknown tensor dtype {name!r}; known: {sorted(DTYPES)}")
    return dt


def element_size(name: str) -> int:
    """Bytes per element of the dtype called `name`."""
    return torch.empty((), dtype=torch_dtype(name)).element_size()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of `t`; 0 for a scalar."""
    return math.prod(t.shape[1:]) * t.element_size() if t.dim() else 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat, read-only byte view of a CPU tensor's data (copies only when not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise CodecError(
            f"a {t.device.type} tensor cannot travel in an RPC message; put it in the object "
            "store and pass its ObjectRef instead"
        )
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (to receive into)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_from_bytes(buf: Any, name: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over `buf` without copying; CodecError when the sizes disagree."""
    dtype = torch_dtype(name)
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"bad tensor shape {shape!r}")
    mv = memoryview(buf).cast("B")
    expected = math.prod(shape) * element_size(name)
    if mv.nbytes != expected:
        raise CodecError(f"tensor buffer holds {mv.nbytes} bytes, shape {list(shape)} of {name} "
                         f"needs {expected}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype).view(tuple(shape))
