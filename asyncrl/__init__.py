"""asyncrl: RL post-training of LLMs on an asyncio actor-message system (no Ray).

The public names below are imported on first use (PEP 562), so `asyncrl status` and the other
small commands under `asyncrl.cli` start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Batch": "asyncrl.single_controller.batch", "DistBatch": "asyncrl.single_controller.distbatch",
    "DataFuture": "asyncrl.single_controller.group", "WorkerCallError": "asyncrl.single_controller.group", "WorkerGroup": "asyncrl.single_controller.group",
    "gather": "asyncrl.single_controller.group",
    "LayoutError": "asyncrl.single_controller.parallel", "ParallelConfig": "asyncrl.single_controller.parallel", "ParallelLayout": "asyncrl.single_controller.parallel",
    "ALL_TO_ALL": "asyncrl.single_controller.protocols", "DP_PROTO": "asyncrl.single_controller.protocols", "ONE_TO_ALL": "asyncrl.single_controller.protocols",
    "LOCAL_ROWS": "asyncrl.single_controller.protocols", "Peers": "asyncrl.single_controller.peers",
    "RANK_ZERO": "asyncrl.single_controller.protocols", "THREE_D_ALL_MICRO_DP": "asyncrl.single_controller.protocols",
    "THREE_D_PP_ONLY": "asyncrl.single_controller.protocols", "THREE_D_PROTO": "asyncrl.single_controller.protocols",
    "register_protocol": "asyncrl.single_controller.protocols",
    "Worker": "asyncrl.single_controller.worker", "register": "asyncrl.single_controller.worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
