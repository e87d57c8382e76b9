"""Functions the object-store limit tests run inside worker processes."""

from __future__ import annotations

import torch


def fill_store(chunk_bytes: int, runtime) -> None:
    """Put `chunk_bytes` objects until the worker's store refuses one (ObjectStoreFullError)."""
    held = []
    while True:
        held.append(runtime.store.put(torch.zeros(chunk_bytes // 4)))


def put_rows(rows: int, runtime):
    """A (rows, 4) float tensor in the worker's store; returns its ref."""
    return runtime.store.put(torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4))
