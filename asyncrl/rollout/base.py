"""`Rollout`: what the roles ask of a generation engine, and what each engine can do (its
capabilities, read instead of its class). The native engine (`asyncrl.rollout.engine`) and vLLM
in process (`asyncrl.rollout.vllm_engine`) implement it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Rollout(Protocol):
    holds_own_weights: bool  # loads weights into a copy of its own (vLLM), else binds the trainer's
    step_hooks: bool  # `generate` takes `before_step` (new weights between decode steps)
    sizes_own_batches: bool  # schedules its own KV cache: callers send every row at once
    continuous_batching: bool  # can serve a `ContinuousBatcher` (rows join and leave a running batch)
    lora_rank: int  # > 0: serves LoRA adapters over its frozen base (`OwnWeightsRollout.load_adapter`)
    device: torch.device  # where its outputs live

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: Any,
                 generator: Any = None, **hooks: Any) -> dict[str, torch.Tensor]:
        """Responses, their masks and per-token log-probs for the prompt rows."""

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """New weights by Hugging Face name; how many tensors were loaded."""


@runtime_checkable
class BoundRollout(Rollout, Protocol):
    """An engine with `holds_own_weights` false: it decodes with `model`, the module whose weights
    the trainer's reshard (colocated) or weight sync (a rollout pool) fills."""

    model: torch.nn.Module


@runtime_checkable
class OwnWeightsRollout(Rollout, Protocol):
    """An engine with `holds_own_weights` true (vLLM): a copy of its own, freed while the actor trains."""

    def sleep(self) -> None:
        """Free its weights and KV cache until `wake_up` or `load_weights` (a no-op where it cannot)."""

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take back what `sleep` freed (`tags`: only those parts)."""

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                     targets: list[str]) -> int:
        """Serve policy `version`'s LoRA adapter (`lora_rank` > 0); the bytes handed over."""
