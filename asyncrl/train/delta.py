"""Weight deltas: a tensor's new bit pattern sent as its difference from the version a receiver
already holds, compressed, with a checksum of the result.

At RL learning rates most weights keep their bit pattern in the sync dtype from one update to
the next. `encode` writes, per tensor, the XOR of the two bit patterns (zeros where nothing
changed, which zstd compresses to almost nothing) or, when fewer than `SPARSE_BELOW` of the
elements changed, whichever is smaller of it and the changed elements (gaps between their
positions and their new bit patterns); `apply` rebuilds the new tensor in
place on the receiver's copy and checks it against the sender's checksum. A receiver without the
base version gets the full tensor (`kind="full"`); a checksum that does not match is a
`DeltaMismatchError` (the caller syncs the full weights instead), never silently wrong weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xxhash
import zstandard

from asyncrl.errors import AsyncRLError

Kind = Literal["full", "xor", "sparse"]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SPARSE_BELOW = 0.02  # the changed elements are also tried when fewer than this fraction changed


class DeltaMismatchError(AsyncRLError):
    """A delta does not rebuild the sender's tensor on this receiver (another base version, or
    corrupted bytes): sync the full weights instead."""


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's update from version `base` to `version` (`base` None: the full tensor)."""

    name: str
    kind: Kind
    dtype: str
    shape: tuple[int, ...]
    base: int | None
    version: int
    payload: bytes  # zstd frames
    checksum: bytes  # blake2b-64 of the new tensor's bytes

    @property
    def nbytes(self) -> int:
        """What travels: the compressed payload and the checksum."""
        return len(self.payload) + len(self.checksum)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers of its element size (a flat CPU view)."""
    t = t.detach().contiguous().view(-1)
    return t.view(_BITS[t.element_size()])


def checksum(t: torch.Tensor) -> bytes:
    """XXH3-64 of the tensor's bytes (~20 GB/s a core: the check costs little beside the codec)."""
    return xxhash.xxh3_64_digest(_bits(t).numpy().data)


def encode(name: str, new: torch.Tensor, base: torch.Tensor | None, version: int, base_version: int | None,
           level: int = 1, only: Kind | None = None) -> TensorDelta:
    """`new` as a delta from `base` (the receiver's tensor at `base_version`), or in full when
    there is no base; the smaller of the XOR and the changed elements (`only`: that one)."""
    new_bits = _bits(new.cpu())
    total = checksum(new.cpu())
    zstd = zstandard.ZstdCompressor(level=level)
    dtype, shape = str(new.dtype).removeprefix("torch."), tuple(new.shape)
    if base is None or base_version is None:
        return TensorDelta(name, "full", dtype, shape, None, version, zstd.compress(new_bits.numpy().data), total)
    if base.shape != new.shape or base.dtype != new.dtype:
        raise DeltaMismatchError(f"{name}: base {tuple(base.shape)} {base.dtype} does not match the new "
                                 f"tensor {shape} {new.dtype}")
    xor = _bits(base.cpu()) ^ new_bits
    as_xor = zstd.compress(xor.numpy().data) if only != "sparse" else None
    count = int(torch.count_nonzero(xor)) if only is None else -1
    if only == "sparse" or (only is None and count < SPARSE_BELOW * xor.numel()):  # the changed elements, too
        changed = torch.nonzero(xor).view(-1)
        gaps = torch.diff(changed, prepend=changed.new_zeros(1)).to(torch.int64)
        sparse = zstd.compress(gaps.numpy().tobytes() + new_bits[changed].numpy().tobytes())
        if as_xor is None or len(sparse) < len(as_xor):
            return TensorDelta(name, "sparse", dtype, shape, base_version, version, sparse, total)
    return TensorDelta(name, "xor", dtype, shape, base_version, version, as_xor, total)


