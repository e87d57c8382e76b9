"""Object refs, per-worker stores and pull transfers. Knows nothing of RL."""

from objectstore.errors import (
    ObjectLostError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreFullError,
    ObjectTypeError,
    ShardRangeError,
    ShmFullError,
)
from objectstore.paths import PullKind
from objectstore.ref import ObjectKind, ObjectRef, RowRange, shard_rows
from objectstore.segments import list_owner_files, list_segments, remove_stale_segments
from objectstore.store import ObjectStore

__all__ = [
    "ObjectKind", "ObjectLostError", "ObjectNotFoundError", "ObjectRef", "ObjectStore",
    "ObjectStoreError", "ObjectStoreFullError", "ObjectTypeError", "PullKind", "RowRange",
    "ShardRangeError", "ShmFullError", "list_owner_files", "list_segments", "remove_stale_segments",
    "shard_rows",
]
