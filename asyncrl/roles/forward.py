"""Forward passes the RL workers share: response log-probs (and entropies), critic values, decoding."""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from asyncrl.algorithms.core import response_span
from asyncrl.data.images import model_image_kwargs
from asyncrl.rollout.params import last_positions
from asyncrl.single_controller.batch import Batch
from asyncrl.train.engine import PipelinedEngine, TrainEngine
from asyncrl.train.logits import keeps_logits as _keeps_logits
from asyncrl.train.logits import response_logprobs
from asyncrl.train.packing import Packed, is_packing, pack, predicting_slots, worth_packing
from asyncrl.train.ulysses import LOGPROBS, VALUES, run_turns, ulysses_of

log = logging.getLogger(__name__)



def sampling_temperature(batch: Batch, default: float) -> float:
    """The temperature `batch`'s responses were sampled at (log-probs must use the same one)."""
    if batch.meta.get("greedy"):
        return 1.0
    return float(batch.meta.get("temperature", default)) or 1.0


def response_forward(model: torch.nn.Module, mb: Batch, temperature: float = 1.0,
                     with_entropy: bool = False, packed: Packed | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, R] of `responses` (and entropies) under one forward of `model`.

    Logits are computed at the response positions only (`logits_to_keep`), and turned into
    log-probs and entropies in fp32 a chunk of positions at a time: no [rows, sequence, vocab]
    tensor and no full fp32 copy of the logits. Under autograd each chunk is recomputed in the
    backward pass (activation checkpointing), so the graph keeps only the model's own logits.
    A model set up for packing (`asyncrl.train.packing`) runs the rows as one packed row
    (`packed`, or `mb` packed here); zeros where a row has no response token."""
    responses = mb["responses"]
    r = responses.shape[1]
    if (sp := ulysses_of(model)) is not None:  # this rank's turn (asyncrl.train.ulysses.run_turns)
        return sp.forward(model, mb, LOGPROBS, temperature, with_entropy)
    if packed is not None or packs(model, mb):
        logits, keep = _response_logits(model, mb, packed or pack(mb))
        lp, ent = response_logprobs(logits, responses[keep][None], temperature, with_entropy)
        return _scatter(lp[0], keep), (_scatter(ent[0], keep) if with_entropy else None)
    ids = mb["input_ids"]
    kwargs = {"logits_to_keep": last_positions(ids.shape[1], r + 1, ids.device)} if _keeps_logits(model) else {}
    out = model(**model_inputs(mb), use_cache=False, **kwargs)
    return response_logprobs(out.logits[:, -r - 1:-1], responses, temperature, with_entropy)


def forward_only(engine: TrainEngine, mbs: list[Batch], fn: Any) -> list | None:
    """`fn(model, mb)` for each micro-batch without gradients: through the pipeline's stages (None
    on a stage other than the last), or in the group's sequence-parallel turns with the unsharded
    weights released after (no backward follows to reshard them)."""
    with torch.no_grad():
        if engine.pipelined and mbs:
            return cast(PipelinedEngine, engine).forward(mbs, fn)
        outs = run_turns(engine.model, mbs, lambda mb: fn(engine.model, mb))
        engine.release_unsharded()
        return outs


def model_inputs(mb: Batch) -> dict[str, torch.Tensor]:
    """A padded forward's inputs: ids, mask and positions; with images (`asyncrl.data.images`)
    their patches and grids, and every token's 3-D rope positions in place of the 1-D ones."""
    return {"input_ids": mb["input_ids"], "attention_mask": mb["attention_mask"],
            "position_ids": mb["position_ids"], **model_image_kwargs(mb)}


def packs(model: torch.nn.Module, mb: Batch) -> bool:
    """Whether `mb` runs packed through `model` (set up for packing, and worth it for these rows)."""
    return is_packing(model) and worth_packing(model, mb["attention_mask"])


def packed_inputs(pk: Packed, mb: Batch) -> dict[str, torch.Tensor]:
    """The packed row's inputs (`Packed.model_kwargs`); with images their patches and grids, and
    every packed token's 3-D rope positions [3, 1, tokens] (each row's own, as padded)."""
    kwargs = pk.model_kwargs(mb)
    images = model_image_kwargs(mb)
    if images:
        rope = images.pop("position_ids")  # [3, rows, columns]
        kwargs["position_ids"] = pk.pack(rope.permute(1, 2, 0)).permute(2, 0, 1)
        kwargs.update(images)
    return kwargs


def packed_view(model: torch.nn.Module, mb: Batch) -> tuple[Packed | None, Batch]:
    """For a model set up for packing: `mb`'s packing and its packed view (what per-token hooks
    read); else (None, `mb`)."""
    if not packs(model, mb):
        return None, mb
    pk = pack(mb)
    return pk, pk.view(mb)


def _response_logits(model: torch.nn.Module, mb: Batch, pk: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """`mb` run packed: the logits [1, K, V] at the K positions that predict a response column,
    and which of the [B, R] response columns they are."""
    slots = predicting_slots(pk, mb["responses"].shape[1])
    keep = slots >= 0
    if _keeps_logits(model):
        return model(**packed_inputs(pk, mb), use_cache=False, logits_to_keep=slots[keep]).logits, keep
    return model(**packed_inputs(pk, mb), use_cache=False).logits[:, slots[keep]], keep  # a token head: narrow


def _scatter(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[kept] values back into a [B, R] grid of zeros at `keep` (differentiable)."""
    out = values.new_zeros(keep.shape)
    return out.masked_scatter(keep, values)


def values_forward(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """Critic values [B, R] at the positions that predict each response token."""
    r = mb["responses"].shape[1]
    if (sp := ulysses_of(model)) is not None:
        return sp.forward(model, mb, VALUES)
    if packs(model, mb):
        logits, keep = _response_logits(model, mb, pack(mb))
        return _scatter(logits[0, :, 0].float(), keep)
    out = model(**model_inputs(mb), use_cache=False)
    return out.logits[:, -r - 1:-1, 0].float()


def sequence_scores(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """A sequence classifier's scores [B, labels] for `mb`, read (as transformers does) at each
    row's last token that is not the pad id; packed when the model is set up for it."""
    if not packs(model, mb) or not hasattr(model, "score"):
        return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                     position_ids=mb["position_ids"]).logits
    pk, ids = pack(mb), mb["input_ids"]
    pad = model.config.pad_token_id
    kept = ids != pad if pad is not None else torch.ones_like(ids, dtype=torch.bool)
    columns = torch.arange(ids.shape[1], device=ids.device)
    last = (columns * kept).argmax(-1)
    slots = pk.slots()[torch.arange(len(ids), device=ids.device), last]
    hidden = getattr(model, model.base_model_prefix)(**packed_inputs(pk, mb), use_cache=False).last_hidden_state
    return model.score(hidden[0, slots.clamp(min=0)])


def decode_responses(tokenizer: Any, batch: Batch) -> list[str]:
    """Each row's whole response as text: in a multi-turn trajectory every turn and observation."""
    lengths = response_span(batch).tolist()
    return [tokenizer.decode(ids[:int(k)].tolist(), skip_special_tokens=True)
            for ids, k in zip(batch["responses"], lengths, strict=True)]
