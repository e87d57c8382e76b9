"""`Batch`: rows of named columns, the unit of data that flows between RL roles.

A batch holds three things:

- tensor columns: `torch.Tensor`s whose first dimension is the row;
- non-tensor columns: python lists with one item per row (prompts, sample ids, reward info …);
- meta: a plain dict that describes the whole batch (step, temperature, `pad_size` …).

Row operations (indexing, `take`, `chunk`, `repeat`, `concat` …) apply to every column at
once and return new batches; meta is shallow-copied into the result. Contiguous row selections
(`batch[2:5]`, `slice`, `chunk`, `split`, `unpad`) give tensor *views*, not copies.

Non-tensor items and meta values must be msgpack-encodable (str, int, float, bool, None, bytes,
lists and str-keyed dicts of these; tensors are fine in meta) so that a batch can travel in RPC
messages: `transport.codec` knows `Batch` as extension 17 and sends its tensors zero-copy as
out-of-band frames. Tuples arrive as lists. Only CPU tensors travel in messages; put GPU
batches in the object store.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, overload

import numpy as np
import torch

from transport.codec import register_type
from transport.dtypes import dtype_name as _dtype_name
from transport.wire import Ext

EXT_BATCH = int(Ext.BATCH)

Column = torch.Tensor | list[Any]
RowKey = int | slice | Sequence[int] | torch.Tensor


def _as_non_tensor(name: str, value: Any) -> list[Any]:
    """A non-tensor column as a python list (one item per row)."""
    if isinstance(value, list):
        return value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor column {name!r} is a 0-d array; it needs one item per row")
        return value.tolist()
    raise TypeError(
        f"non-tensor column {name!r} must be a list, tuple or numpy array, not "
        f"{type(value).__qualname__}; put tensors in the tensor columns and whole-batch values "
        "in meta")


def _check_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tensor column {name!r} must be a torch.Tensor, not {type(value).__qualname__}")
    if value.dim() == 0:
        raise ValueError(
            f"tensor column {name!r} is a 0-d tensor; columns need a row dimension (put "
            "whole-batch values in meta)")
    return value


def _rows(column: Column) -> int:
    return column.shape[0] if isinstance(column, torch.Tensor) else len(column)


def _values_equal(a: Any, b: Any) -> bool:
    """Equality for column and meta values: exact for tensors (NaN equals NaN), == otherwise."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        b = b.to(a.device)
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
        return False
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. lists holding tensors
        return False


def _is_number(v: Any) -> bool:
    return isinstance(v, (bool, int, float, np.bool_, np.number))