def apply(delta: TensorDelta, target: torch.Tensor, held_version: int | None) -> None:
    """Rebuild the sender's tensor in `target` (the receiver's copy at `held_version`), in place;
    `DeltaMismatchError` if the versions differ or the result is not the sender's."""
    if delta.kind != "full" and delta.base != held_version:
        raise DeltaMismatchError(f"{delta.name}: a delta from version {delta.base} for a receiver at "
                                 f"version {held_version}; sync the full weights")
    if tuple(target.shape) != delta.shape or str(target.dtype).removeprefix("torch.") != delta.dtype:
        raise DeltaMismatchError(f"{delta.name}: the delta is for {delta.shape} {delta.dtype}, this receiver "
                                 f"holds {tuple(target.shape)} {target.dtype}")
    raw = zstandard.ZstdDecompressor().decompress(delta.payload)
    host = target if target.device.type == "cpu" else target.cpu()
    bits = _bits(host).numpy()  # the receiver's copy, rebuilt in place (numpy: no copy of the payload)
    try:
        if delta.kind == "full":
            bits[:] = _from_bytes(raw, bits.dtype, bits.size)
        elif delta.kind == "xor":
            np.bitwise_xor(bits, _from_bytes(raw, bits.dtype, bits.size), out=bits)
        else:
            count = len(raw) // (8 + bits.itemsize)
            where = np.cumsum(_from_bytes(raw[:8 * count], np.dtype(np.int64), count))
            bits[where] = _from_bytes(raw[8 * count:], bits.dtype, count)
    except (ValueError, IndexError) as e:
        raise DeltaMismatchError(f"{delta.name}: the delta's bytes do not fit this tensor ({e})") from None
    if host is not target:
        target.copy_(host)
    if checksum(host) != delta.checksum:
        raise DeltaMismatchError(f"{delta.name}: the rebuilt tensor's checksum differs from the sender's "
                                 f"(version {delta.base} -> {delta.version}); sync the full weights")


_KINDS: tuple[Kind, ...] = ("full", "xor", "sparse")


def frame(deltas: list[TensorDelta]) -> tuple[torch.Tensor, torch.Tensor]:
    """Deltas as two tensors a broadcast carries: a header (one int64 row per delta: its kind,
    payload length, base version or -1, checksum) and the payloads end to end (uint8)."""
    header = torch.tensor([[_KINDS.index(d.kind), len(d.payload), -1 if d.base is None else d.base,
                            int.from_bytes(d.checksum, "little", signed=True)] for d in deltas],
                          dtype=torch.int64).reshape(len(deltas), 4)
    payload = torch.frombuffer(bytearray(b"".join(d.payload for d in deltas)) or bytearray(1), dtype=torch.uint8)
    return header, payload[:sum(len(d.payload) for d in deltas)]


def unframe(header: torch.Tensor, payload: torch.Tensor, pieces: list[tuple[str, torch.dtype, tuple[int, ...]]],
            version: int) -> list[TensorDelta]:
    """`frame`'s tensors back into deltas for `pieces` (name, dtype, shape; in the sender's order)."""
    rows, raw = header.cpu().tolist(), payload.cpu().numpy().tobytes()
    if len(rows) != len(pieces) or sum(r[1] for r in rows) != len(raw):
        raise DeltaMismatchError(f"a delta frame of {len(rows)} tensors and {len(raw)} bytes for {len(pieces)} "
                                 "tensors: the pools do not hold the same model")
    out, at = [], 0
    for (kind, size, base, check), (name, dtype, shape) in zip(rows, pieces, strict=True):
        if not 0 <= kind < len(_KINDS):
            raise DeltaMismatchError(f"{name}: unknown delta kind {kind}")
        out.append(TensorDelta(name, _KINDS[kind], str(dtype).removeprefix("torch."), tuple(shape),
                               None if base < 0 else base, version, raw[at:at + size],
                               check.to_bytes(8, "little", signed=True)))
        at += size
    return out


def _from_bytes(raw: bytes, dtype: np.dtype, count: int) -> np.ndarray:
    """`count` elements of `dtype` read from `raw` (a read-only view, no copy)."""
    if len(raw) != count * dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes for {count} elements of {dtype}")
    return np.frombuffer(raw, dtype=dtype)
