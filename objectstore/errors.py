"""Typed errors of the object store. Each message says what to do next.

Errors raised on an owner travel back over RPC as `transport.RemoteError`; `from_remote`
turns them back into the typed error here so callers can `except ObjectNotFoundError`.
"""

from __future__ import annotations

from transport import RemoteError


class ObjectStoreError(Exception):
    """Base class of every error raised by objectstore/."""


class ObjectNotFoundError(ObjectStoreError, KeyError):
    """The ref is unknown to its owner, or was freed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ObjectLostError(ObjectStoreError):
    """The owner of an object died or cannot be reached; its data is gone."""

    def __init__(self, message: str, *, node_id: str = "", endpoint: str = "") -> None:
        super().__init__(message)
        self.node_id = node_id
        self.endpoint = endpoint

    @classmethod
    def for_owner(cls, object_id: str, node_id: str, endpoint: str, cause: object) -> ObjectLostError:
        return cls(
            f"object {object_id} is lost: its owner store on node {node_id!r} at {endpoint} is "
            f"dead or unreachable ({cause}); re-run the call that produced it",
            node_id=node_id, endpoint=endpoint)


class ObjectStoreFullError(ObjectStoreError, MemoryError):
    """A put would take the store over its memory limit; the message names the biggest objects
    and who holds them."""


class ShmFullError(ObjectStoreError, OSError):
    """Shared memory (/dev/shm) has no room for a segment; same-node pulls then go over TCP."""


class ShardRangeError(ObjectStoreError, IndexError):
    """A requested row range lies outside the object's rows."""


class ObjectTypeError(ObjectStoreError, TypeError):
    """An object's kind, dtype or shape differs from what the caller expected."""


class TransferTimeoutError(ObjectStoreError, TimeoutError):
    """A GPU transfer with a peer store did not finish in time (the peer is stuck or gone)."""


_BY_NAME: dict[str, type[ObjectStoreError]] = {
    f"{cls.__module__}.{cls.__qualname__}": cls
    for cls in (ObjectStoreError, ObjectNotFoundError, ObjectLostError, ObjectStoreFullError,
                ShmFullError, ShardRangeError, ObjectTypeError, TransferTimeoutError)
}


def from_remote(err: RemoteError) -> Exception:
    """The typed error an owner raised, rebuilt on the caller; other remote errors pass as they are."""
    cls = _BY_NAME.get(err.remote_type)
    if cls is None:
        return err
    typed = cls(err.remote_message)
    typed.__cause__ = err  # keeps the remote traceback reachable for debugging
    return typed
