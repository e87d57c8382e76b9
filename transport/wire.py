"""Every msgpack extension code in asyncrl, and typed messages (frozen dataclasses) on the wire.

Codes are one table so two layers can never pick the same number; upper layers import their
code from here (transport never imports them). A message class is a frozen dataclass
registered with `@message(CODE)`: it travels as its fields in declaration order, enum fields by
value, and a received value that is not a member of the field's enum raises `CodecError`
(answered to the sender as a malformed request, never guessed at). Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from transport.errors import CodecError


class Ext(enum.IntEnum):
    """msgpack extension codes. 0..15 belong to transport's own codec."""

    TENSOR = 1
    NDARRAY = 2
    BLOB = 3
    DTYPE = 4
    INLINE_TENSOR = 5
    # objectstore
    OBJECT_REF = 16
    # asyncrl
    BATCH = 17
    DIST_BATCH = 18
    # objectstore pull messages
    PULL_REQUEST = 20
    TENSOR_REGION = 21
    SHM_REPLY = 22
    TCP_REPLY = 23
    CUDA_IPC_REPLY = 24
    # daemons control messages
    NODE_REGISTRATION = 32
    WORKER_SPEC = 33
    WORKER_READY = 34
    WORKER_EXIT = 35
    NODE_STATUS = 36
    WORKER_STATUS = 37
    CLUSTER_STATUS = 38
    NODE_INFO = 39
    CHILD_STATUS = 40
    JOB_STATUS = 41


FIRST_USER_CODE = 16

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
    from transport.codec import register_type

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
