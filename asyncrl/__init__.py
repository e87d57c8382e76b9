"""asyncrl: RL post-training of LLMs on an asyncio actor-message system (no Ray).

The public names below are imported on first use (PEP 562), so `asyncrl status` and the other
small commands under `asyncrl.cli` start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Batch": "asyncrl.batch", "DistBatch": "asyncrl.distbatch",
    "DataFuture": "asyncrl.group", "WorkerCallError": "asyncrl.group", "WorkerGroup": "asyncrl.group",
    "gather": "asyncrl.group",
    "LayoutError": "asyncrl.parallel", "ParallelConfig": "asyncrl.parallel", "ParallelLayout": "asyncrl.parallel",
    "ALL_TO_ALL": "asyncrl.protocols", "DP_PROTO": "asyncrl.protocols", "ONE_TO_ALL": "asyncrl.protocols",
    "RANK_ZERO": "asyncrl.protocols", "THREE_D_ALL_MICRO_DP": "asyncrl.protocols",
    "THREE_D_PP_ONLY": "asyncrl.protocols", "THREE_D_PROTO": "asyncrl.protocols",
    "register_protocol": "asyncrl.protocols",
    "Worker": "asyncrl.worker", "register": "asyncrl.worker",
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
