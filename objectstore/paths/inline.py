"""Plain values (anything msgpack can carry that is not a tensor) travel inside the RPC reply."""

from __future__ import annotations

from typing import Any

from objectstore.errors import ObjectTypeError
from objectstore.paths.base import PullKind, PullPath, PullRequest
from objectstore.ref import VALUE, ObjectRef, RowRange
from objectstore.table import Entry


class InlinePath(PullPath):
    kind = PullKind.INLINE

    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Any:
        self.store.counters["pulls_value"] += 1
        return await self.request(ref, None)

    def serve(self, entry: Entry, rows: RowRange | None, request: PullRequest) -> Any:
        if entry.ref.kind != VALUE:
            raise ObjectTypeError(f"object {entry.ref.object_id} is a {entry.ref.kind}; pull it with get()")
        return entry.value
