"""The wire format: msgpack with out-of-band buffers.

A message is a list of frames: frame 0 is the msgpack body, frames 1.. are raw buffers.
Tensors, ndarrays and `Blob`s are replaced in the body by a small extension record that
names their buffer's frame index, so their bytes are never copied into the body and are
rebuilt zero-copy on receive (the result views the received frame's memory).

Later layers add their own message types with `register_type` (an `ObjectRef`, say).
Nothing is ever pickled: a type that is neither msgpack-native nor registered is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from transport.errors import CodecError

# Extension codes; 0..15 are reserved for transport itself.
EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_BLOB = 3
EXT_DTYPE = 4
EXT_INLINE_TENSOR = 5
FIRST_USER_CODE = 16

# Tensors smaller than this travel inside the body: a frame costs more than copying a few bytes.
INLINE_TENSOR_BYTES = 512

# torch.frombuffer warns on read-only memory (received ZeroMQ frames are read-only); the
# rebuilt tensor shares the frame's memory on purpose.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[_name] = getattr(torch, _name)


@dataclass(frozen=True, slots=True)
class Blob:
    """Wraps bytes-like data that should travel as its own frame (received as a read-only memoryview)."""

    data: Any


@dataclass(frozen=True, slots=True)
class _UserType:
    cls: type
    code: int
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]


_BY_CLASS: dict[type, _UserType] = {}
_BY_CODE: dict[int, _UserType] = {}


def register_type(cls: type, code: int, to_wire: Callable[[Any], Any],
                  from_wire: Callable[[Any], Any]) -> None:
    """Let instances of `cls` travel in messages.

    `to_wire(obj)` returns an encodable value (it may hold tensors, other registered types …);
    `from_wire(value)` rebuilds the object. `code` is an msgpack extension code in 16..127,
    unique per type and identical in every process.
    """
    if not FIRST_USER_CODE <= code <= 127:
        raise ValueError(f"extension code {code} out of range {FIRST_USER_CODE}..127")
    known = _BY_CODE.get(code)
    if known is not None and known.cls is not cls:
        raise ValueError(f"extension code {code} already taken by {known.cls.__qualname__}")
    entry = _UserType(cls, code, to_wire, from_wire)
    _BY_CLASS[cls] = entry
    _BY_CODE[code] = entry


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's data (copies only when it is not contiguous)."""
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


def tensor_from_bytes(buf: Any, dtype_name: str, shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a tensor over `buf` without copying; raises CodecError on any mismatch."""
    dtype = _TORCH_DTYPES.get(dtype_name)
    if dtype is None:
        raise CodecError(f"unknown tensor dtype {dtype_name!r}")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"bad tensor shape {shape!r}")
    mv = memoryview(buf).cast("B")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if mv.nbytes != expected:
        raise CodecError(f"tensor buffer holds {mv.nbytes} bytes, shape {list(shape)} of {dtype_name} needs {expected}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype).view(tuple(shape))


def _ndarray_from_bytes(buf: Any, dtype_str: str, shape: Sequence[int]) -> np.ndarray:
    try:
        dtype = np.dtype(dtype_str)
    except TypeError as e:
        raise CodecError(f"bad ndarray dtype {dtype_str!r}") from e
    if dtype.hasobject:
        raise CodecError("object arrays are refused on the wire")
    mv = memoryview(buf).cast("B")
    expected = math.prod(shape) * dtype.itemsize
    if mv.nbytes != expected:
        raise CodecError(f"ndarray buffer holds {mv.nbytes} bytes, shape {list(shape)} of {dtype} needs {expected}")
    return np.frombuffer(mv, dtype=dtype).reshape(shape)


def encode(obj: Any) -> list[Any]:
    """Encode `obj` into frames: [body, *buffers]. Buffers are zero-copy views."""
    buffers: list[Any] = []

    def default(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if o.numel() * o.element_size() <= INLINE_TENSOR_BYTES:
                return msgpack.ExtType(EXT_INLINE_TENSOR, msgpack.packb(
                    [str(o.dtype)[6:], list(o.shape), bytes(tensor_bytes(o))]))
            buffers.append(tensor_bytes(o))
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb(
                [str(o.dtype)[6:], list(o.shape), len(buffers)]))
        if isinstance(o, np.ndarray):
            if o.dtype.hasobject:
                raise CodecError("object arrays cannot travel on the wire (that would need pickle)")
            buffers.append(memoryview(np.ascontiguousarray(o)).cast("B"))
            return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([o.dtype.str, list(o.shape), len(buffers)]))
        if isinstance(o, Blob):
            buffers.append(memoryview(o.data).cast("B"))
            return msgpack.ExtType(EXT_BLOB, msgpack.packb(len(buffers)))
        if isinstance(o, torch.dtype):
            return msgpack.ExtType(EXT_DTYPE, str(o)[6:].encode())
        if isinstance(o, (tuple, torch.Size)):
            return list(o)
        if isinstance(o, np.generic):
            return o.item()
        entry = _BY_CLASS.get(type(o))
        if entry is not None:
            return msgpack.ExtType(entry.code, msgpack.packb(entry.to_wire(o), default=default,
                                                            use_bin_type=True))
        raise CodecError(
            f"cannot send a {type(o).__qualname__}: use msgpack types, tensors, ndarrays, Blob, or "
            "register the type with transport.codec.register_type"
        )

    try:
        body = msgpack.packb(obj, default=default, use_bin_type=True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode message: {e}") from e
    return [body, *buffers]


def decode(frames: Sequence[Any]) -> Any:
    """Decode frames made by `encode`. Raises CodecError on anything malformed."""
    if not frames:
        raise CodecError("empty message")
    nbuf = len(frames)

    def frame(index: Any) -> Any:
        if not isinstance(index, int) or not 1 <= index < nbuf:
            raise CodecError(f"buffer index {index!r} out of range (message has {nbuf - 1} buffers)")
        return frames[index]

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            dtype_name, shape, index = msgpack.unpackb(data)
            return tensor_from_bytes(frame(index), dtype_name, shape)
        if code == EXT_INLINE_TENSOR:
            dtype_name, shape, raw = msgpack.unpackb(data)
            return tensor_from_bytes(bytearray(raw), dtype_name, shape)
        if code == EXT_NDARRAY:
            dtype_str, shape, index = msgpack.unpackb(data)
            return _ndarray_from_bytes(frame(index), dtype_str, shape)
        if code == EXT_BLOB:
            return memoryview(frame(msgpack.unpackb(data))).cast("B")
        if code == EXT_DTYPE:
            dt = _TORCH_DTYPES.get(data.decode())
            if dt is None:
                raise CodecError(f"unknown dtype {data!r}")
            return dt
        entry = _BY_CODE.get(code)
        if entry is None:
            raise CodecError(f"unknown extension type {code}; is the module that registers it imported?")
        return entry.from_wire(msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False))

    try:
        return msgpack.unpackb(frames[0], ext_hook=ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise CodecError(f"malformed message body: {type(e).__name__}: {e}") from e
