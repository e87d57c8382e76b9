"""Megatron's pipeline schedule (1F1B, `get_forward_backward_func`) over asyncrl's micro-batches
and loss functions: micro-batches padded to one shape (a stage sends one tensor shape), the loss
function run on the last stage against the pipeline's logits (`asyncrl.train.pipeline`'s
replay), gradients summed over micro-batches as without stages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from asyncrl.train.megatron.cpu import cuda_on_cpu
from asyncrl.train.pipeline import _LogitsReplay, model_inputs, pad_micro_batches

OnOutput = Callable[[Any, int], Tensor]  # (model replaying micro-batch i's logits, i) -> its loss


def run_pipeline(engine: Any, micro_batches: list[Any], on_output: OnOutput, *, train: bool) -> None:
    """Every micro-batch through `engine`'s stages; `on_output` on the last stage (a collective
    over the pipeline group)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs = [model_inputs(mb) for mb in micro_batches]
    ids, mask, _ = (t.to(engine.device) for t in pad_micro_batches(inputs))
    n = len(micro_batches)
    rows, seq = ids.shape[0] // n, ids.shape[1]

    def forward_step(order: Any, model: Any) -> tuple[Tensor, Callable]:
        i = next(order)
        part = slice(i * rows, (i + 1) * rows)
        out = engine.model.stage(ids[part], mask[part])
        r, s = inputs[i][0].shape

        def loss(logits: Tensor) -> tuple[Tensor, dict]:
            # megatron divides each micro-batch's loss by their number: asyncrl's are already scaled
            return on_output(_LogitsReplay(logits[:r, :s], engine.hf_config), i) * n, {}
        return out, loss

    with cuda_on_cpu():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(n)),
                                    model=[engine.ddp or engine.gpt], num_microbatches=n, seq_length=seq,
                                    micro_batch_size=rows, forward_only=not train)
