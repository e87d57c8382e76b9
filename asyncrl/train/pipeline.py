"""Pipeline parallelism for Hugging Face Llama/Qwen2-family causal LMs with
torch.distributed.pipelining, composed with FSDP2 over dp (and TP over tp).

    layout = ParallelLayout.from_config(ParallelConfig(pp=2), world_size)
    stage = parallelize(model, layout)          # split_stages, then apply_tp / apply_fsdp
    engine = PipelineEngine(stage, layout, optim=OptimConfig(...))
    metrics = engine.train_step(micro_batches, loss_fn)      # every rank
    log_probs = engine.forward(micro_batches, response_fn)   # last stage; None elsewhere

`split_stages` keeps each rank's share of the decoder layers in the model it is given, in an
`nn.ModuleDict` keyed by the layer's index, so parameter names (`model.layers.7.mlp...`) stay
those of the unsplit HF model: DCP checkpoints, the HF export and full state dicts line up with
the non-pipelined engine's. The first stage keeps the token embedding, the last the final norm
and LM head. Only the hidden states travel between stages; every stage gets the micro-batch's
`attention_mask` and `position_ids` (schedule kwargs) and builds the 4-D attention mask itself
with transformers' own `create_causal_mask`, so padded batches match the unsplit model.

Loss functions are the non-pipelined engine's `loss_fn(model, micro_batch)`: on the last stage
`model` is a stand-in whose call returns the pipeline's logits for that micro-batch (as
`.logits`), so `response_forward(model, mb)` works unchanged. Tied input/output embeddings
cannot span stages: `split_stages` refuses them; `untie_embeddings` makes two parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from asyncrl.single_controller.parallel import ParallelLayout
from asyncrl.train.common import local_tensor, owner_stage, stage_layers
from asyncrl.train.fsdp import EngineError, FSDPEngine, LossFn, global_grad_norm
from asyncrl.train.optim import OptimConfig

log = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


# -- the stage module ----------------------------------------------------------------------------


class DecoderStage(nn.Module):
    """One pipeline stage of an HF decoder-only causal LM, parameter names as in the full model.

    `forward(x, attention_mask, position_ids)`: `x` is the input ids [B, S] on the first stage
    and the previous stage's hidden states [B, S, H] elsewhere; returns hidden states, or the
    logits [B, S, V] on the last stage.
    """

    def __init__(self, causal_lm: nn.Module, layer_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = causal_lm.config
        self.generation_config = getattr(causal_lm, "generation_config", None)
        body = causal_lm.model
        body.layers = nn.ModuleDict({str(i): body.layers[i] for i in layer_ids})
        if not first:
            body.embed_tokens = None
        if not last:
            body.norm = None
        self.model = body
        self.lm_head = causal_lm.lm_head if last else None
        self.is_first, self.is_last = first, last
        types = getattr(self.config, "layer_types", None)
        self._layer_types = {str(i): types[i] if types else "full_attention" for i in layer_ids}

    # apply_tp looks the embeddings up by these
    def get_input_embeddings(self) -> nn.Module | None:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def forward(self, x: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        h = self.model.embed_tokens(x) if self.is_first else x
        masks = self._attention_masks(h, attention_mask, position_ids)
        position_embeddings = self.model.rotary_emb(h, position_ids=position_ids)
        for name, layer in self.model.layers.items():
            h = layer(h, attention_mask=masks[self._layer_types[name]], position_ids=position_ids,
                      position_embeddings=position_embeddings, past_key_values=None, use_cache=False)
        if self.is_last:
            return self.lm_head(self.model.norm(h))
        return h

    def _attention_masks(self, h: Tensor, attention_mask: Tensor, position_ids: Tensor) -> dict[str, Any]:
        """The masks the HF model builds for its layers, from the 2-D padding mask."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                      past_key_values=None, position_ids=position_ids)
        masks: dict[str, Any] = {}
        if "full_attention" in self._layer_types.values():
            masks["full_attention"] = create_causal_mask(**kwargs)
        if "sliding_attention" in self._layer_types.values():
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks


