"""The in-process path: the consumer is the owner, so it gets the object itself (no copy)."""

from __future__ import annotations

from typing import Any

from objectstore.paths.base import PullKind, PullPath
from objectstore.ref import VALUE, ObjectRef, RowRange


class LocalPath(PullPath):
    kind = PullKind.LOCAL
    remote = False

    async def fetch(self, ref: ObjectRef, rows: RowRange | None) -> Any:
        entry = self.store.table.entry(ref.object_id)
        self.store.counters["gets_local"] += 1
        return entry.value if ref.kind == VALUE else entry.rows(rows)
