"""Routing replay and router losses in the actor's passes over a mixture-of-experts model
(`actor.moe`; the hooks are `asyncrl.train.moe`'s)."""

from __future__ import annotations

import torch

from asyncrl.algorithms import core
from asyncrl.config import MoEConfig
from asyncrl.single_controller.batch import Batch
from asyncrl.train.moe import OLD_ROUTES, ROUTES, RouterTap, RoutingError, flat_routes, tap_of

REPLAYED = {"rollout": ROUTES, "old_policy": OLD_ROUTES}  # router_replay -> the column it replays


def tap_for(model: torch.nn.Module) -> RouterTap | None:
    """The routers' tap of a model: megatron's `MegatronRoutes`, else the HF routers' (None: dense)."""
    return getattr(model, "routes", None) or tap_of(model)


def start(model: torch.nn.Module, mb: Batch, moe: MoEConfig, *, replay: str | None, losses: bool = False
          ) -> RouterTap | None:
    """Set the routers of `model` for the forward over `mb`: replay column `replay` (None: route
    freely), record their own choices, and keep their logits when `losses`. None for a dense model
    (or a Megatron model built without replay: its router losses are megatron's own)."""
    tap = tap_for(model)
    megatron = tap if getattr(model, "routes", None) is not None else None
    if tap is None:
        return None
    if replay is not None and replay not in mb:
        raise RoutingError(f"actor.moe.router_replay={moe.router_replay} replays the batch's {replay!r} column, "
                           "which this batch lacks: keep the columns generate_sequences (routed_experts) and "
                           "compute_log_prob (old_routed_experts) return in the batch you pass on")
    routes = None if replay is None else flat_routes(mb[replay])
    if megatron is not None:
        megatron.start(replay=routes, record=True, rows=mb["input_ids"].shape[0], columns=mb["input_ids"].shape[1])
    else:
        tap.start(replay=routes, record=True, keep_logits=losses)
    return tap


def router_terms(tap: RouterTap, mb: Batch, moe: MoEConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The routers' weighted losses for the last forward over `mb` and the step's MoE metrics:
    load-balancing and z-loss (layer means), the busiest expert's load over the mean, and the
    share of experts the trainer chose as the rollout engine did (when the batch has its routes).
    Megatron's routers add their losses themselves (nothing here)."""
    if not getattr(tap, "hf", True):
        return torch.zeros((), device=mb["attention_mask"].device), {}
    mask = mb["attention_mask"].reshape(-1).bool()
    logits, used, own = tap.take_logits(), tap.chosen(used=True), tap.chosen()
    aux = torch.stack([core.load_balancing_loss(z, used[:, i], mask) for i, z in enumerate(logits)]).mean()
    zl = torch.stack([core.router_z_loss(z, mask) for z in logits]).mean()
    load = core.expert_load(used, mask, tap.num_experts)
    metrics = {"moe/aux_loss": aux.detach(), "moe/z_loss": zl.detach(),
               "moe/expert_load_max": (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).max()}
    if ROUTES in mb:
        recorded = flat_routes(mb[ROUTES])
        valid = mask & (recorded >= 0).all(-1).all(-1)
        metrics["moe/routing_agreement"] = torch.tensor(core.routing_agreement(own, recorded, valid))
    return moe.aux_loss_coef * aux + moe.z_loss_coef * zl, metrics
