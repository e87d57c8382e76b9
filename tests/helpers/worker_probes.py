"""What tests read inside actor workers, run there through `group.apply` (test-only code stays
out of asyncrl): the weights a sync carries, and the SFT loss without an update."""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms import core
from asyncrl.roles.actor import ActorRolloutRefWorker
from asyncrl.single_controller.batch import Batch
from asyncrl.train.common import full_tensor
from asyncrl.train.lora import adapter_scales, merged_weight
from asyncrl.train.weight_sync import full_tensors


def actor_worker(runtime: Any) -> ActorRolloutRefWorker:
    """The actor worker this process hosts."""
    return next(i for i in runtime.instances.values() if isinstance(i, ActorRolloutRefWorker))


def weights_checksum(runtime: Any) -> list[float]:
    """Per synced tensor, the sum of its values in float64: the generating weights of a
    rollout-only worker (after loading any staged version), the full training weights
    otherwise (a collective over the training pool). Both pools agree after a sync."""
    w = actor_worker(runtime)
    dtype = w.pool.sync_dtype
    if w.actor is None:
        if w.batcher is None:
            w.pool.apply_staged()
        named = dict(w.rollout.model.named_parameters())
        return [float(named[name].double().sum()) for name in w.pool.synced_weights()]
    if w.cfg.actor.lora.enabled:  # the adapted weights as the rollout merges them
        scales, state = adapter_scales(w.actor.model), w.actor.model.state_dict()
        full = {k: full_tensor(v) for k, v in state.items()}
        return [float(merged_weight(full[f"{m}.weight"], full[f"{m}.lora_A"].to(dtype),
                                    full[f"{m}.lora_B"].to(dtype), scales[m], dtype)
                      .double().sum()) for m in scales]
    return [float(t.to(dtype).double().sum()) for t in full_tensors(w.actor.model)]


def weights_digest(runtime: Any) -> list[str]:
    """Per synced tensor, a hash of its bytes in the sync dtype: what a rollout-only worker
    generates with (any staged version loaded), or the full training weights (a collective over
    the training pool). Equal when a sync rebuilt the weights bit for bit."""
    from asyncrl.train.delta import checksum

    w = actor_worker(runtime)
    if w.actor is None:
        w.pool.apply_staged()
        named = dict(w.rollout.model.named_parameters())
        return [checksum(named[name].detach()).hex() for name in w.pool.synced_weights()]
    return [checksum(t.to(w.pool.sync_dtype)).hex() for t in full_tensors(w.actor.model)]


def forget_held_version(runtime: Any) -> int:
    """A rollout-only worker told its staging copy holds another version: the next delta must
    not rebuild there. Returns the version it held."""
    pool = actor_worker(runtime).pool
    held, pool._held_version = pool._held_version, -7
    return held if held is not None else -1


def sft_loss(batch: Batch, runtime: Any) -> dict[str, float]:
    """Pretrain/SFT loss (mean negative log-likelihood of response tokens), no update."""
    w = actor_worker(runtime)
    logp, _ = w._log_probs(w.actor, batch, with_entropy=False)
    if logp is None:  # not the last pipeline stage: the driver keeps the last stage's
        return {}
    mask = batch["response_mask"].float()
    return {"sft_loss": float(-core.masked_mean(logp, mask)), "tokens": float(mask.sum())}