class Batch:
    """Rows of named columns: tensor columns (first dim = rows), non-tensor columns (python
    lists, one item per row), and meta info (a dict, not per-row).

    Non-tensor items and meta values must be msgpack-encodable (see the module docstring).
    A column name is either a tensor column or a non-tensor column, never both.
    """

    __slots__ = ("tensors", "non_tensors", "meta")

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, list[Any]]
    meta: dict[str, Any]

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None,
                 non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
                 meta: Mapping[str, Any] | None = None) -> None:
        self.tensors = {name: _check_tensor(name, t) for name, t in (tensors or {}).items()}
        self.non_tensors = {name: _as_non_tensor(name, v) for name, v in (non_tensors or {}).items()}
        self.meta = dict(meta or {})
        both = self.tensors.keys() & self.non_tensors.keys()
        if both:
            raise ValueError(f"columns {sorted(both)} are given both as tensors and as non-tensors")
        self._check_rows()

    @classmethod
    def _make(cls, tensors: dict[str, torch.Tensor], non_tensors: dict[str, list[Any]],
              meta: dict[str, Any]) -> Batch:
        """Build from already-validated parts without copying or checking them."""
        out = object.__new__(cls)
        out.tensors, out.non_tensors, out.meta = tensors, non_tensors, meta
        return out

    def _check_rows(self) -> None:
        sizes = {name: _rows(col) for name, col in self._columns()}
        if len(set(sizes.values())) > 1:
            first, n = next(iter(sizes.items()))
            bad = {name: m for name, m in sizes.items() if m != n}
            raise ValueError(
                f"all columns must have the same number of rows: column {first!r} has {n} rows "
                f"but " + ", ".join(f"{name!r} has {m}" for name, m in bad.items()))

    def _columns(self) -> Iterable[tuple[str, Column]]:
        yield from self.tensors.items()
        yield from self.non_tensors.items()

    def _num_columns(self) -> int:
        return len(self.tensors) + len(self.non_tensors)

    # basics -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """The number of rows (0 for a batch without columns)."""
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        """Column names: tensor columns first, then non-tensor columns."""
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or name in self.non_tensors

    def _missing(self, names: Iterable[str]) -> KeyError | None:
        missing = [n for n in names if n not in self]
        if not missing:
            return None
        return KeyError(f"no column {', '.join(map(repr, missing))} in batch; available columns: "
                        f"{self.keys()}")

    @overload
    def __getitem__(self, key: str) -> Column: ...

    @overload
    def __getitem__(self, key: int | builtins.slice | Sequence[int] | torch.Tensor) -> Batch: ...

    def __getitem__(self, key: str | RowKey) -> Column | Batch:
        """`batch["name"]` is a column; any other key selects rows and gives a Batch.

        Rows may be chosen by an int (a one-row batch), a slice (views when the step is
        positive), a list of ints or an integer tensor (gathered copies), or a bool tensor or
        list of bools of length `len(batch)` (a mask).
        """
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.non_tensors:
                return self.non_tensors[key]
            raise self._missing([key])  # type: ignore[misc]
        if isinstance(key, slice):
            return self._slice_rows(key)
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            n = len(self)
            i = operator.index(key)
            if not -n <= i < n:
                raise IndexError(f"row {i} is out of range for a batch of {n} rows")
            i %= n
            return self._slice_rows(slice(i, i + 1))
        return self.take(self._index_tensor(key, allow_mask=True))

    def __setitem__(self, name: str, value: torch.Tensor | Sequence[Any] | np.ndarray) -> None:
        """Add or replace a column; a tensor becomes a tensor column, anything else a list."""
        if not isinstance(name, str):
            raise TypeError(f"column names are str, not {type(name).__qualname__}")
        column: Column
        if isinstance(value, torch.Tensor):
            column = _check_tensor(name, value)
        else:
            column = _as_non_tensor(name, value)
        others = [(k, c) for k, c in self._columns() if k != name]
        if others and _rows(others[0][1]) != _rows(column):
            raise ValueError(
                f"column {name!r} has {_rows(column)} rows but the batch has {_rows(others[0][1])}")
        self.tensors.pop(name, None)
        self.non_tensors.pop(name, None)
        if isinstance(column, torch.Tensor):
            self.tensors[name] = column
        else:
            self.non_tensors[name] = column

    @property
    def pad_size(self) -> int:
        """How many rows at the end are padding added by `pad_to_divisor`."""
        return int(self.meta.get("pad_size", 0))

    # columns ------------------------------------------------------------------------------
    def select(self, *names: str, meta: bool = True) -> Batch:
        """A batch with only the named columns (same tensors, no copy); meta copied if `meta`."""
        err = self._missing(names)
        if err is not None:
            raise err
        return Batch._make({n: self.tensors[n] for n in names if n in self.tensors},
                           {n: self.non_tensors[n] for n in names if n in self.non_tensors},
                           dict(self.meta) if meta else {})

    def pop(self, *names: str) -> Batch:
        """Remove the named columns from this batch and return them as a batch (meta copied)."""
        out = self.select(*names)
        for n in names:
            self.tensors.pop(n, None)
            self.non_tensors.pop(n, None)
        return out

    def union(self, other: Batch) -> Batch:
        """A new batch with the columns and meta of both.

        Row counts must match (unless one side has no columns); a column or meta key present in
        both must hold equal values in both, else ValueError.
        """
        if self._num_columns() and other._num_columns() and len(self) != len(other):
            raise ValueError(f"cannot union a batch of {len(self)} rows with one of {len(other)} rows")
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        for name, col in other._columns():
            if name in self:
                if not _values_equal(self[name], col):
                    raise ValueError(
                        f"column {name!r} is in both batches with different values; rename or "
                        "pop it from one side before union")
            elif isinstance(col, torch.Tensor):
                tensors[name] = col
            else:
                non_tensors[name] = col
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and not _values_equal(meta[key], value):
                raise ValueError(
                    f"meta[{key!r}] differs between the batches ({meta[key]!r} vs {value!r})")
            meta[key] = value
        return Batch._make(tensors, non_tensors, meta)

    # rows ---------------------------------------------------------------------------------
    def _slice_rows(self, s: builtins.slice) -> Batch:
        if s.step is not None and s.step < 0:  # torch cannot view with a negative step
            return self.take(list(range(*s.indices(len(self)))))
        return Batch._make({k: t[s] for k, t in self.tensors.items()},
                           {k: v[s] for k, v in self.non_tensors.items()}, dict(self.meta))

    def _index_tensor(self, indices: Any, allow_mask: bool = False) -> torch.Tensor:
        """Row indices as a 1-D int64 CPU tensor, negatives resolved and range-checked."""
        n = len(self)
        if isinstance(indices, torch.Tensor):
            idx = indices.detach().cpu()
        elif isinstance(indices, np.ndarray):
            idx = torch.from_numpy(indices)
        elif isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
            raise TypeError(f"cannot select rows with a {type(indices).__qualname__}")
        else:
            items = list(indices)
            if items and all(isinstance(i, (bool, np.bool_)) for i in items):
                idx = torch.tensor(items, dtype=torch.bool)
            else:
                idx = torch.tensor([operator.index(i) for i in items], dtype=torch.int64)
        if idx.dim() != 1:
            raise IndexError(f"row indices must be 1-D, got shape {list(idx.shape)}")
        if idx.dtype == torch.bool:
            if not allow_mask:
                raise TypeError("take() needs integer indices; use batch[mask] for a bool mask")
            if idx.numel() != n:
                raise IndexError(f"a bool mask of {idx.numel()} entries cannot select rows of a "
                                 f"batch of {n} rows")
            return idx.nonzero().squeeze(1)
        if idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"row indices must be integers, got {_dtype_name(idx.dtype)}")
        idx = idx.to(torch.int64)
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -n or hi >= n:
                bad = lo if lo < -n else hi
                raise IndexError(f"row {bad} is out of range for a batch of {n} rows")
            idx = torch.where(idx < 0, idx + n, idx)
        return idx

    def take(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """The rows at `indices` (any order, repeats allowed), as gathered copies."""
        idx = self._index_tensor(indices)
        rows = idx.tolist()
        return Batch._make(
            {k: t.index_select(0, idx.to(t.device)) for k, t in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.non_tensors.items()},
            dict(self.meta))

    def slice(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) as views (python slice semantics, negatives allowed)."""
        return self._slice_rows(slice(start, stop))

    def chunk(self, n: int) -> list[Batch]:
        """`n` batches of equal size, as views."""
        if n < 1:
            raise ValueError(f"cannot chunk into {n} pieces; n must be >= 1")
        rows = len(self)
        if rows % n:
            raise ValueError(
                f"cannot chunk {rows} rows into {n} equal chunks; call batch.pad_to_divisor({n}) "
                "first and unpad() the results")
        size = rows // n
        return [self._slice_rows(slice(i * size, (i + 1) * size)) for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Batches of `size` rows (the last may be shorter), as views; [] for an empty batch."""
        if size < 1:
            raise ValueError(f"cannot split into chunks of {size} rows; size must be >= 1")
        return [self._slice_rows(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """The rows of all `batches` in order; they must have the same columns. Meta: the first's."""
        if not batches:
            raise ValueError("cannot concat an empty sequence of batches")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for kind, mine, theirs in (("tensor", first.tensors, b.tensors),
                                       ("non-tensor", first.non_tensors, b.non_tensors)):
                if mine.keys() != theirs.keys():
                    lacks = [k for k in mine if k not in theirs]
                    extra = [k for k in theirs if k not in mine]
                    raise ValueError(
                        f"cannot concat: batch {i} differs from batch 0 in its {kind} columns "
                        f"(missing {lacks}, extra {extra})")
        tensors: dict[str, torch.Tensor] = {}
        for name, t0 in first.tensors.items():
            parts = [b.tensors[name] for b in batches]
            for i, t in enumerate(parts):
                if t.dtype != t0.dtype or t.shape[1:] != t0.shape[1:]:
                    raise ValueError(
                        f"cannot concat column {name!r}: batch 0 has {_dtype_name(t0.dtype)} rows "
                        f"of shape {list(t0.shape[1:])}, batch {i} has {_dtype_name(t.dtype)} "
                        f"rows of shape {list(t.shape[1:])}")
            try:
                tensors[name] = torch.cat(parts)
            except RuntimeError as e:  # e.g. columns on different devices
                raise ValueError(f"cannot concat column {name!r}: {e}") from e
        non_tensors = {name: [x for b in batches for x in b.non_tensors[name]]
                       for name in first.non_tensors}
        return Batch._make(tensors, non_tensors, dict(first.meta))

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row `times` times: interleaved (r0, r0, r1, r1) or the whole batch tiled (r0, r1, r0, r1)."""
        if times < 0:
            raise ValueError(f"cannot repeat {times} times")
        if interleave:
            tensors = {k: t.repeat_interleave(times, dim=0) for k, t in self.tensors.items()}
            non_tensors = {k: [x for x in v for _ in range(times)]
                           for k, v in self.non_tensors.items()}
        else:
            tensors = {k: t.repeat(times, *([1] * (t.dim() - 1))) for k, t in self.tensors.items()}
            non_tensors = {k: v * times for k, v in self.non_tensors.items()}
        return Batch._make(tensors, non_tensors, dict(self.meta))

    def pad_to_divisor(self, divisor: int) -> Batch:
        """A batch whose length is a multiple of `divisor`, made by appending copies of the first
        rows (cycling if there are fewer rows than needed).

        The number of added rows is recorded in `meta["pad_size"]` (added to any earlier
        padding, so `unpad` removes all of it).
        """
        if divisor < 1:
            raise ValueError(f"cannot pad to a multiple of {divisor}; divisor must be >= 1")
        n = len(self)
        pad = -n % divisor if n else 0
        meta = {**self.meta, "pad_size": self.pad_size + pad}
        if not pad:
            return Batch._make(dict(self.tensors), dict(self.non_tensors), meta)
        rows = [i % n for i in range(pad)]
        idx = torch.tensor(rows, dtype=torch.int64)
        return Batch._make(
            {k: torch.cat([t, t.index_select(0, idx.to(t.device))]) for k, t in self.tensors.items()},
            {k: v + [v[i] for i in rows] for k, v in self.non_tensors.items()},
            meta)

    def unpad(self) -> Batch:
        """Drop the last `pad_size` rows (views) and set `meta["pad_size"]` to 0."""
        pad, n = self.pad_size, len(self)
        if not 0 <= pad <= n:
            raise ValueError(f"meta['pad_size'] is {pad} but the batch has {n} rows")
        out = self._slice_rows(slice(0, n - pad))
        out.meta["pad_size"] = 0
        return out

    # tensors ------------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on `device` (non-tensor columns and meta unchanged)."""
        return Batch._make({k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()},
                           dict(self.non_tensors), dict(self.meta))

    def contiguous(self) -> Batch:
        """The batch with contiguous tensors (copies only those that are not)."""
        return Batch._make({k: t.contiguous() for k, t in self.tensors.items()},
                           dict(self.non_tensors), dict(self.meta))

    def nbytes(self) -> int:
        """Bytes held by the tensor columns' elements."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def equal(self, other: object) -> bool:
        """Same columns (kind, dtype, shape, values; NaN equals NaN) and same meta."""
        if not isinstance(other, Batch):
            return False
        if self.tensors.keys() != other.tensors.keys():
            return False
        if self.non_tensors.keys() != other.non_tensors.keys() or self.meta.keys() != other.meta.keys():
            return False
        return (all(_values_equal(t, other.tensors[k]) for k, t in self.tensors.items())
                and all(_values_equal(v, other.non_tensors[k]) for k, v in self.non_tensors.items())
                and all(_values_equal(v, other.meta[k]) for k, v in self.meta.items()))

    def __repr__(self) -> str:
        cols = [f"{k}: {_dtype_name(t.dtype)}{list(t.shape)}" for k, t in self.tensors.items()]
        cols += [f"{k}: list[{len(v)}]" for k, v in self.non_tensors.items()]
        return f"Batch({len(self)} rows; {', '.join(cols) or 'no columns'}; meta {list(self.meta)})"

    # building -----------------------------------------------------------------------------
    @staticmethod
    def from_rows(rows: Sequence[Mapping[str, Any]]) -> Batch:
        """A batch from per-row dicts with the same keys.

        A key whose values are all tensors, numeric arrays or numbers becomes a tensor column
        (tensors stacked; numbers give bool, int64 or the default float dtype as torch infers);
        any other key becomes a non-tensor column.
        """
        if not rows:
            return Batch()
        names = list(rows[0])
        for i, row in enumerate(rows):
            if row.keys() != rows[0].keys():
                lacks = [k for k in names if k not in row]
                extra = [k for k in row if k not in rows[0]]
                raise ValueError(f"row {i} has different keys from row 0 (missing {lacks}, "
                                 f"extra {extra})")
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, list[Any]] = {}
        for name in names:
            values = [row[name] for row in rows]
            if all(_is_number(v) for v in values):
                tensors[name] = torch.tensor([v.item() if isinstance(v, np.generic) else v
                                              for v in values])
            elif all(isinstance(v, torch.Tensor) or _is_number(v)
                     or (isinstance(v, np.ndarray) and not v.dtype.hasobject) for v in values):
                try:
                    tensors[name] = torch.stack([torch.as_tensor(v) for v in values])
                except RuntimeError as e:
                    raise ValueError(
                        f"cannot stack column {name!r}: {e}; pad its values to one shape first"
                    ) from e
            else:
                non_tensors[name] = values
        return Batch._make(tensors, non_tensors, {})


def _batch_to_wire(batch: Batch) -> list[Any]:
    return [batch.tensors, batch.non_tensors, batch.meta]


def _batch_from_wire(value: list[Any]) -> Batch:
    tensors, non_tensors, meta = value
    return Batch(tensors, non_tensors, meta)


register_type(Batch, EXT_BATCH, _batch_to_wire, _batch_from_wire)
