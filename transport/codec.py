"""The wire format: msgpack with out-of-band buffers.

A message is a list of frames: frame 0 is the msgpack body, frames 1.. are raw buffers.
Tensors, ndarrays and `Blob`s are replaced in the body by a small extension record that
names their buffer's frame index, so their bytes are never copied into the body and are
rebuilt zero-copy on receive (the result views the received frame's memory).

Under CurveZMQ no frame on the wire is larger than `FRAME_BYTES`: servers refuse larger frames
before allocating them (ZMQ_MAXMSGSIZE is a per-frame limit, checked on the frame header, also
during the handshake), so a peer without a key cannot make a server hold more than that per
connection. A larger body or buffer is sent as consecutive chunks, announced by a leading
header frame (0xC1, msgpack's never-used byte, then the msgpack list of chunk counts); the
receiver joins the chunks into one buffer (one copy, only for frames above `FRAME_BYTES`).
Without CurveZMQ (`insecure=True`) there is no handshake to protect and any peer may send a
message of any size (ZeroMQ holds a multipart message whole before delivering it), so the RPC
layer sends frames whole there (`encode(split=False)`, `split_frames` at the socket when chunked)
and both sides skip the copy.

Later layers add their own message types with `register_type` (an `ObjectRef`, say) or as
typed messages with `message` (below); every extension code is listed in `wire.Ext`.
Nothing is ever pickled: a type that is neither msgpack-native nor registered is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from transport.errors import CodecError
from transport.wire import FIRST_USER_CODE, Ext

# Extension codes live in `transport.wire.Ext`, the one table of every layer's codes.
EXT_TENSOR = int(Ext.TENSOR)
EXT_NDARRAY = int(Ext.NDARRAY)
EXT_BLOB = int(Ext.BLOB)
EXT_DTYPE = int(Ext.DTYPE)
EXT_INLINE_TENSOR = int(Ext.INLINE_TENSOR)

# The largest frame on the wire; see the module docstring.
FRAME_BYTES = 128 << 10
_CHUNKED = 0xC1

# Tensors smaller than this travel inside the body: a frame costs more than copying a few bytes.
INLINE_TENSOR_BYTES = 512

# torch.frombuffer warns on read-only memory (received ZeroMQ frames are read-only); the
# rebuilt tensor shares the frame's memory on purpose.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

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
    unique per type and identical in every process: take it from `transport.wire.Ext`.
    """
    if not FIRST_USER_CODE <= code <= 127:
        raise ValueError(f"extension code {code} out of range {FIRST_USER_CODE}..127")
    known = _BY_CODE.get(code)
    if known is not None and known.cls is not cls:
        raise ValueError(f"extension code {code} already taken by {known.cls.__qualname__}")
    entry = _UserType(cls, code, to_wire, from_wire)
    _BY_CLASS[cls] = entry
    _BY_CODE[code] = entry


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


@functools.cache
def _dtypes() -> Any:
    """`transport.dtypes`, which imports torch: loaded with the first tensor sent or received, so
    the command line's messages start no torch."""
    import transport.dtypes

    return transport.dtypes


def encode(obj: Any, split: bool = True) -> list[Any]:
    """Encode `obj` into frames: [body, *buffers]. Buffers are zero-copy views; with `split`,
    frames above FRAME_BYTES are cut into chunks (`split_frames`)."""
    buffers: list[Any] = []
    torch = sys.modules.get("torch")  # a process that never imported it holds no tensor (the CLI)

    def default(o: Any) -> Any:
        if torch is not None and isinstance(o, torch.Tensor):
            tensor_bytes = _dtypes().tensor_bytes
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
        if torch is not None and isinstance(o, torch.dtype):
            return msgpack.ExtType(EXT_DTYPE, str(o)[6:].encode())
        if isinstance(o, tuple):  # torch.Size too
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
    return split_frames([body, *buffers]) if split else [body, *buffers]


def split_frames(frames: list[Any]) -> list[Any]:
    """`frames` with every frame above FRAME_BYTES cut into chunks (zero-copy views), behind a
    header frame; unchanged when all are small."""
    if all(len(f) <= FRAME_BYTES for f in frames):
        return frames
    counts: list[int] = []
    out: list[Any] = [b""]
    for f in frames:
        mv = memoryview(f).cast("B")
        pieces = [mv[i:i + FRAME_BYTES] for i in range(0, mv.nbytes, FRAME_BYTES)] or [mv]
        counts.append(len(pieces))
        out += pieces
    out[0] = bytes([_CHUNKED]) + msgpack.packb(counts)
    return out


def chunk_counts(frame: Any) -> list[int] | None:
    """The chunk counts a `split_frames` header frame announces; None for any other frame (or a
    malformed header, which `join_frames` reports)."""
    mv = memoryview(frame).cast("B")
    if mv.nbytes < 2 or mv[0] != _CHUNKED:
        return None
    try:
        counts = msgpack.unpackb(mv[1:])
    except Exception:
        return None
    if not isinstance(counts, list) or not counts or not all(type(n) is int and n > 0 for n in counts):
        return None
    return counts


