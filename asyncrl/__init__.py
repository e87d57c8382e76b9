"""asyncrl: RL post-training of LLMs on an asyncio actor-message system (no Ray)."""

from asyncrl.batch import Batch
from asyncrl.distbatch import DistBatch
from asyncrl.group import DataFuture, WorkerCallError, WorkerGroup, gather
from asyncrl.parallel import LayoutError, ParallelConfig, ParallelLayout
from asyncrl.protocols import (
    ALL_TO_ALL,
    DP_PROTO,
    ONE_TO_ALL,
    RANK_ZERO,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    register_protocol,
)
from asyncrl.worker import Worker, register

__version__ = "0.1.0"

__all__ = [
    "ALL_TO_ALL", "DP_PROTO", "ONE_TO_ALL", "RANK_ZERO", "THREE_D_ALL_MICRO_DP", "THREE_D_PP_ONLY",
    "THREE_D_PROTO", "Batch", "DataFuture", "DistBatch", "LayoutError", "ParallelConfig",
    "ParallelLayout", "Worker", "WorkerCallError", "WorkerGroup", "gather", "register", "register_protocol",
]