def untie_embeddings(model: nn.Module) -> nn.Module:
    """Give the LM head its own copy of the tied token embedding (and say so in the config), so
    the model can be split into pipeline stages. The two then train as separate parameters."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embed.weight:
        head.weight = nn.Parameter(embed.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def split_stages(model: nn.Module, pp_rank: int, pp_size: int) -> DecoderStage:
    """Stage `pp_rank` of `pp_size` of an HF Llama/Qwen2-family causal LM, built from `model` in
    place (the other stages' modules are dropped). Refuses tied embeddings (see
    `untie_embeddings`): the embedding lives on the first stage and the head on the last."""
    body = getattr(model, "model", None)
    if not isinstance(getattr(body, "layers", None), nn.ModuleList) or not hasattr(model, "lm_head") \
            or not hasattr(body, "rotary_emb"):
        raise EngineError(f"{type(model).__name__}: pipeline parallelism supports HF decoder-only "
                          "causal LMs with model.layers, model.rotary_emb and lm_head (Llama/Qwen2 "
                          "family); set parallel.pp=1 for other models")
    n_layers = len(body.layers)
    if not 1 <= pp_size <= n_layers:
        raise EngineError(f"parallel.pp={pp_size} but the model has {n_layers} decoder layers; "
                          f"choose pp between 1 and {n_layers}")
    if model.lm_head.weight is body.embed_tokens.weight:
        raise EngineError("the model ties its input and output embeddings, which pipeline stages "
                          "cannot share (the embedding is on the first stage, the LM head on the "
                          "last); call asyncrl.train.pipeline.untie_embeddings(model) before "
                          "parallelize, or set parallel.pp=1")
    layers = stage_layers(n_layers, pp_rank, pp_size)
    stage = DecoderStage(model, layers, first=pp_rank == 0, last=pp_rank == pp_size - 1)
    log.info("pipeline stage %d of %d: decoder layers %d..%d%s%s", pp_rank, pp_size, layers.start,
             layers.stop - 1, ", embedding" if stage.is_first else "", ", norm + LM head" if stage.is_last else "")
    return stage


# -- values between stages (asyncrl's wire codec: msgpack + raw tensor bytes, never pickle) ---------


def _to_bytes(value: Any) -> Tensor:
    import msgpack

    from transport.codec import encode

    frames = [bytes(f) for f in encode(value)]
    return torch.frombuffer(bytearray(msgpack.packb(frames, use_bin_type=True)), dtype=torch.uint8)


def _from_bytes(data: Tensor) -> Any:
    import msgpack

    from transport.codec import decode

    return decode(msgpack.unpackb(data.numpy().tobytes(), raw=False))


def broadcast_value(value: Any, src: int, group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """`value` (plain data and CPU tensors) from global rank `src` to every rank of `group`."""
    data = _to_bytes(value) if dist.get_rank() == src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = data.to(device) if data is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return _from_bytes(buf.cpu()) if data is None else value


def all_gather_values(value: Any, group: dist.ProcessGroup | None, device: torch.device) -> list[Any]:
    """Every rank's `value`, in group-rank order."""
    data = _to_bytes(value).to(device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return [_from_bytes(p[: int(s.item())].cpu()) for p, s in zip(parts, sizes, strict=True)]


# -- the engine ----------------------------------------------------------------------------------


@dataclass
class StageOutput:
    """What a loss function's `model(...)` returns on the last stage: the pipeline's logits."""

    logits: Tensor


class _LogitsReplay:
    """Stands in for the model in `loss_fn(model, micro_batch)` on the last stage: calling it
    returns the logits the pipeline already computed for that micro-batch."""

    def __init__(self, logits: Tensor, config: Any) -> None:
        self._logits = logits
        self.config = config

    def __call__(self, input_ids: Tensor | None = None, **_: Any) -> StageOutput:
        if input_ids is not None and tuple(input_ids.shape) != tuple(self._logits.shape[:2]):
            raise EngineError(f"the loss function called the model on input_ids of shape "
                              f"{tuple(input_ids.shape)}, but the pipeline ran its micro-batch of "
                              f"shape {tuple(self._logits.shape[:2])}; in a pipelined engine the "
                              "loss may only run the model on its own micro-batch, once")
        return StageOutput(self._logits)


def model_inputs(micro_batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """`input_ids`, `attention_mask` (default all ones) and `position_ids` (default: the
    attended tokens counted from 0) of a micro-batch that maps names to tensors."""
    ids = micro_batch["input_ids"]
    mask = micro_batch["attention_mask"] if "attention_mask" in micro_batch else torch.ones_like(ids)
    pos = micro_batch["position_ids"] if "position_ids" in micro_batch else (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def pad_micro_batches(inputs: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Stack micro-batches into [n * rows, seq] for the schedule, padding each to the largest
    rows and seq: a pipeline stage sends one fixed shape. Extra columns go on the right (causal
    attention keeps them from the real tokens) and extra rows are fully attended dummies (an
    all-masked row can give NaN that would leak into gradients); both are sliced off the
    logits before any loss sees them."""
    rows = max(ids.shape[0] for ids, _, _ in inputs)
    seq = max(ids.shape[1] for ids, _, _ in inputs)
    out_ids, out_mask, out_pos = [], [], []
    for ids, mask, pos in inputs:
        r, s = ids.shape
        full_ids = ids.new_zeros(rows, seq)
        full_mask = mask.new_ones(rows, seq)
        full_pos = torch.arange(seq, device=pos.device, dtype=pos.dtype).expand(rows, seq).clone()
        full_ids[:r, :s], full_mask[:r, :s], full_pos[:r, :s] = ids, mask, pos
        if s < seq:
            full_pos[:r, s:] = pos[:, -1:] + torch.arange(1, seq - s + 1, device=pos.device)
        out_ids.append(full_ids)
        out_mask.append(full_mask)
        out_pos.append(full_pos)
    return torch.cat(out_ids), torch.cat(out_mask), torch.cat(out_pos)


def forward_through(micro_batches: list[Any], fn: Callable[[Any, Any], Any], run: Callable[[Callable], None],
                    device: torch.device, is_last: bool) -> list[Any] | None:
    """A pipelined engine's forward-only pass: `run(on_output)` drives the stages, `fn(model,
    micro_batch)` runs on the last one; its results there, None on the other stages."""
    if not micro_batches:
        raise EngineError("forward needs at least one micro-batch")
    outs: dict[int, Any] = {}

    def on_output(model: Any, i: int) -> Tensor:
        outs[i] = fn(model, micro_batches[i])
        return torch.zeros((), device=device)

    run(on_output)
    return [outs[i] for i in range(len(micro_batches))] if is_last else None


class PipelineEngine(FSDPEngine):
    """`FSDPEngine` over a `DecoderStage` (see `parallelize`): the same train step, checkpoints
    and full state dicts, run as a pipeline over the layout's pp dim.

    Every method is a collective over all ranks of the layout. The ranks of one pipeline (same
    dp/tp coordinates) must pass the same micro-batches (the RL data shard is per dp rank, so
    they do). Schedule: 1F1B when there are at least as many micro-batches as stages, else
    GPipe; gradients are summed over micro-batches exactly as in `FSDPEngine` (no 1/n scaling
    by the schedule: losses arrive already scaled).
    """

    pipelined = True

    def __init__(self, model: DecoderStage, layout: ParallelLayout, *, optim: OptimConfig | None,
                 device: str | None = None, offload: str = "none") -> None:
        if not isinstance(model, DecoderStage):
            raise EngineError("PipelineEngine needs the stage module that parallelize() returns "
                              "for a layout with pp > 1")
        super().__init__(model, layout, optim=optim, device=device, offload=offload)
        self.pp_size = layout.size("pp")
        self.pp_rank = layout.coord(self.rank, "pp")
        self.pp_group = layout.submesh("pp", self.device.type).get_group() if self.pp_size > 1 else None
        self.is_last = self.pp_rank == self.pp_size - 1
        self._pipe: tuple[tuple, PipelineStage, Any] | None = None  # (shape key, stage, schedule)
        self._on_output: Callable[[Tensor, int], Tensor] | None = None

    # -- running the pipeline ------------------------------------------------------------------

    def _schedule(self, n_micro: int, rows: int, seq: int) -> Any:
        """The stage and schedule for `n_micro` micro-batches of [rows, seq]; rebuilt (shapes
        are inferred again, a collective over the pipeline) when the shape changes."""
        key = (n_micro, rows, seq)
        if self._pipe is None or self._pipe[0] != key:
            stage = PipelineStage(self.model, self.pp_rank, self.pp_size, self.device, group=self.pp_group)
            kind = Schedule1F1B if n_micro >= self.pp_size else ScheduleGPipe
            schedule = kind(stage, n_microbatches=n_micro, loss_fn=self._stage_loss, scale_grads=False)
            self._pipe = (key, stage, schedule)
        return self._pipe[2]

    def _stage_loss(self, output: Tensor, target: Tensor) -> Tensor:
        assert self._pipe is not None and self._on_output is not None
        schedule = self._pipe[2]
        if schedule._has_backward and not getattr(schedule, "_stage_backward_initialized", True):
            # torch's shape inference before the first backward runs the loss once on an
            # uninitialised output; any scalar of it will do, and the user's loss never sees it
            return output.float().sum() * 0.0
        # the schedule's target for micro-batch i is tensor([i])
        return self._on_output(output, int(target.reshape(-1)[0]))

    def _run(self, micro_batches: list[Any], on_output: Callable[[Any, int], Tensor], *, train: bool) -> None:
        """Push `micro_batches` through the pipeline; on the last stage call
        `on_output(replay_model, i)` for micro-batch i (its return: the loss to backpropagate
        when training)."""
        inputs = [model_inputs(mb) for mb in micro_batches]
        shapes = [tuple(ids.shape) for ids, _, _ in inputs]
        ids, mask, pos = (t.to(self.device) for t in pad_micro_batches(inputs))
        n = len(micro_batches)
        schedule = self._schedule(n, ids.shape[0] // n, ids.shape[1])

        def at_output(logits: Tensor, i: int) -> Tensor:
            rows, seq = shapes[i]
            return on_output(_LogitsReplay(logits[:rows, :seq], self.model.config), i)

        self._on_output = at_output
        args = (ids,) if self.pp_rank == 0 else ()
        kwargs = dict(attention_mask=mask, position_ids=pos, target=torch.arange(n, device=self.device),
                      return_outputs=False)
        try:
            if train:
                schedule.step(*args, **kwargs)
            else:
                with torch.no_grad():
                    schedule.eval(*args, **kwargs)
        finally:
            self._on_output = None

    def train_step(self, micro_batches: list[Any], loss_fn: LossFn) -> dict[str, float]:
        """`FSDPEngine.train_step` through the pipeline: `loss_fn(model, micro_batch)` runs on
        the last stage, where `model(...)` returns the pipeline's logits for `micro_batch`.
        Returns the same metrics on every rank (the last stage's, broadcast over pp)."""
        if self.optimizer is None or self.scheduler is None or self.optim_config is None:
            raise EngineError("this engine was built with optim=None (inference only)")
        if not micro_batches:
            raise EngineError("train_step needs at least one micro-batch")
        self.model.train()
        results: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}

        def on_output(model: Any, i: int) -> Tensor:
            loss, metrics = loss_fn(model, micro_batches[i])
            results[i] = (
                loss.detach().float(),
                {k: torch.as_tensor(v, dtype=torch.float32).detach().to(self.device) for k, v in metrics.items()})
            return loss

        self._run(micro_batches, on_output, train=True)

        grad_norm, lr, finite = self._optimizer_step()

        out: dict[str, float] | None = None
        if self.is_last:
            if len(results) != len(micro_batches):
                raise EngineError(f"the pipeline computed {len(results)} of {len(micro_batches)} "
                                  "micro-batch losses")
            names = sorted(results[0][1])
            loss_sum = torch.stack([results[i][0] for i in range(len(micro_batches))]).sum()
            means = [torch.stack([results[i][1][k] for i in range(len(micro_batches))]).mean() for k in names]
            packed = torch.stack([loss_sum, *means])
            dist.all_reduce(packed, group=self.mesh.get_group())
            values = (packed / self.mesh.size()).tolist()
            out = {"loss": values[0], **dict(zip(names, values[1:], strict=True))}
        out = self._from_last_stage(out)
        out.update(grad_norm=grad_norm.item(), lr=float(lr), skipped=0.0 if finite else 1.0)
        return out

    def forward(self, micro_batches: list[Any], fn: Callable[[Any, Any], Any]) -> list[Any] | None:
        """`fn(model, micro_batch)` per micro-batch, without gradients, as in the non-pipelined
        engine (e.g. `response_forward`): the list of its results on the last stage, None on
        the other stages."""
        return forward_through(micro_batches, fn, lambda on_output: self._run(micro_batches, on_output, train=False),
                               self.device, self.is_last)

    def _from_last_stage(self, value: Any) -> Any:
        if self.pp_group is None:
            return value
        src = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        return broadcast_value(value, src, self.pp_group, self.device)

    def _clip_grads(self, max_norm: float) -> Tensor:
        """The L2 norm of all stages' grads (sums of squares all-reduced over pp), clipped."""
        grads = [p.grad for p in self._params if p.grad is not None]
        squares = global_grad_norm(grads).square() if grads else torch.zeros(())
        squares = squares.to(self.device)
        if self.pp_group is not None:
            dist.all_reduce(squares, group=self.pp_group)
        total = squares.sqrt()
        if max_norm > 0 and torch.isfinite(total) and grads:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            with torch.no_grad():
                torch._foreach_mul_([local_tensor(g) for g in grads], coef)
        return total

    # -- full state dicts across stages -----------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Tensor]:
        """The whole model's unsharded state dict (every stage's parameters) on CPU; with
        rank0_only the other ranks get {}."""
        stage_sd = super().full_state_dict(rank0_only=False)  # collective over this stage's dp/tp
        if self.pp_group is None:
            return stage_sd if (self.rank == 0 or not rank0_only) else {}
        parts = all_gather_values(stage_sd, self.pp_group, self.device)  # the stages, over each pipeline
        if rank0_only and self.rank != 0:
            return {}
        return {k: v for part in parts for k, v in part.items()}

    def load_full_state_dict(self, sd: dict[str, Tensor], broadcast_from_rank0: bool = False) -> None:
        """Load the whole model's unsharded state dict (each stage takes its own entries); with
        broadcast_from_rank0 only rank 0 needs to hold it."""
        if broadcast_from_rank0:
            sd = broadcast_value(sd if self.rank == 0 else None, 0, None, self.device)
        own = set(self.model.state_dict())
        missing = own - set(sd)
        if missing:
            raise EngineError(f"the state dict lacks {len(missing)} of this stage's entries, e.g. "
                              f"{sorted(missing)[:3]}")
        set_model_state_dict(self.model, {k: v for k, v in sd.items() if k in own},
                             options=StateDictOptions(full_state_dict=True))


__all__ = ["DecoderStage", "PipelineEngine", "StageOutput", "model_inputs", "owner_stage", "pad_micro_batches",
           "split_stages", "stage_layers", "untie_embeddings"]