def join_frames(frames: Sequence[Any], first: int | None = None) -> list[Any]:
    """Undo `split_frames` (its output, or a message without a header, unchanged); with
    `first`, only the first `first` logical frames are joined and returned."""
    if not frames or memoryview(frames[0]).nbytes == 0 or memoryview(frames[0]).cast("B")[0] != _CHUNKED:
        return list(frames if first is None else frames[:first])
    try:
        counts = msgpack.unpackb(memoryview(frames[0]).cast("B")[1:])
    except Exception as e:
        raise CodecError(f"malformed chunk header: {type(e).__name__}: {e}") from e
    if (not isinstance(counts, list) or not all(isinstance(n, int) and n > 0 for n in counts)
            or sum(counts) != len(frames) - 1):
        raise CodecError(f"chunk header {counts!r} does not match the {len(frames) - 1} frames sent")
    out: list[Any] = []
    pos = 1
    for n in counts[:first]:
        if n == 1:
            out.append(frames[pos])
        else:
            parts = [np.frombuffer(f, dtype=np.uint8) for f in frames[pos:pos + n]]
            # numpy's allocator asks for huge pages on large arrays: ~4x faster than a bytearray
            # here, where first-touch page faults dominate the copy
            joined = np.empty(sum(p.size for p in parts), dtype=np.uint8)
            at = 0
            for p in parts:
                joined[at:at + p.size] = p
                at += p.size
            out.append(memoryview(joined))
        pos += n
    return out


def decode(frames: Sequence[Any]) -> Any:
    """Decode frames made by `encode`. Raises CodecError on anything malformed."""
    frames = join_frames(frames)
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
            return _dtypes().tensor_from_bytes(frame(index), dtype_name, shape)
        if code == EXT_INLINE_TENSOR:
            dtype_name, shape, raw = msgpack.unpackb(data)
            return _dtypes().tensor_from_bytes(bytearray(raw), dtype_name, shape)
        if code == EXT_NDARRAY:
            dtype_str, shape, index = msgpack.unpackb(data)
            return _ndarray_from_bytes(frame(index), dtype_str, shape)
        if code == EXT_BLOB:
            return memoryview(frame(msgpack.unpackb(data))).cast("B")
        if code == EXT_DTYPE:
            dt = _dtypes().DTYPES.get(data.decode())
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


# typed messages ---------------------------------------------------------------------------------
# A message class is a frozen dataclass registered with `@message(CODE)`: it travels as its
# fields in declaration order, enum fields by value, and a received value that is not a member of
# the field's enum raises `CodecError` (answered to the sender as a malformed request, never
# guessed at). Nothing is pickled.
T = TypeVar("T")


def _field_decoders(cls: type) -> list[tuple[str, Callable[[Any], Any] | None]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Callable[[Any], Any] | None]] = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        decode: Callable[[Any], Any] | None = None
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            decode = _enum_decoder(hint, cls, f.name)
        elif typing.get_origin(hint) is tuple or any(
                typing.get_origin(a) is tuple for a in typing.get_args(hint)):
            decode = _tuple_decoder  # msgpack has no tuples: a tuple field arrives as a list
        out.append((f.name, decode))
    return out


def _tuple_decoder(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _enum_decoder(kind: type[enum.Enum], cls: type, name: str) -> Callable[[Any], Any]:
    def decode(v: Any) -> enum.Enum:
        try:
            return kind(v)
        except ValueError:
            raise CodecError(f"{cls.__qualname__}.{name}: {v!r} is not a {kind.__qualname__} "
                             f"(one of {[m.value for m in kind]}); are both sides the same "
                             "asyncrl version?") from None
    return decode


def _to_wire_value(v: Any) -> Any:
    return v.value if isinstance(v, enum.Enum) else v


def message(code: Ext) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a frozen dataclass as a typed message with extension `code`."""
    def wrap(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__qualname__} must be a frozen dataclass to travel as a message")
        decoders: list[tuple[str, Callable[[Any], Any] | None]] | None = None
        names = [f.name for f in dataclasses.fields(cls)]

        def to_wire(obj: Any) -> list[Any]:
            return [_to_wire_value(getattr(obj, n)) for n in names]

        def from_wire(v: Any) -> Any:
            nonlocal decoders
            if decoders is None:  # type hints resolve once every class of the module exists
                decoders = _field_decoders(cls)
            if not isinstance(v, list) or len(v) != len(decoders):
                raise CodecError(f"a {cls.__qualname__} has {len(decoders)} fields, got {v!r:.200}")
            kwargs = {n: (d(x) if d is not None and x is not None else x)
                      for (n, d), x in zip(decoders, v, strict=True)}
            return cls(**kwargs)

        register_type(cls, int(code), to_wire, from_wire)
        return cls

    return wrap
