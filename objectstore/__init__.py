"""Object refs, tensor futures, per-worker stores and pull transfers. Knows nothing of RL."""

from objectstore.errors import (
    ObjectLostError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreFullError,
    ObjectTypeError,
    ShardRangeError,
)
from objectstore.future import ObjectFuture, contains_refs, resolve_refs
from objectstore.ref import ObjectRef, RowRange, shard_rows
from objectstore.shm import list_segments, remove_stale_segments
from objectstore.store import ObjectStore

__all__ = [
    "ObjectFuture", "ObjectLostError", "ObjectNotFoundError", "ObjectRef", "ObjectStore",
    "ObjectStoreError", "ObjectStoreFullError", "ObjectTypeError", "RowRange", "ShardRangeError",
    "contains_refs", "list_segments", "remove_stale_segments", "resolve_refs", "shard_rows",
]
