"""Moving every batch in a call's arguments or results: `materialize_all` pulls each `DistBatch`
nested in a value into a `Batch`, `publish_all` puts each `Batch` into a store, `to_device` moves
them. One batch at a time is `distbatch.materialize` / `distbatch.publish` (re-exported here).
The store is an argument: inside a worker it is the worker's, on the driver the `JobContext`'s."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.distbatch import DistBatch, materialize, publish
from asyncrl.single_controller.tree import tree_map, tree_map_async
from objectstore import ObjectStore

__all__ = ["materialize", "materialize_all", "publish", "publish_all", "to_device"]


def to_device(value: Any, device: str | torch.device) -> Any:
    """`value` with every Batch in it (nested in lists, tuples, dicts) on `device`; on a CPU
    device nothing moves (pulled rows arrive in host memory)."""
    device = torch.device(device)
    if device.type == "cpu":
        return value
    return tree_map(lambda b: b.to(device), value, Batch)


async def materialize_all(value: Any, store: ObjectStore, tally: list[int] | None = None) -> Any:
    """`value` with every DistBatch in it (nested in lists, tuples, dicts) pulled into a Batch
    (`tally`: bytes pulled from `store` itself and from other stores are added to its two entries)."""
    return await tree_map_async(lambda d: materialize(d, store, tally), value, DistBatch)


def publish_all(value: Any, store: ObjectStore) -> Any:
    """`value` with every Batch in it put in `store` and replaced by its DistBatch."""
    return tree_map(lambda b: publish(b, store), value, Batch)
