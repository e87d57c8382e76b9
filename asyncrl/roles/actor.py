"""ActorRolloutRef: the policy (trained with TP × FSDP2), its rollout engine and the frozen
reference policy, colocated in one process per device (HybridFlow's 3D-HybridEngine).

The actor trains in the `actor.parallel` layout (p-t-d); generation runs in the `pg-tg-dg-d`
layout of `rollout.parallel` over the same ranks (`asyncrl.single_controller.parallel.generation_layout`). The
native rollout engine owns no weights: before generating, each micro-DP group all-gathers its
training shards into the generation shards (`asyncrl.train.reshard`), which the weightless
generation model binds without a copy; before the next training step they are released. With
`rollout.engine=vllm` the same reshard output is loaded into the worker's in-process vLLM engine
(`asyncrl.rollout.vllm_engine`) once per update, and the gather buffer is freed at once.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from asyncrl.agents.api import ApiRollout, is_api_agent
from asyncrl.agents.rollout import (
    BatcherGenerator,
    MultiTurnRollout,
    WaveGenerator,
    trajectories_to_tensors,
)
from asyncrl.algorithms import core
from asyncrl.algorithms.losses import is_behaviour_loss, policy_losses
from asyncrl.algorithms.roles import ROW_TOKENS
from asyncrl.config import FILL_TOKEN_BUDGET, ActorConfig, RLConfig, rl_config
from asyncrl.data.images import (
    IMAGE_INPUTS,
    ROPE,
    ImageReader,
    flat_images,
    freeze_vision,
    has_images,
    rope_positions,
    row_images,
)
from asyncrl.engines import backend, rollout_engine
from asyncrl.metrics import timed
from asyncrl.roles import replay, routing
from asyncrl.roles.failover import Failover, rebuilding
from asyncrl.roles.forward import forward_only, packed_view, response_forward, sampling_temperature
from asyncrl.roles.kept_rollouts import RolloutKeeper
from asyncrl.roles.pools import PoolWeights, adapter_settings
from asyncrl.roles.process import load_causal_lm, setup_process
from asyncrl.roles.update import micro_batches, ppo_update, row_micro_batches
from asyncrl.rollout.base import BoundRollout, OwnWeightsRollout, Rollout
from asyncrl.rollout.params import SamplingParams
from asyncrl.rollout.tp import GenerationModel
from asyncrl.rollout.vllm_engine import VLLMRolloutEngine, kv_bytes_per_token
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.memory import phase as memory_phase
from asyncrl.single_controller.memory import release_host_memory
from asyncrl.single_controller.parallel import DATA_DIMS, ParallelLayout, generation_layout, pure_dp
from asyncrl.single_controller.protocols import (
    DP_PROTO,
    ONE_TO_ALL,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PROTO,
)
from asyncrl.single_controller.worker import Worker, register
from asyncrl.train import (
    FSDPEngine,
    TrainEngine,
    compute_dtype,
    mixed_precision_policy,
    parallelize,
    rng_state,
    set_rng_state,
)
from asyncrl.train.common import full_tensor
from asyncrl.train.fsdp import warn_if_bf16_is_slow
from asyncrl.train.load import copy_shards, load_sharded, load_streamed, materialize, skeleton
from asyncrl.train.lora import (
    adapter_scales,
    adapter_shapes,
    adapters_disabled,
    apply_lora,
    fresh_adapter,
    is_lora_param,
    merged_weight,
    plain_name,
)
from asyncrl.train.moe import NOT_RECORDED, OLD_ROUTES, ROUTES, route_dtype, routers
from asyncrl.train.packing import AUTO_ATTR, is_packing, resolve_packing
from asyncrl.train.pipeline import PipelineEngine, untie_embeddings
from asyncrl.train.ulysses import sequence_parallel, turn_loss
from asyncrl.train.weight_sync import (
    TensorSpec,
    specs_of,
)
from transport import trace

if TYPE_CHECKING:  # the engine's model code loads in the workers that generate, not in the driver
    from asyncrl.rollout.continuous import ContinuousBatcher
    from asyncrl.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "greedy")


class ActorRolloutRefWorker(Worker):
    """`roles` picks what this process hosts: any of "actor", "rollout", "ref"."""

    # the weights between pools, the kept states of trainer.failover: their registered methods are this worker's
    parts = {"pool": PoolWeights, "failover": Failover}

    def __init__(self, config: RLConfig | dict[str, Any], roles: tuple[str, ...] = ("actor", "rollout", "ref")) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        self.cfg = cfg = rl_config(config)
        self.roles = set(roles)
        setup_process(cfg, self.rank)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        # a rollout-only pool (trainer.placement=split) is data parallel over its own ranks
        layout = self.register_mesh(ParallelLayout.from_config(cfg.actor.parallel, self.world_size)
                                    if "actor" in self.roles else pure_dp(self.world_size))
        self.gen_layout = self.register_mesh(generation_layout(layout, cfg.rollout.parallel))
        base = self._base_model(one_copy="actor" in self.roles)
        sync_dtype, sync_specs = self._sync_specs(base)
        self.actor: TrainEngine | None = None  # the policy in training
        self.ref: TrainEngine | None = None  # the frozen reference policy
        self.rollout: Rollout | None = None  # the generation engine
        # LoRA, rollout-only: the adapted weights' base values
        replica = "rollout" in self.roles and "actor" not in self.roles
        pristine = self._rollout_replica(base, layout, sync_specs) if replica else {}
        warn_if_bf16_is_slow(self.device, cfg.model.dtype)
        self._fill_token_budget()  # actor.max_tokens_per_micro_batch=-1
        self._build_engines(base, layout, one_copy="actor" in self.roles)
        pack_engines(self.cfg, [e for e in (self.actor, self.ref) if e is not None], layout, "actor" in self.roles)
        self._hybrid_engine(base, layout)  # the reshard from training into generation weights
        self._pool_state(sync_dtype, sync_specs, pristine)  # split placement: versions from the training pool
        self.agent = (_agent_rollout(cfg, self.tokenizer, base.config)  # rollout.multi_turn (asyncrl.agents)
                      if cfg.rollout.multi_turn.enable and self.rollout is not None else None)
        self._per_step_state(layout)

    def _fill_token_budget(self) -> None:
        """actor.max_tokens_per_micro_batch=-1: set it to the budget the memory estimate fits into
        this worker's device (a GPU's memory; on a CPU its share of the node's), logged by rank 0."""
        if "actor" not in self.roles or self.cfg.actor.max_tokens_per_micro_batch != FILL_TOKEN_BUDGET:
            return
        from asyncrl.plan.memory import GIB, fill_token_budget
        from asyncrl.plan.workload import model_spec
        from asyncrl.single_controller.memory import workers_on_node
        from objectstore.memory import node_memory_bytes

        on_gpu = torch.device(self.device).type == "cuda"
        device_bytes = (torch.cuda.get_device_properties(self.device).total_memory if on_gpu
                        else node_memory_bytes() / workers_on_node())
        budget, peak = fill_token_budget(self.cfg, model_spec(self.cfg.model.path), on_gpu, device_bytes)
        if self.rank == 0:
            log.info("actor.max_tokens_per_micro_batch=-1: %d tokens a micro-batch (the update's estimated peak "
                     "%.2f GiB of this worker's %.1f GiB)", budget, peak / GIB, device_bytes / GIB)
        self.cfg.actor.max_tokens_per_micro_batch = budget

    def _per_step_state(self, layout: ParallelLayout) -> None:
        """The random streams (sampling: one per data shard, so the ranks of a generation TP group
        draw alike; shuffling: one per dp rank, so the ranks of one TP group shuffle their shared
        rows alike), each step's start kept (trainer.failover), the kept rollouts (trainer.keep_rollouts)."""
        seed, tc = self.cfg.seed, self.cfg.trainer
        self.sample_gen = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.gen_layout.data_index(self.rank))
        self.shuffle_gen = torch.Generator().manual_seed(seed + layout.dp_rank(self.rank))
        self.failover = Failover(self)
        shards = math.prod(layout.size(d) for d in DATA_DIMS)  # one rank of each data shard keeps its rows
        first = all(c == 0 for d, c in layout.coords(self.rank).items() if d not in DATA_DIMS)
        self.kept = (RolloutKeeper(tc.output_dir, self.rank, shards, tc.keep_rollouts, self.tokenizer)
                     if tc.keep_rollouts and tc.mode == "train" and self.actor is not None and first else None)

    def _sync_specs(self, base: torch.nn.Module) -> tuple[torch.dtype, list[TensorSpec]]:
        """What a weight sync between pools carries, in order, in the generation copy's dtype
        (with LoRA only the adapters: the rollout side merges them into its base)."""
        dtype, lora = compute_dtype(self.device, self.cfg.model.dtype), self.cfg.actor.lora
        if lora.enabled:
            return dtype, [TensorSpec(name, shape, dtype)
                           for name, shape in adapter_shapes(base, lora.rank, lora.target_modules)]
        return dtype, [replace(s, dtype=dtype) for s in specs_of(base)]

    def _rollout_replica(self, base: torch.nn.Module, layout: ParallelLayout,
                         sync_specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """A rollout without an actor: a generation-only copy of the whole model; with LoRA
        merged into it, the adapted weights' base values."""
        cfg, lora = self.cfg, self.cfg.actor.lora
        if self.gen_layout.size("tp") > 1 or self.world_size > 1 and layout.size("tp") > 1:
            raise ValueError("a rollout without an actor holds a full replica: set rollout.parallel.tp=1 "
                             "and actor.parallel.tp=1, or host the actor in the same worker")
        self.rollout = rollout_engine(cfg.rollout.engine).build_engine(self, base, colocated=False)
        if lora.enabled and self.rollout.holds_own_weights and not self.rollout.lora_rank:
            raise ValueError("this model has no LoRA support in vLLM, and a split rollout pool cannot merge "
                             "adapters into vLLM's base: use rollout.engine=native or trainer.placement=colocated")
        if lora.enabled and not self.rollout.holds_own_weights:
            adapted = [spec.name.rsplit(".", 1)[0] for spec in sync_specs[::2]]  # each module's lora_A
            bound = cast(BoundRollout, self.rollout)
            return {m: bound.model.get_submodule(m).weight.detach().clone() for m in adapted}
        return {}

    def _hybrid_engine(self, base: torch.nn.Module, layout: ParallelLayout) -> None:
        """Actor and rollout in one process: the weightless generation model the reshard fills
        (`Resharder`), and the engine that generates with it (vLLM: its own copy, loaded from
        the reshard before the first generate)."""
        self.resharder: Any = None  # the engine's reshard (asyncrl.train.reshard, asyncrl.train.megatron.reshard)
        self.generation: GenerationModel | None = None
        self.rollout_current = False  # the vLLM engine holds the actor's current weights
        self.base_in_vllm = False  # LoRA adapters in vLLM: its frozen base came from the reshard
        if "rollout" not in self.roles or self.actor is None:
            return
        cfg = self.cfg
        self.gen_tp_group = self._generation_tp_group()
        ep = cfg.rollout.parallel.ep > 1  # each rank generates with the experts it trains (asyncrl.rollout.experts)
        self.generation = GenerationModel(base.config, self.actor.generation_buffers(), self.gen_tp_group,
                                          expert_group=self.actor.expert_group() if ep else None)
        self.resharder = self.actor.resharder(self.gen_layout, self.generation.model,
                                              compute_dtype(self.device, cfg.model.dtype), keep_experts=ep)
        self.rollout = rollout_engine(cfg.rollout.engine).build_engine(self, self.generation.model, colocated=True)

    def _pool_state(self, sync_dtype: torch.dtype, sync_specs: list[TensorSpec],
                    pristine: dict[str, torch.Tensor]) -> None:
        """trainer.placement=split: weights from the training pool (`PoolWeights`); a rollout-only
        worker's native engine serves every call from one continuous batch, which applies staged
        versions between its decode steps."""
        self.update_steps = 0
        self.pool = PoolWeights(self.cfg, self.rank, self.device, self.actor, self.rollout, sync_dtype,
                                sync_specs, pristine, lambda: self.update_steps)
        self.batcher: ContinuousBatcher | None = None
        if (self.rollout is not None and self.rollout.continuous_batching and self.actor is None
                and self.cfg.trainer.placement == "split"):
            from asyncrl.rollout.continuous import continuous_batcher

            self.batcher = continuous_batcher(self.rollout, decode_rows(self.cfg, self.rollout, self.gen_layout),
                                             self.pool)

    def _base_model(self, one_copy: bool) -> torch.nn.Module:
        """The model this worker starts from: an actor builds it on the meta device (rank 0 reads
        the checkpoint, every rank keeps its shards: one copy per node); a rollout-only replica
        holds the whole model in the compute dtype (vLLM reads the files itself: a skeleton for
        the shapes)."""
        path, dtype = self.cfg.model.path, compute_dtype(self.device, self.cfg.model.dtype)
        if one_copy:
            return skeleton(path, torch.float32)
        if rollout_engine(self.cfg.rollout.engine).reads_own_weights:
            return skeleton(path, dtype)
        return load_causal_lm(path, str(dtype).removeprefix("torch."))

    def _build_engines(self, base: torch.nn.Module, layout: ParallelLayout, *, one_copy: bool) -> None:
        """The actor's training engine and the reference policy's forward-only one over `layout`,
        built by `actor.backend`'s entry (asyncrl.engines)."""
        self.actor, self.ref = backend(self.cfg.actor.backend).build_actor(self, base, layout, one_copy)

    # rollout -----------------------------------------------------------------------------------
    def _generation_tp_group(self) -> torch.distributed.ProcessGroup | None:
        """Create every generation TP group (a collective) and return this rank's."""
        mine = None
        for ranks in self.gen_layout.groups(("tp",)):
            group = torch.distributed.new_group(sorted(ranks)) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = group
        return mine

    def _vllm_engine(self, model_config: Any, load_format: str) -> VLLMRolloutEngine:
        cfg, vc = self.cfg, self.cfg.rollout.vllm
        max_len = cfg.data.max_prompt_len + cfg.rollout.max_tokens
        on_cuda = torch.device(self.device).type == "cuda"
        kv_bytes = int(vc.kv_cache_gib * (1 << 30))
        if not kv_bytes and not on_cuda:  # room for max_num_seqs full-length rows
            kv_bytes = vc.max_num_seqs * max_len * kv_bytes_per_token(model_config, torch.float32)
        return VLLMRolloutEngine(
            cfg.model.path, eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            device=self.device, dtype="bfloat16" if on_cuda else "float32",
            seed=cfg.seed * 1000 + self.gen_layout.data_index(self.rank), max_model_len=max_len,
            max_num_seqs=vc.max_num_seqs, gpu_memory_utilization=vc.gpu_memory_utilization,
            kv_cache_bytes=kv_bytes or None, cuda_graphs=vc.cuda_graphs, load_format=load_format,
            enable_sleep_mode=vc.sleep, tp_size=self.gen_layout.size("tp"),
            lora_rank=cfg.actor.lora.rank if self._vllm_adapters() else 0,
            max_loras=cfg.rollout.max_staleness + 1)

    def _vllm_adapters(self) -> bool:
        """Whether vLLM serves the LoRA adapters (else merged weights): linear layers only."""
        lora = self.cfg.actor.lora
        if lora.adapts_embeddings and self.cfg.rollout.vllm.lora == "adapter":
            log.info("actor.lora adapts an embedding, which vLLM's adapters cannot: it generates with merged weights")
        return lora.enabled and self.cfg.rollout.vllm.lora == "adapter" and not lora.adapts_embeddings

    def _bind_generation_weights(self) -> None:
        """Reshard the training weights into this rank's generation shard (a collective over the
        group), unless the bound ones are still current; vLLM loads them into its own model."""
        if self.generation is None:
            return
        if self.rollout.holds_own_weights and self.rollout.lora_rank:
            if not self.rollout_current:  # the frozen base once, then each version's adapters
                if not self.base_in_vllm:
                    self.rollout.load_weights(self.resharder.reshard())
                    self.resharder.release()
                    self.base_in_vllm = True
                cast(OwnWeightsRollout, self.rollout).load_adapter(self.update_steps, self._full_adapters(),
                                                                   **adapter_settings(self.cfg, self.pool.sync_specs))
                self.rollout_current = True
        elif self.rollout.holds_own_weights:
            if not self.rollout_current:
                shards = self._merge_adapters(self.resharder.reshard())
                self.rollout.load_weights(shards if self.gen_layout.size("tp") == 1 else self._full_weights(shards))
                self.resharder.release()
                self.rollout_current = True
        elif not self.generation.bound:
            self.generation.bind(self._merge_adapters(self.resharder.reshard()))
        if self.cfg.actor.offload == "all":  # the rollout runs with the device to itself
            keep = list(self.generation.model.parameters()) if self.generation.bound else []
            for engine in (self.actor, self.ref):
                if engine is not None:
                    engine.weights_away(keep)

    def _merge_adapters(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """LoRA: each adapted weight's generation tensor as W0 + (alpha / rank) B A, computed in
        fp32 from the frozen base and cast once, as a new tensor (the base, which a single rank's
        reshard hands over without a copy, is never written). Gathers A and B (collectives)."""
        scales = adapter_scales(self.actor.model)
        if not scales:
            return shards
        state = self.actor.model.state_dict()
        for module, scale in scales.items():
            a, b = (full_tensor(state[f"{module}.lora_{x}"]) for x in "AB")
            key = f"{module}.weight"
            shards[key] = merged_weight(shards[key], a, b, scale, shards[key].dtype)
        return shards

    def _full_adapters(self) -> dict[str, torch.Tensor]:
        """The actor's LoRA A and B in full, by module name (a collective over the actor's ranks)."""
        state = self.actor.model.state_dict()
        return {plain_name(k): full_tensor(v) for k, v in state.items() if is_lora_param(k)}

    def _full_weights(self, shards: dict[str, torch.Tensor]):
        """Generation-TP shards, all-gathered one tensor at a time within the generation-TP
        group into the full tensors vLLM's loaders take (each rank's engine keeps its slice)."""
        ranks = len(self.gen_layout.group_of(self.rank, ("tp",)))
        for plan in self.resharder.plans:
            shard = shards[plan.name]
            if plan.tp_dim is None:
                yield plan.name, shard
                continue
            parts = [torch.empty_like(shard) for _ in range(ranks)]
            torch.distributed.all_gather(parts, shard.contiguous(), group=self.gen_tp_group)
            yield plan.name, torch.cat(parts, dim=plan.tp_dim)

    def _release_generation_weights(self) -> None:
        """Before training: drop the generation shards (the next generate reshards again), and
        bring the training weights back where the rollout ran without them (actor.offload=all)."""
        if self.generation is None:
            return
        if self.cfg.actor.offload == "all":
            for engine in (self.actor, self.ref):
                if engine is not None:
                    engine.weights_back()
        if self.rollout.holds_own_weights:
            self.rollout_current = False
            cast(OwnWeightsRollout, self.rollout).sleep()  # CUDA: weights and KV cache freed for training
        elif self.generation.bound:
            self.generation.unbind()
            self.resharder.release()
            release_host_memory()  # the full generation weights' pages back to the OS

    @register(THREE_D_ALL_MICRO_DP)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Sample responses for this rank's prompts; returns B*n rows with per-token log-probs.

        Prompts split over dp × micro-DP and are the same on every rank of a generation TP
        group; the outputs of generation-TP rank 0 are kept. prompts.meta may override
        sampling: n, temperature, top_p, top_k, max_tokens, greedy, seed.
        """
        # held-out prompts (`asyncrl.evaluation`) are their own phase: they decode in the same waves
        with memory_phase("evaluate" if prompts.meta.get("evaluation") else "generate", self.device):
            return self._generate(prompts)

    @register(THREE_D_ALL_MICRO_DP, blocking=False)
    def generate_stream(self, prompts: Batch) -> Batch:
        """`generate_sequences` on a rollout pool of its own, where calls overlap: every call's
        prompts join the worker's one continuous-batching decode loop."""
        if self.batcher is None:
            raise RuntimeError("generate_stream runs on a rollout-only worker with the native engine "
                               "(trainer.placement=split); call generate_sequences")
        return self._generate(prompts)

    def _generate(self, prompts: Batch) -> Batch:
        t0 = time.perf_counter()
        with trace.span("weight sync", "sync"):
            self._bind_generation_weights()
            if self.batcher is None:  # the batcher's loop loads staged weights itself, between steps
                self.pool.apply_staged()
        t1 = time.perf_counter()
        rc = self.cfg.rollout
        over = {k: v for k, v in prompts.meta.items() if k in SAMPLING_KEYS}
        params = SamplingParams(temperature=float(over.get("temperature", rc.temperature)),
                                top_p=float(over.get("top_p", rc.top_p)), top_k=int(over.get("top_k", rc.top_k)),
                                max_tokens=int(over.get("max_tokens", rc.max_tokens)), n=int(over.get("n", rc.n)),
                                greedy=bool(over.get("greedy", False)))
        seed = prompts.meta.get("seed")
        shard = self.gen_layout.data_index(self.rank)
        gen = (torch.Generator(device=self.rollout.device).manual_seed(int(seed) * 1000 + shard)
               if seed is not None else self.sample_gen)
        waves = 1
        experts = self.generation.experts if self.generation is not None else None
        with experts.phase() if experts is not None else contextlib.nullcontext():
            if self.agent is not None:
                out = self._generate_turns(prompts, params, gen)
            elif self.batcher is not None:
                out = self.batcher.generate(prompts["input_ids"], prompts["attention_mask"], params, generator=gen)
            else:
                images = {k: prompts[k] for k in IMAGE_INPUTS} if has_images(prompts) else None
                out, waves = self._generate_waves(prompts["input_ids"], prompts["attention_mask"], params, gen, images)
        out = _pad_responses(out, params.max_tokens, self.tokenizer.pad_token_id)
        out[ROW_TOKENS] = out["attention_mask"].sum(-1)  # what balance_tokens reads on the driver
        rest = prompts.select(*prompts.non_tensors, meta=True)
        rest = rest.repeat(params.n, interleave=True) if params.n > 1 else rest
        timing = {"timing/sync_s": t1 - t0, "timing/gen_s": time.perf_counter() - t1}
        if experts is not None:  # what this rank sent to the others' experts and back
            timing["perf/expert_exchange_mb"] = experts.stats.bytes_sent / 2**20
        return Batch(out, rest.non_tensors, {**prompts.meta, "n": params.n, "gen_waves": waves, **timing})

    def _generate_waves(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                        gen: torch.Generator, images: dict[str, torch.Tensor] | None = None
                        ) -> tuple[dict[str, torch.Tensor], int]:
        """The native engine decodes at most `decode_rows` rows at once (the KV cache and
        prefill it may hold): the prompts (and their images) in waves, the outputs joined (and
        how many waves)."""
        slots = decode_rows(self.cfg, self.rollout, self.gen_layout)
        per_wave = max(1, slots // params.n) if slots else len(ids)
        outs = [self._generate_wave(ids[i:i + per_wave], mask[i:i + per_wave], params, gen,
                                    None if images is None else {k: v[i:i + per_wave] for k, v in images.items()})
                for i in range(0, len(ids), per_wave)]
        if len(outs) == 1:
            return outs[0], 1
        outs = [_pad_responses(o, params.max_tokens, self.tokenizer.pad_token_id) for o in outs]
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}, len(outs)

    def _generate_wave(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                       gen: torch.Generator, images: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        versions = [self.pool.policy_version()]  # of token 0; one more per decode step

        def before_step(step: int) -> None:
            if self.cfg.rollout.interrupt_on_update:
                self.pool.apply_staged()
            versions.append(self.pool.policy_version())

        hook = {"before_step": before_step} if self.rollout.step_hooks else {}
        if self.cfg.actor.moe.router_replay == "rollout":  # the experts each token went to (R3)
            hook["record_routes"] = True
        if images is not None:
            hook["images"] = images
        out = self.rollout.generate(ids, mask, params, generator=gen, **hook)
        out["behav_versions"] = _token_versions(versions, out["responses"].shape, out["responses"].device)
        return out

    def _generate_turns(self, prompts: Batch, params: SamplingParams, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """`rollout.multi_turn`: n trajectories per prompt, each turn a request to the engine."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        plain = [[t for t, m in zip(r, mr, strict=True) if m] for r, mr in zip(ids.tolist(), mask.tolist(), strict=True)]
        rows = [{k: v[i] for k, v in prompts.non_tensors.items()} for i in range(len(plain))]
        turns = (BatcherGenerator(self.batcher, params, gen) if self.batcher is not None
                 else WaveGenerator(self.rollout, params, gen, version=self.pool.policy_version,
                                    lockstep=self.cfg.rollout.multi_turn.schedule == "lockstep",
                                    max_rows=decode_rows(self.cfg, self.rollout, self.gen_layout)))
        own = isinstance(self.agent, ApiRollout)  # an API agent's prompt is what its first call sent
        # each trajectory's turns sample from streams of its own, seeded from `gen` (one draw a call)
        seeded = {} if own else {"seed": int(torch.randint(2**62, (1,), generator=gen, device=gen.device))}
        if has_images(prompts):  # each prompt's own (patches, grids), as the data read them
            seeded["images"] = row_images({k: prompts[k].cpu() for k in IMAGE_INPUTS})
        # the native engine's waves of decodes (same weights) pack its linears once (compiled, CPU)
        keeping_packs = getattr(self.rollout, "keeping_packs", contextlib.nullcontext)
        with keeping_packs():
            trajs = self.agent.rollout(plain, rows, params.n, turns, params.max_tokens, **seeded)
        out = trajectories_to_tensors(trajs, None if own else ids.cpu(), None if own else mask.cpu(),
                                      params.max_tokens, self.tokenizer.pad_token_id, prompt_width=ids.shape[1])
        out = {k: v.to(ids.device) for k, v in out.items()}
        if has_images(out):  # every token's 3-D positions over the whole trajectory, as each turn had them
            out[ROPE] = rope_positions(self.rollout.model, out["input_ids"], out["attention_mask"],
                                       flat_images(out)[1])
        return out

    # log-probs -------------------------------------------------------------------------------------
    def _log_probs(self, engine: TrainEngine, batch: Batch, with_entropy: bool, replay: str | None = None,
                   routes: list[torch.Tensor] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (and entropies); (None, None) on a pipeline stage other than the last.
        A mixture-of-experts model replays the batch's column `replay` (if any) and, given a list
        `routes`, appends each micro-batch's routing to it (then micro-batches keep every column)."""
        ac, temp = self.cfg.actor, sampling_temperature(batch, self.cfg.rollout.temperature)
        self._release_generation_weights()  # this step's generations are done: free their memory
        engine.model.eval()
        # by tokens never with pipeline stages (the config checks it)
        by_tokens = 0 if routes is not None else ac.log_prob_max_tokens_per_micro_batch
        mbs, join = row_micro_batches(batch, ac.log_prob_micro_batch_size, by_tokens, is_packing(engine.model))

        def forward(model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
            pk, view = packed_view(model, mb)
            tap = routing.start(model, view, ac.moe, replay=replay)
            out = response_forward(model, mb, temp, with_entropy, packed=pk)
            if tap is not None:
                if routes is not None:
                    chosen = tap.chosen(used=True)
                    routes.append(pk.unpack(chosen, fill=NOT_RECORDED) if pk is not None
                                  else chosen.reshape(*mb["input_ids"].shape, tap.layers, tap.top_k))
                tap.stop()
            return out

        outs = forward_only(engine, mbs, forward)
        if outs is None:  # not the last pipeline stage
            return None, None
        if not outs:
            return torch.zeros(0, device=engine.device), None
        logps, ents = [lp for lp, _ in outs], [ent for _, ent in outs]
        return join(logps), (join(ents) if with_entropy else None)

    @register(DP_PROTO, blocking=False)  # beside queued calls that wait for these very rows
    def hold_rows(self, batch: Batch) -> Batch:
        """These rows, now in this rank's store: an elastic rollout worker's output outlives it."""
        return batch

    @register(THREE_D_PROTO)
    @timed("old_log_prob")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Current policy log-probs of the responses (`old_log_probs`) and their entropy; with
        actor.moe.router_replay=old_policy also the experts each token went to (`old_routed_experts`)."""
        mode = self.cfg.actor.moe.router_replay
        routes: list[torch.Tensor] | None = [] if mode == "old_policy" else None
        logp, ent = self._log_probs(self.actor, batch, with_entropy=True,
                                    replay=ROUTES if mode == "rollout" else None, routes=routes)
        if logp is None:
            return None
        out = {"old_log_probs": logp, "entropy": ent}
        if routes:
            out[OLD_ROUTES] = torch.cat(routes).to(route_dtype(routing.tap_for(self.actor.model).num_experts))
        return Batch(out)

    @register(THREE_D_PROTO)
    @timed("ref_log_prob")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.ref is None and self.cfg.actor.lora.enabled:  # LoRA: the base is the reference
            with adapters_disabled(self.actor.model):
                logp, _ = self._log_probs(self.actor, batch, with_entropy=False)
        else:
            logp, _ = self._log_probs(self.ref, batch, with_entropy=False)
        return Batch({"ref_log_prob": logp}) if logp is not None else None

    # training ------------------------------------------------------------------------------------
    @register(THREE_D_PROTO)
    @timed("update_actor")
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO-clip update over `ppo_epochs` × mini-batches; returns metrics averaged over updates.
        With trainer.replay.window > 0 the update's rows, random states and result are kept
        (asyncrl.roles.replay)."""
        rp, version = self.cfg.trainer.replay, self.update_steps
        step = int(batch.meta.get("step", version + 1))
        seen = None if self.kept is None or "old_log_probs" in batch else []  # on-policy: the update's own pass
        if not rp.window or self.cfg.trainer.mode != "train":
            out = policy_update(self, batch, seen=seen)
        else:
            t0 = time.perf_counter()
            bundle = replay.capture(batch, step, rng_state(), self.shuffle_gen.get_state(), version)
            t1 = time.perf_counter()
            out = policy_update(self, batch, seen=seen)
            t2 = time.perf_counter()
            bundle["result"] = {"metrics": dict(out), "weights": replay.weights_digest(self.actor.model)}
            replay.write(self.cfg.trainer.output_dir, bundle, self.rank, rp.window, rp.max_mb)
            out["perf/replay_bundle_s"] = time.perf_counter() - t2 + t1 - t0  # what keeping the step cost here
        if self.kept is not None:  # trainer.keep_rollouts (asyncrl.roles.kept_rollouts)
            t0 = time.perf_counter()
            self.kept.add(batch, step, version, trainer_log_probs=seen_log_probs(seen, batch))
            out["perf/keep_rollouts_s"] = time.perf_counter() - t0
        return out

    @register(ONE_TO_ALL)
    def replay_update(self, step: int, last: bool) -> dict[str, Any]:
        """Re-run step `step`'s update from this rank's bundle (trainer.mode=replay): its metrics and
        weights digest beside the run's; on the `last` step the checks trainer.replay asks for
        (old log-probs recomputed, the first non-finite activation)."""
        rp = self.cfg.trainer.replay
        bundle = replay.read(self.cfg.trainer.output_dir, step, self.rank)
        batch = replay.batch_of(bundle, self.device)
        set_rng_state(bundle["rng"])
        self.shuffle_gen.set_state(bundle["shuffle_gen"])
        self.update_steps = bundle["update_steps"]
        found: dict[str, Any] = {}
        if last and rp.log_probs:  # None: the run computed none (one on-policy update uses its own pass)
            old = self._log_probs(self.actor, batch, with_entropy=False)[0] if "old_log_probs" in batch else None
            found["old_log_probs_equal"] = None if old is None else bool(torch.equal(old, batch["old_log_probs"]))
        watch = replay.NonFiniteWatch(self.actor.model, rp.plant_nan) if last and rp.nonfinite else None
        try:
            out = policy_update(self, batch, watch)
        finally:
            if watch is not None:
                watch.close()
        if watch is not None:
            found["nonfinite"] = None if watch.first is None else vars(watch.first)
        return {"metrics": out, "weights": replay.weights_digest(self.actor.model), "recorded": bundle["result"],
                **found}

    @register(THREE_D_PROTO)
    @timed("update_pretrain")
    def update_pretrain(self, batch: Batch) -> dict[str, float]:
        """One SFT step on response tokens, its loss scaled by actor.pretrain_coef (Safe-RLHF's ptx)."""
        self.pool.wait_pushed()
        coef, rows = self.cfg.actor.pretrain_coef, len(batch)

        def loss_fn(model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, dict]:
            logp, _ = response_forward(model, mb)
            nll = -core.masked_mean(logp, mb["response_mask"].float())
            return coef * nll * (len(mb) / rows), {"actor/pretrain_loss": nll.detach()}

        self._release_generation_weights()
        mbs = micro_batches(batch, self.cfg.actor.micro_batch_size)
        out = self.actor.train_step(*turn_loss(self.actor.model, mbs, loss_fn))
        return {"actor/pretrain_loss": out["actor/pretrain_loss"]}

    @register(ONE_TO_ALL)
    def held_models(self) -> dict[str, Any]:
        """What this worker holds: which engines exist, and the actor's trainable and total
        parameters on this rank and its device (with LoRA: only the adapters train, and no reference model; the
        norm of each module's B shard here)."""
        named = list(self.actor.model.named_parameters()) if self.actor is not None else []
        local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]  # this rank's shards
        return {"actor": self.actor is not None, "ref": self.ref is not None, "rollout": self.rollout is not None,
                "device": str(self.device), "trainable_params": sum(t.numel() for t, (_, p) in zip(local, named, strict=True) if p.requires_grad),
                "params": sum(t.numel() for t in local),
                "lora_b_norms": {plain_name(n): float(t.norm()) for t, (n, _) in zip(local, named, strict=True)
                                 if n.endswith("lora_B")},
                "vllm_adapters": [a.lora_name for a in getattr(self.rollout, "adapters", [])]}

    # checkpoints -----------------------------------------------------------------------------------
    @register(ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        if self.kept is not None:  # the kept rollouts so far: on disk with the checkpoint
            self.kept.flush()
        extra = {**(extra or {}), "rng": rng_state(), "update_steps": self.update_steps,
                 "shuffle_gen": self.shuffle_gen.get_state(), "sample_gen": self.sample_gen.get_state()}
        self._release_generation_weights()  # the generation copy is not saved: its memory goes first
        with memory_phase("save", self.device):
            self.actor.save_checkpoint(Path(path) / "actor", extra, tokenizer=self.tokenizer,
                                       export_dtype=compute_dtype(self.device, self.cfg.model.dtype),
                                       asynchronous=self.cfg.trainer.async_save)
        return str(Path(path) / "actor" / "hf")

    @register(ONE_TO_ALL)
    def checkpoint_pending(self) -> bool:
        """Whether an asynchronous save is still writing its sharded state (no wait)."""
        return self.actor.checkpoint_pending()

    @register(ONE_TO_ALL)
    def finish_checkpoint(self) -> float:
        """Wait for an asynchronous save's write (trainer.async_save); the seconds waited."""
        return self.actor.finish_checkpoint()

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        self.pool.wait_pushed()
        self._release_generation_weights()
        extra = self.actor.load_checkpoint(Path(path) / "actor") or {}
        if "rng" in extra:
            set_rng_state(extra["rng"])
        if "shuffle_gen" in extra:
            self.shuffle_gen.set_state(extra["shuffle_gen"])
        if "sample_gen" in extra:
            self.sample_gen.set_state(extra["sample_gen"])
        self.update_steps = int(extra.get("update_steps", 0))
        return {k: v for k, v in extra.items() if k not in ("rng", "shuffle_gen", "sample_gen")}


SEEN_ROW = "kept_rollouts_row"  # an on-policy update's row numbers, for the kept rollouts' trainer log-probs


def policy_update(worker: ActorRolloutRefWorker, batch: Batch, watch: replay.NonFiniteWatch | None = None,
                  seen: list | None = None) -> dict[str, float]:
    """The actor worker's PPO-clip update of `batch` (`update_actor`, a replay's re-run with `watch`);
    an on-policy update appends each micro-batch's rows and log-probs to `seen` (the kept rollouts')."""
    worker.pool.wait_pushed()
    if seen is not None:
        batch = batch.union(Batch({SEEN_ROW: torch.arange(len(batch))}))
    ac = worker.cfg.actor
    temp = sampling_temperature(batch, worker.cfg.rollout.temperature)
    norm_len = worker.cfg.rollout.max_tokens  # Dr.GRPO's length normaliser must be a constant
    use_kl_loss = ac.use_kl_loss and "ref_log_prob" in batch
    _check_behaviour_columns(ac, batch)

    replayed = routing.REPLAYED.get(ac.moe.router_replay)

    def loss_fn(model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, dict]:
        if watch is not None:
            watch.next_micro_batch()
        pk, view = packed_view(model, mb)
        tap = routing.start(model, view, ac.moe, replay=replayed, losses=True)  # in force through the backward
        logp, ent = response_forward(model, mb, temp, with_entropy=True, packed=pk)  # logged for every algorithm
        mask = mb["response_mask"].float()
        # without recomputed old log-probs the update is on-policy (one epoch, one
        # mini-batch): the ratio is 1 and the gradient that of the clipped objective
        old = mb["old_log_probs"] if "old_log_probs" in mb else logp.detach()
        if seen is not None and logp.shape[0] == len(mb):  # the policy that sampled: no step taken yet
            seen.append((mb[SEEN_ROW], old))
        loss, m, rollout_m = policy_loss(ac, old, logp, mb, mask, norm_len, worker.shuffle_gen)
        metrics = {"actor/pg_loss": loss.detach(), **{f"actor/{k}": v for k, v in m.items()},
                   **{f"rollout/{k}": v for k, v in rollout_m.items()}}
        if ent is not None:
            if ac.entropy_coeff == 0:
                ent = ent.detach()  # a metric only: no graph kept for it
            e = core.agg_loss(ent, mask, ac.loss_agg_mode)
            if ac.entropy_coeff != 0:
                loss = loss - ac.entropy_coeff * e
            metrics["actor/entropy"] = e.detach()
        if use_kl_loss:
            kl = core.kl_loss(logp, mb["ref_log_prob"], mask, ac.kl_loss_type, ac.loss_agg_mode)
            loss = loss + ac.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        if tap is not None:
            router_loss, moe_metrics = routing.router_terms(tap, view, ac.moe)
            loss = loss + router_loss
            metrics.update(moe_metrics)
        return loss, metrics

    worker._release_generation_weights()
    try:
        out = ppo_update(worker.actor, batch, ac, loss_fn, worker.shuffle_gen)
    finally:
        if (tap := routing.tap_for(worker.actor.model)) is not None:
            tap.stop()
    release_host_memory()  # the update's transient pages back to the OS before generation
    worker.update_steps += 1
    out["actor/lr"] = out.pop("lr", 0.0)
    out["actor/grad_norm"] = out.pop("grad_norm", 0.0)
    return out


def seen_log_probs(seen: list | None, batch: Batch) -> torch.Tensor | None:
    """The on-policy update's log-probs of `batch`'s responses, row by row (NaN where none was seen)."""
    if not seen:
        return None
    out = torch.full(batch["responses"].shape, float("nan"))
    for rows, logp in seen:
        out[rows, :logp.shape[1]] = logp.float().cpu()
    return out


def native_rollout(worker: ActorRolloutRefWorker, model: torch.nn.Module, colocated: bool) -> RolloutEngine:
    """rollout.engine=native: decodes with `model` itself (colocated: the weights the reshard fills)."""
    from asyncrl.rollout.engine import RolloutEngine

    tok = worker.tokenizer
    return RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, device=worker.device,
                         decode=worker.cfg.rollout.decode)


def vllm_rollout(worker: ActorRolloutRefWorker, model: torch.nn.Module, colocated: bool) -> VLLMRolloutEngine:
    """rollout.engine=vllm: its own copy of the weights (colocated: loaded from the reshard before
    the first generate; a rollout pool's: read from the checkpoint)."""
    return worker._vllm_engine(model.config, load_format="dummy" if colocated else "auto")


def fsdp_engines(worker: ActorRolloutRefWorker, base: torch.nn.Module, layout: ParallelLayout, one_copy: bool
                 ) -> tuple[TrainEngine | None, TrainEngine | None]:
    """The actor's training engine and the reference policy's forward-only one over `layout`;
    with `one_copy`, `base` is a meta skeleton filled from rank 0's read of the checkpoint and
    the reference is copied from the actor's shards."""
    cfg, roles, device = worker.cfg, worker.roles, worker.device
    actor = ref_engine = None
    mp = mixed_precision_policy(device, dtype=cfg.model.dtype)
    engine_cls = FSDPEngine
    if layout.size("pp") > 1:
        engine_cls = PipelineEngine
        if _tied(base):
            log.warning("actor.parallel.pp=%d: the model ties its input and output embeddings, which "
                        "live on different pipeline stages; they now train as two weights (the "
                        "checkpoint's config says tie_word_embeddings=false)", layout.size("pp"))
            untie_embeddings(base)
    ref_dtype = compute_dtype(device, cfg.model.dtype)  # forward only: no master copy
    if "ref" in roles and not one_copy:
        ref = copy.deepcopy(base).to(ref_dtype)
        ref_engine = engine_cls(parallelize(ref, layout, mp), layout, optim=None, device=device)
    lora = cfg.actor.lora
    if "actor" in roles:
        if lora.enabled:  # adapters before FSDP wraps the layers; everything else frozen
            apply_lora(base, lora.rank, lora.alpha, lora.dropout, lora.target_modules, freeze_a=lora.freeze_a)
        if cfg.actor.moe.freeze_router:
            for router in routers(base):
                router.weight.requires_grad_(False)
        if cfg.actor.freeze_vision:  # a text model is refused before any worker starts (asyncrl.preflight)
            freeze_vision(base, cfg.model.path)
        if cfg.actor.gradient_checkpointing:  # the reference policy only runs forward
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = parallelize(base, layout, mp)
        if one_copy:
            materialize(model, device)
        actor = engine_cls(model, layout, optim=cfg.actor.optim, device=device, offload=cfg.actor.offload)
        if lora.enabled:
            actor.lora = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                          "targets": lora.target_modules, "base_model": cfg.model.path}
        # pipeline stages: each rank holds its stage only, so tensors stream from rank 0; a pool
        # re-formed after a rank died reads nothing: the kept states fill it (asyncrl.roles.failover)
        if one_copy and not rebuilding(worker):
            if layout.size("pp") > 1:
                load_streamed(actor, cfg.model.path)
            else:  # the adapters are new: drawn on rank 0 (B = 0: the model starts as the base)
                load_sharded(actor, cfg.model.path, fresh=fresh_adapter if lora.enabled else None)
    if lora.enabled:  # the reference policy is the actor with its adapters switched off
        return actor, ref_engine
    if "ref" in roles and one_copy:  # the actor's shards, in the compute dtype
        ref = skeleton(cfg.model.path, ref_dtype)
        if layout.size("pp") > 1 and _tied(ref):
            untie_embeddings(ref)
        ref = parallelize(ref, layout, mp)
        materialize(ref, device)
        copy_shards(actor.model, ref)
        ref_engine = engine_cls(ref, layout, optim=None, device=device, offload=cfg.actor.offload)
    return actor, ref_engine


def megatron_engines(worker: ActorRolloutRefWorker, base: torch.nn.Module, layout: ParallelLayout, one_copy: bool
                     ) -> tuple[TrainEngine | None, TrainEngine | None]:
    """actor.backend=megatron: the actor and the reference policy as megatron-core GPTModels,
    each rank reading its TP shards of the checkpoint (`base` unused)."""
    cfg, roles, device = worker.cfg, worker.roles, worker.device
    from asyncrl.train.megatron import require_megatron

    require_megatron()
    from asyncrl.train.megatron.engine import MegatronEngine

    dtype = compute_dtype(device, cfg.model.dtype)
    moe = cfg.actor.moe
    common = {"device": device, "dtype": dtype, "seed": cfg.seed, "ep": moe.ep}
    actor = (MegatronEngine(cfg.model.path, layout, optim=cfg.actor.optim, recompute=cfg.actor.gradient_checkpointing,
                            aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef,
                            router_replay=moe.router_replay != "none", offload=cfg.actor.offload, **common)
             if "actor" in roles else None)
    ref = MegatronEngine(cfg.model.path, layout, optim=None, **common) if "ref" in roles else None
    return actor, ref


def decode_rows(cfg: RLConfig, rollout: Rollout | None, gen_layout: ParallelLayout) -> int:
    """rollout.decode_slots, or (0) a training batch's rows on this generation rank: a larger
    call (held-out prompts) decodes in waves of that many, so its memory does not grow with
    the call (the budget `asyncrl.plan.memory` prices), and a rollout-only worker's continuous
    batch has that many slots; 0 with vLLM, which sizes itself."""
    if rollout is None or rollout.sizes_own_batches:
        return 0
    rc = cfg.rollout
    return rc.decode_slots or -(-cfg.data.batch_size // gen_layout.data_shards()) * rc.n


def _agent_rollout(cfg: Any, tokenizer: Any, model_config: Any) -> MultiTurnRollout | ApiRollout:
    """`rollout.multi_turn`'s driver: the built-in loop over an `Environment`, or an agent that
    calls the policy over the OpenAI API (`agent:` / `verifiers:` specs)."""
    mt = cfg.rollout.multi_turn
    if not is_api_agent(mt.env):  # a vision-language policy reads the images observations bring
        return MultiTurnRollout(mt, tokenizer, ImageReader.of_model(cfg.model.path, cfg.data.min_pixels,
                                                                    cfg.data.max_pixels))
    positions = getattr(model_config, "max_position_embeddings", None)
    return ApiRollout(mt.env, mt.env_kwargs, tokenizer, model_name=Path(cfg.model.path).name or "policy",
                      concurrency=mt.concurrency, timeout_s=mt.step_timeout_s * mt.max_turns, context_length=positions)


def _check_behaviour_columns(ac: ActorConfig, batch: Batch) -> None:
    if is_behaviour_loss(ac.policy_loss) and not ("rollout_log_probs" in batch and "old_log_probs" in batch):
        raise ValueError(f"actor.policy_loss={ac.policy_loss} needs the behaviour policy's log-probs "
                         "(rollout_log_probs, from generate_sequences) and the current policy's "
                         "(old_log_probs, from compute_log_prob) in the batch; an algorithm that builds "
                         "its own batch must keep both, or set actor.policy_loss=ppo")
    if ac.rollout_correction.mode != "none" and "rollout_log_probs" not in batch:
        raise ValueError(f"actor.rollout_correction.mode={ac.rollout_correction.mode} needs the rollout engine's "
                         "log-probs (rollout_log_probs, from generate_sequences) in the batch; an algorithm that "
                         "builds its own batch must keep them, or set actor.rollout_correction.mode=none")


def policy_loss(ac: ActorConfig, old: torch.Tensor, logp: torch.Tensor, mb: Batch, mask: torch.Tensor,
                norm_len: int, gen: torch.Generator) -> tuple[torch.Tensor, dict, dict]:
    """The micro-batch's policy loss as `actor.policy_loss` and `actor.rollout_correction` say; its
    metrics, and the rollout engine's mismatch with the trainer (wherever its log-probs came along)."""
    adv, rollout = mb["advantages"], mb["rollout_log_probs"] if "rollout_log_probs" in mb else None
    rollout_m = core.mismatch_metrics(old, rollout, mask) if rollout is not None else {}
    chosen = policy_losses()[ac.policy_loss]
    if chosen.behaviour:  # the asynchronous runs' losses weigh by pi_old / pi_rollout themselves
        loss, m = chosen.fn(ac, old, logp, rollout, adv, mask, norm_len)
        return loss, m, rollout_m
    losses, m = chosen.fn(ac, old, logp, adv, mask, gen)
    keep = mask
    if ac.rollout_correction.mode != "none":
        weight, keep, corr = core.rollout_correction(old, rollout, mask, ac.rollout_correction.mode,
                                                     *ac.rollout_correction.resolved())
        losses = losses * weight
        keep = keep.to(mask.dtype)
        rollout_m.update({f"correction_{k}": v for k, v in corr.items()})
    return core.agg_loss(losses, keep, ac.loss_agg_mode, norm_len), m, rollout_m


def _tied(model: torch.nn.Module) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def _token_versions(versions: list[int], shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The policy version that produced each response token [rows, T] on the responses' device,
    from the version of token 0 followed by one per decode step."""
    steps = torch.tensor(versions[:shape[1]], dtype=torch.long, device=device)
    return steps.expand(shape[0], -1).clone()


def pack_engines(cfg: RLConfig, engines: list[TrainEngine], layout: ParallelLayout, training: bool) -> None:
    """Packed micro-batches (`actor.pack_sequences`) for the actor and the reference policy, and
    Ulysses sequence parallelism over them (`actor.parallel.sp`, a collective)."""
    for engine in engines:
        resolve_packing(engine.model, cfg.actor.pack_sequences, "actor.", pipelined=engine.pipelined)
    if cfg.actor.parallel.sp > 1 and training:
        for engine in engines:  # Ulysses splits packed rows: every micro-batch packs
            setattr(engine.model, AUTO_ATTR, False)
        sequence_parallel(layout, cfg.actor.parallel.sp, [e.model for e in engines], "actor.")


def _pad_responses(out: dict[str, torch.Tensor], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the response columns to the generation budget, so every rank's output has the
    same width and rows from different ranks concatenate (masked, so nothing else changes)."""
    extra = width - out["responses"].shape[1]
    if extra <= 0:
        return out
    rows = out["responses"].shape[0]

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([t, t.new_full((rows, extra, *t.shape[2:]), value)], dim=1)

    out = dict(out)
    out["responses"] = pad(out["responses"], pad_id)
    out["response_mask"] = pad(out["response_mask"], 0)
    out["rollout_log_probs"] = pad(out["rollout_log_probs"], 0.0)
    if ROUTES in out:  # nothing recorded for the padding
        out[ROUTES] = pad(out[ROUTES], NOT_RECORDED)
    if "behav_versions" in out:
        out["behav_versions"] = pad(out["behav_versions"], 0)
    out["input_ids"] = pad(out["input_ids"], pad_id)
    out["attention_mask"] = pad(out["attention_mask"], 0)
    out["position_ids"] = pad(out["position_ids"], 0) + 0
    last = out["position_ids"][:, -extra - 1:-extra]
    steps = torch.arange(1, extra + 1, dtype=last.dtype, device=last.device)
    out["position_ids"][:, -extra:] = last + steps  # keep positions increasing
    if ROPE in out:  # 3-D positions of image prompts: text goes on alike in all three
        rope = out[ROPE]
        out[ROPE] = torch.cat([rope, rope[:, :, -1:] + steps], dim=2)
    return out
