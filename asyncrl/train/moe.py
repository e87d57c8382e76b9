"""Mixture-of-experts routing in Hugging Face models (Qwen3-MoE, Qwen2-MoE, Mixtral): find a
model's top-k routers, record the experts each token chose, replay recorded choices (routing
replay: the recorded experts replace top-k, their gate weights still come from the live router
logits, so the router keeps its gradient) and keep the router logits for its losses.

A `RouterTap` hooks each router once; `start()` says what the next forwards do and stays in
force until the next `start()` or `stop()`, so a layer that activation checkpointing recomputes
in the backward replays the same experts. Routes are [tokens, layers, k] per forward (its rows ×
columns flattened, as the routers see them); -1 marks a token with nothing recorded, which keeps
its own top-k (prompt padding, a response's last token that no forward consumed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

ROUTES = "routed_experts"  # the rollout's routes [rows, prompt + response, layers, k], a batch column
OLD_ROUTES = "old_routed_experts"  # the old policy's (compute_log_prob), for router_replay=old_policy
NOT_RECORDED = -1


class RoutingError(ValueError):
    """Routes that do not fit the model or the forward they are replayed in."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order; empty for a dense model."""
    return [m for m in model.modules() if _is_router(m)]


def _is_router(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "top_k", None), int) and isinstance(getattr(m, "num_experts", None), int)
            and isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2)


def is_moe_config(config: object) -> bool:
    """Whether a Hugging Face config describes a mixture-of-experts model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return bool(experts) and bool(getattr(config, "num_experts_per_tok", None))


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type that holds expert indices and -1."""
    return torch.int8 if num_experts <= 127 else torch.int16 if num_experts <= 32767 else torch.int32


@dataclass
class _Plan:
    replay: Tensor | None = None  # [tokens, layers, k]
    record: bool = False
    keep_logits: bool = False
    chosen: dict[int, Tensor] = field(default_factory=dict)  # layer -> the router's own top-k [tokens, k]
    used: dict[int, Tensor] = field(default_factory=dict)  # layer -> the experts used (replayed or own)
    logits: dict[int, Tensor] = field(default_factory=dict)  # layer -> router logits [tokens, E]


class RouterTap:
    """Hooks on a model's routers: record, replay and keep logits for the forwards after `start()`."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        self.plan: _Plan | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook_for(layer))

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return self.routers[0].top_k

    @property
    def num_experts(self) -> int:
        return self.routers[0].num_experts

    def start(self, replay: Tensor | None = None, record: bool = False, keep_logits: bool = False) -> None:
        """What the routers do from the next forward on (replay: [tokens, layers, k] or None)."""
        if replay is not None and tuple(replay.shape[1:]) != (self.layers, self.top_k):
            raise RoutingError(f"routes of shape {tuple(replay.shape)} for a model with {self.layers} MoE layers "
                               f"of top-{self.top_k}: they were recorded with another model")
        self.plan = _Plan(replay, record, keep_logits)

    def stop(self) -> None:
        self.plan = None

    def chosen(self, used: bool = False) -> Tensor:
        """The experts the routers chose in the last forward [tokens, layers, k]: their own top-k,
        or with `used` the experts the tokens went to (the replayed ones where replaying)."""
        plan = self.plan
        got = plan.used if used and plan is not None else plan.chosen if plan is not None else {}
        if len(got) != self.layers:
            raise RoutingError("no forward was recorded: call start(record=True) before the forward")
        return torch.stack([got[i] for i in range(self.layers)], 1)

    def take_logits(self) -> list[Tensor]:
        """The router logits of the last forward, per layer (with their graph); kept no longer."""
        plan = self.plan
        if plan is None:
            return []
        out = [plan.logits[i] for i in sorted(plan.logits)]
        plan.logits, plan.keep_logits = {}, False  # a recompute in the backward keeps none
        return out

    def _hook_for(self, layer: int):
        def hook(router: nn.Module, args: tuple, out: tuple[Tensor, Tensor, Tensor]):
            plan = self.plan
            if plan is None:
                return None
            logits, scores, idx = out
            if plan.record:
                plan.chosen[layer] = idx.detach()
                plan.used[layer] = idx.detach()
            if plan.keep_logits:
                plan.logits[layer] = logits
            if plan.replay is None:
                return None
            weights, used = replay_scores(router, logits, scores, idx, plan.replay[:, layer])
            if plan.record:
                plan.used[layer] = used.detach()
            return logits, weights, used
        return hook


def replay_scores(router: nn.Module, logits: Tensor, scores: Tensor, own: Tensor, recorded: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """Gate weights and experts with `recorded` [tokens, k] in place of the router's top-k `own`
    (rows with -1 keep their own): the weights are the recorded experts' softmax probabilities,
    renormalised over them as the router renormalises its own."""
    if recorded.shape != own.shape:
        raise RoutingError(f"routes for {recorded.shape[0]} tokens replayed in a forward over {own.shape[0]}: "
                           "the routes column must be sliced with the batch's input_ids")
    recorded = recorded.to(device=own.device, dtype=own.dtype)
    idx = torch.where((recorded >= 0).all(-1, keepdim=True), recorded, own)
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises (it has no such flag)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(scores.dtype), idx


def tap_of(model: nn.Module) -> RouterTap | None:
    """The model's `RouterTap`, made on first use; None for a dense model (or no module: a
    pipeline stage's replayed logits)."""
    if not isinstance(model, nn.Module):
        return None
    tap = model.__dict__.get("_asyncrl_router_tap")
    if tap is None and "_asyncrl_router_tap" not in model.__dict__:
        tap = RouterTap(model) if routers(model) else None
        model.__dict__["_asyncrl_router_tap"] = tap
    return tap


def flat_routes(routes: Tensor) -> Tensor:
    """A routes column [rows, width, layers, k] as the routers see a forward's tokens."""
    return routes.reshape(-1, *routes.shape[2:])
