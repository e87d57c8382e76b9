"""`TrainEngine`: what the roles ask of a training backend. `FSDPEngine` (FSDP2 × DTensor TP,
`asyncrl.train.fsdp`) and `PipelineEngine` (its pipeline-parallel form) implement it, and
`MegatronEngine` (megatron-core, `asyncrl.train.megatron`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

LossFn = Callable[[torch.nn.Module, Any], tuple[Tensor, dict[str, Any]]]


@runtime_checkable
class TrainEngine(Protocol):
    """A model trained (or, with no optimizer, run forward only) over a parallel layout."""

    model: torch.nn.Module  # what the roles run their micro-batched forward passes over
    device: torch.device  # where its tensors live
    pipelined: bool  # runs a pipeline over the layout's pp dim: forward-only passes go through
    #                  `PipelinedEngine.forward`, not `model`
    lora: dict[str, Any] | None  # LoRA settings for the adapter export (set by the backend's builder), or None

    def train_step(self, micro_batches: list[Any], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the micro-batches (gradients summed); its metrics."""

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Tensor]:
        """The whole model's tensors by Hugging Face name (a collective over the ranks)."""

    def load_full_state_dict(self, sd: dict[str, Tensor], broadcast_from_rank0: bool = False) -> None:
        """Fill the shards from whole tensors."""

    def generation_buffers(self) -> Any:
        """A generation model's buffers: a module to share them from, or the device to make them on."""

    def resharder(self, gen: Any, full_model: torch.nn.Module, dtype: torch.dtype, keep_experts: bool = False) -> Any:
        """The 3D-HybridEngine reshard into the generation layout `gen`: `reshard()` gives each
        HF-named generation shard, `release()` frees them, `plans` name each one's TP dim; with
        `keep_experts` each rank keeps the block of experts it trains (expert-parallel generation)."""

    def expert_group(self) -> Any:
        """The process group over which a mixture of experts' experts are split in training."""

    def release_unsharded(self) -> None:
        """Free what a forward or a gather left unsharded (between phases)."""

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None, *, tokenizer: Any = None,
                        export_dtype: torch.dtype | None = None, asynchronous: bool = False) -> None:
        """Write a resumable checkpoint and a Hugging Face export (in the background when
        `asynchronous`)."""

    def checkpoint_pending(self) -> bool:
        """Whether a background save is still writing."""

    def finish_checkpoint(self) -> float:
        """Wait for a background save; the seconds waited."""

    def load_checkpoint(self, path: str | Path) -> dict[str, Any] | None:
        """Restore model, optimizer and scheduler; the `extra` saved with them."""


@runtime_checkable
class PipelinedEngine(TrainEngine, Protocol):
    """A `TrainEngine` whose `pipelined` is true."""

    def forward(self, micro_batches: list[Any], fn: Callable[[Any, Any], Any]) -> list[Any] | None:
        """`fn(stage model, micro-batch)` through the pipeline, forward only: the last stage's
        outputs on every rank of the stage group (None where a stage has none)."""
