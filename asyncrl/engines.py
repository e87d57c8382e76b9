"""The tables of training backends (`actor.backend`, `critic.backend`) and rollout engines
(`rollout.engine`): by name, how the roles build each and what each can do. The config checks,
the preflight, the planner, the trainer and the roles ask an entry, never compare a name.

A new backend or engine is its module and one entry: here, or from a package of yours through
the entry-point groups `asyncrl.backends` / `asyncrl.rollout_engines` (`name =
"your_pkg.module:ENTRY"`, a `TrainBackend` / `RolloutEngineKind`), which driver and workers
alike read. Builders are "module:function" paths, imported on first use (the config check needs
only the table)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from transport.checks import ConfigError


def _load(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class TrainBackend:
    """A training backend: its builders and what it can do."""

    actor_engines: str  # "module:function": (worker, base, layout, one_copy) -> (actor, ref) engines
    critic_engine: str  # "module:function": (worker, model path, layout) -> the critic's engine
    teacher_engine: str | None = None  # "module:function": (worker, model path, layout) -> a forward-only engine
    teacher_pipeline: bool = False  # its teacher engine runs pipeline stages (`teacher.parallel.pp` > 1)
    lora: bool = False  # trains LoRA adapters (`*.lora`)
    sequence_parallel: bool = False  # Ulysses (`*.parallel.sp` > 1)
    packing: bool = False  # packed sequences (`*.pack_sequences`)
    expert_parallel: bool = False  # `actor.moe.ep` > 1
    hf_routers: bool = False  # trains the Hugging Face model's routers (`actor.moe.freeze_router` applies)
    feeds_split_pool: bool = False  # its shards feed the weight sync to a separate rollout pool
    one_layout_per_process: bool = False  # actor and critic in one process share a parallel layout
    moe_tensor_parallel: bool = False  # tensor-parallel training of a mixture-of-experts model
    moe_pipeline: bool = False  # pipeline stages of a mixture-of-experts model
    whole_tp_pp_shards: bool = False  # memory: DP ranks hold whole TP x PP shards, optimizer state over DP
    images: bool = False  # trains vision-language models on image prompts (`asyncrl.data.images`)
    failover: bool = False  # its engines rebuild on a re-formed process group from kept states (trainer.failover)
    offload: bool = False  # keeps the optimizer's state in host memory between its steps (`actor.offload`)
    offload_weights: bool = False  # keeps the weights in host memory while the rollout generates (`actor.offload=all`)
    requires: str | None = None  # "module:function" raising ConfigError when its library is missing
    model_check: str | None = None  # "module:function": (role, section, model path, cfg) -> None, before workers start

    def check(self, role: str, section: Any, path: str, cfg: Any) -> None:
        """Before any worker starts: its library is there, and the model at `path` is one it runs."""
        if self.requires:
            _load(self.requires)()
        if self.model_check:
            _load(self.model_check)(role, section, path, cfg)

    def build_actor(self, worker: Any, base: Any, layout: Any, one_copy: bool) -> tuple[Any, Any]:
        return _load(self.actor_engines)(worker, base, layout, one_copy)

    def build_critic(self, worker: Any, path: str, layout: Any) -> Any:
        return _load(self.critic_engine)(worker, path, layout)

    def build_teacher(self, worker: Any, path: str, layout: Any) -> Any:
        if self.teacher_engine is None:
            raise ConfigError("this training backend builds no teacher engine (its TrainBackend has no teacher_engine)")
        return _load(self.teacher_engine)(worker, path, layout)


@dataclass(frozen=True)
class RolloutEngineKind:
    """A rollout engine: its builder and what it can do."""

    build: str  # "module:function": (worker, model, colocated) -> the engine (asyncrl.rollout.base.Rollout)
    reads_own_weights: bool = False  # loads the checkpoint itself: a rollout-only worker builds a skeleton
    records_routes: bool = False  # records each token's experts (`actor.moe.router_replay=rollout`)
    continuous_batching: bool = False  # serves a split pool's calls from one continuous batch
    compiles_decode: bool = False  # takes rollout.decode=compiled
    any_generation_tp: bool = True  # a generation TP group need not be the whole training TP group
    merges_embedding_adapters_on_split_pool: bool = True  # a split pool can merge LoRA on embeddings
    merges_adapters_on_split_pool: bool = True  # a split pool can merge LoRA adapters into its base
    hard_context_limit: bool = False  # refuses prompt + response past max_position_embeddings
    images: bool = False  # generates from image prompts (`generate(..., images=...)`)
    failover: bool = False  # generates from the actor's weights only: rebuilt with it (trainer.failover)
    expert_parallel: bool = False  # splits a mixture's experts over the ranks that train them (`rollout.parallel.ep`)
    device_bytes: str | None = None  # "module:function": (cfg, device bytes) -> bytes it takes on a GPU

    def build_engine(self, worker: Any, model: Any, colocated: bool) -> Any:
        return _load(self.build)(worker, model, colocated)

    def takes_device_bytes(self, cfg: Any, device_bytes: float) -> float:
        return _load(self.device_bytes)(cfg, device_bytes) if self.device_bytes else 0.0


def _vllm_device_bytes(cfg: Any, device_bytes: float) -> float:
    """vLLM sizes its pool from `gpu_memory_utilization` (and sleeps while the actor trains)."""
    return cfg.rollout.vllm.gpu_memory_utilization * device_bytes


BACKENDS: dict[str, TrainBackend] = {
    "fsdp2": TrainBackend("asyncrl.roles.actor:fsdp_engines", "asyncrl.roles.critic:fsdp_critic",
                          teacher_engine="asyncrl.roles.teacher:fsdp_teacher", lora=True,
                          sequence_parallel=True, packing=True, hf_routers=True, feeds_split_pool=True, images=True,
                          failover=True, offload=True, offload_weights=True),
    "megatron": TrainBackend("asyncrl.roles.actor:megatron_engines", "asyncrl.roles.critic:megatron_critic",
                             teacher_engine="asyncrl.roles.teacher:megatron_teacher", teacher_pipeline=True,
                             expert_parallel=True, one_layout_per_process=True, moe_tensor_parallel=True,
                             moe_pipeline=True, whole_tp_pp_shards=True, offload=True, offload_weights=True,
                             requires="asyncrl.train.megatron:require_megatron",
                             model_check="asyncrl.preflight:check_megatron_model"),
}

ROLLOUT_ENGINES: dict[str, RolloutEngineKind] = {
    "native": RolloutEngineKind("asyncrl.roles.actor:native_rollout", records_routes=True, continuous_batching=True,
                                compiles_decode=True, images=True, failover=True, expert_parallel=True),
    "vllm": RolloutEngineKind("asyncrl.roles.actor:vllm_rollout", reads_own_weights=True, any_generation_tp=False,
                              merges_embedding_adapters_on_split_pool=False, merges_adapters_on_split_pool=False,
                              hard_context_limit=True, device_bytes="asyncrl.engines:_vllm_device_bytes"),
}

BACKEND_GROUP, ENGINE_GROUP = "asyncrl.backends", "asyncrl.rollout_engines"
_loaded: set[str] = set()


def with_entry_points(table: dict[str, Any], group: str, kind: type) -> dict[str, Any]:
    """`table` with the installed packages' entries of entry-point `group` added (once per group);
    each must be a `kind`."""
    if group not in _loaded:
        _loaded.add(group)
        for ep in entry_points(group=group):
            if ep.name not in table:
                entry = ep.load()
                if not isinstance(entry, kind):
                    raise ConfigError(f"entry point {group}:{ep.name} = {ep.value} is a {type(entry).__name__}, "
                                      f"not a {kind.__name__} ({kind.__module__})")
                table[ep.name] = entry
    return table


def backends() -> dict[str, TrainBackend]:
    """The training backends, with the installed packages' entry points added (once)."""
    return with_entry_points(BACKENDS, BACKEND_GROUP, TrainBackend)


def rollout_engines() -> dict[str, RolloutEngineKind]:
    """The rollout engines, with the installed packages' entry points added (once)."""
    return with_entry_points(ROLLOUT_ENGINES, ENGINE_GROUP, RolloutEngineKind)


def _lookup(table: dict[str, Any], name: str, what: str, group: str) -> Any:
    if name not in table:
        raise ConfigError(f"no {what} {name!r}; known: {', '.join(sorted(table))} (more through the "
                          f"{group!r} entry points)")
    return table[name]


def backend(name: str) -> TrainBackend:
    return _lookup(backends(), name, "training backend", BACKEND_GROUP)


def rollout_engine(name: str) -> RolloutEngineKind:
    return _lookup(rollout_engines(), name, "rollout engine", ENGINE_GROUP)
