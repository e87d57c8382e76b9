"""The cost model: time and memory per device of each model function call under a parallel
strategy, and of moving weights between the layouts (HybridFlow §6's simulators, REAL §5's
estimator). Pure arithmetic on a `DeviceProfile`, microseconds per call, so a search can price
millions of plans.

Conventions: FLOPs of a forward pass are 2·params per token plus attention; training is 3× a
forward; weights move at the profile's `bytes_per_param`; collectives are ring collectives,
inside a node unless the group spans nodes. Memory is `asyncrl.plan.memory`'s terms (the
preflight's and `asyncrl-plan`'s breakdown: one model of it), priced with the config's `Knobs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from asyncrl.plan.hardware import DeviceProfile
from asyncrl.plan.memory import (
    ADAM,
    MEGATRON_ADAM,
    Knobs,
    actor_trained,
    forward_only_weights,
    forward_pass,
    generation,
    generation_params,
    megatron_held,
    megatron_state,
    training_state,
    update_pass,
)
from asyncrl.plan.workload import Call, ModelSpec, Workload

TRAIN_STATE_BYTES = 16  # per parameter: fp32 master, gradients, exp_avg, exp_avg_sq (the optimizer's traffic)
INFEASIBLE = math.inf


@dataclass(frozen=True)
class Strategy:
    """How one model runs on its devices: data, tensor and pipeline parallel sizes and rows
    per micro-batch; `gen_tp` is the generation engine's tensor-parallel size (actor only)."""

    dp: int
    tp: int
    pp: int = 1
    micro_batch: int = 1
    gen_tp: int = 1
    sp: int = 1  # Ulysses: groups of sp dp ranks share each micro-batch's tokens
    offload: bool = False  # actor.offload=optimizer: AdamW's state in host memory between its steps
    offload_weights: bool = False  # actor.offload=all: besides, the weights in host memory while the rollout runs
    ep: int = 1  # megatron's expert parallelism (actor.moe.ep): a mixture's experts split over ep of the dp ranks
    gen_ep: int = 1  # expert-parallel generation (rollout.parallel.ep): each rank keeps the experts it trains
    recompute: bool = False  # actor.gradient_checkpointing: each layer's activations recomputed in the backward

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        text = f"dp{self.dp}·tp{self.tp}·pp{self.pp}" + (f"·sp{self.sp}" if self.sp > 1 else "") + f" mb{self.micro_batch}"
        text += f" gen-tp{self.gen_tp}" if self.gen_tp > 1 else ""
        text += f" gen-ep{self.gen_ep}" if self.gen_ep > 1 else ""
        text += " recompute" if self.recompute else ""
        return text + (f" ep{self.ep}" if self.ep > 1 else "") + (" offload" if self.offload else "") + (
            "-all" if self.offload_weights else "")


@dataclass(frozen=True)
class Mesh:
    """A set of devices laid out node-major: `devices` in a row starting on a node boundary."""

    devices: int
    per_node: int

    def spans(self, group: int, stride: int = 1) -> bool:
        """Whether a group of `group` ranks `stride` apart crosses a node boundary."""
        return group > 1 and group * stride > self.per_node


def _ring(profile: DeviceProfile, nbytes: float, group: int, across: bool, factor: float = 2.0,
          tp: bool = False) -> float:
    """A ring collective over `group` ranks: all-reduce (factor 2) or all-gather/reduce-scatter (1);
    `tp`: a tensor-parallel all-reduce inside a layer."""
    if group <= 1:
        return 0.0
    bw, latency = profile.tp_bandwidth(across) if tp else profile.bandwidth(across)
    return latency * (group - 1) + factor * (group - 1) / group * nbytes / bw


def _compute(profile: DeviceProfile, flops: float, tokens: float, efficiency: float) -> float:
    """Seconds for `flops` done in calls of `tokens` tokens each."""
    scale = efficiency * tokens / (tokens + profile.half_efficiency_tokens)
    return flops / (profile.peak_flops * scale)


def _flops_per_token(model: ModelSpec, context: float) -> float:
    """Forward FLOPs per token: the matmuls (2 per weight a token uses: a mixture of experts' active
    ones) and causal attention over `context`."""
    return 2.0 * model.active_params + 2.0 * model.layers * model.hidden * context


@dataclass(frozen=True)
class CallCost:
    time_s: float
    memory_bytes: float  # transient, on top of the model's resident state
    decode_rows: int = 0  # generation: the native engine's rows at once where all would not fit (rollout.decode_slots)


def resident_bytes(model: ModelSpec, s: Strategy, trained: bool, knobs: Knobs, unit: str = "") -> float:
    """What a model keeps on each device between calls: training state, or sharded weights (with
    LoRA the actor, or the critic, trains its adapters only; the actor's reference is its base: no copy)."""
    shards = s.tp * s.pp * s.dp
    if knobs.lora_params and unit == "ref":
        return 0.0
    if knobs.megatron and unit in ("actor", "ref"):  # whole TP x PP shards, a mixture's experts over ep
        if trained:
            state = megatron_state(model, s.tp * s.pp, s.dp, knobs.compute_bytes, s.ep)
            return sum(state.values()) - (state[MEGATRON_ADAM] if s.offload else 0.0)
        return knobs.compute_bytes * megatron_held(model, s.tp * s.pp, s.ep)
    if trained:
        trains = actor_trained(model, knobs) if unit == "actor" else (unit == "critic" and knobs.critic_lora_params) or None
        state = training_state(model, shards, trains)
        return sum(state.values()) - (state[ADAM] if s.offload else 0.0)
    return forward_only_weights(model, shards, knobs)


def offloaded_bytes(model: ModelSpec, s: Strategy, knobs: Knobs) -> float:
    """The actor's optimizer state a device holds only while it steps (Strategy.offload)."""
    if not s.offload:
        return 0.0
    if knobs.megatron:
        return megatron_state(model, s.tp * s.pp, s.dp, knobs.compute_bytes, s.ep)[MEGATRON_ADAM]
    return training_state(model, s.tp * s.pp * s.dp, actor_trained(model, knobs))[ADAM]


def forward_backward(model: ModelSpec, s: Strategy, w: Workload, call: Call, mesh: Mesh,
                     profile: DeviceProfile, knobs: Knobs | None = None) -> CallCost:
    """A training call (`call.kind == "train"`) or a forward-only one (`"infer"`) over the batch."""
    train = call.kind == "train"
    recompute = train and (s.recompute or (knobs is not None and knobs.gradient_checkpointing))
    passes = (4.0 if recompute else 3.0) if train else 1.0  # backward costs two forwards (and the recomputed one)
    efficiency = profile.train_efficiency if train else profile.infer_efficiency
    steps = call.optimizer_steps if train else 1
    epochs = call.epochs if train else 1
    rows_per_step = math.ceil(w.sequences * epochs / (s.dp * steps))
    micro = max(1, math.ceil(rows_per_step / s.micro_batch))
    rows = min(s.micro_batch, rows_per_step)
    tokens = rows * w.seq_len
    flops = passes * _flops_per_token(model, w.seq_len / 2) * tokens / (s.tp * s.pp)
    stage = (_compute(profile, flops, tokens, efficiency) + passes * model.layers / s.pp * profile.layer_overhead_s
             + profile.micro_batch_overhead_s)
    act = tokens * model.hidden * profile.bytes_per_param
    tp_group_spans = mesh.spans(s.tp)
    stage += (2 * passes / 1.5 if train else 2) * model.layers / s.pp * _ring(profile, act, s.tp, tp_group_spans, tp=True)
    if s.pp > 1:
        bw, latency = profile.bandwidth(mesh.spans(s.pp, s.tp))
        stage += (2 if train else 1) * (latency + act / bw)
    if s.ep > 1:  # each MoE layer and pass: tokens to their experts' ranks and back (two all-to-alls)
        bw, latency = profile.bandwidth(mesh.spans(s.ep, s.tp * s.pp))
        sent = act / s.tp * model.experts_per_token * (s.ep - 1) / s.ep
        stage += passes * model.layers / s.pp * 2 * (latency + sent / bw)
    if s.sp > 1:  # Ulysses: per layer and pass, q/k/v out and attention back, each (sp-1)/sp of a slice
        bw, latency = profile.bandwidth(mesh.spans(s.sp, s.tp * s.pp))
        stage += passes * model.layers / s.pp * 4 * (latency + (s.sp - 1) / s.sp * act / s.tp / bw)
    # FSDP (asyncrl's engine reshards after forward and syncs gradients every micro-batch): each
    # micro-batch gathers every block's parameters for forward (and again for backward) and
    # reduce-scatters its gradients; the bytes are prefetched and overlap the compute, the
    # per-collective latency does not
    if s.dp > 1:
        shard = model.params * profile.bytes_per_param / (s.tp * s.pp)
        bw, latency = profile.bandwidth(mesh.spans(s.dp, s.tp * s.pp))
        kinds = 3 if train else 1
        stage = max(stage, kinds * (s.dp - 1) / s.dp * shard / bw)
        stage += kinds * (model.layers / s.pp + 1) * latency * (s.dp - 1)
    per_step = (micro + s.pp - 1) * stage  # 1F1B: the pipeline fills and drains once per step
    if train:  # the optimizer reads and writes the state shard (an offloaded one: to the device and back first)
        per_step += 2 * model.params * TRAIN_STATE_BYTES / (s.tp * s.pp * s.dp) / (profile.mem_bw * profile.mem_bw_efficiency)
        moved = offloaded_bytes(model, s, knobs or Knobs())
        per_step += 2 * moved / (profile.host_bw or profile.mem_bw * profile.mem_bw_efficiency)
    time_s = steps * per_step + profile.call_overhead_s
    knobs = replace(knobs or Knobs(compute_bytes=profile.bytes_per_param), sp=s.sp)
    knobs = replace(knobs, gradient_checkpointing=knobs.gradient_checkpointing or s.recompute)
    width = w.response_len + 1  # the scored positions
    if train:
        parts = update_pass(model, rows, w.seq_len, width, s.tp, knobs, layers=model.layers / s.pp,
                            in_flight=min(s.pp, micro))
    else:
        parts = forward_pass(model, rows, width, s.tp, knobs)
    # an offloaded optimizer's state comes back for its step, once the activations are freed
    return CallCost(time_s, max(sum(parts.values()), offloaded_bytes(model, s, knobs) if train else 0.0))


def generate(model: ModelSpec, s: Strategy, w: Workload, mesh: Mesh, profile: DeviceProfile,
             free_bytes: float, knobs: Knobs | None = None) -> CallCost:
    """The rollout: `devices / gen_tp` engine replicas share the sequences; each prefills its
    prompts and decodes `response_len` steps, as many rows at once as its KV cache holds: vLLM's
    share of the device, all of them (the native engine), or what the colocated models leave
    (`free_bytes` per device; `Knobs()`). Its memory is the larger of a wave's and a held-out
    evaluation wave's (the native engine decodes `rollout.decode_slots` held-out rows at once)."""
    knobs = replace(knobs or Knobs(compute_bytes=profile.bytes_per_param), gen_ep=s.gen_ep)
    tg = s.gen_tp
    replicas = mesh.devices // tg
    rows = math.ceil(w.sequences / replicas)
    weights = generation_params(model, s.gen_ep) * profile.bytes_per_param / tg
    kv_row = model.kv_bytes_per_token * profile.bytes_per_param / 2 / tg * w.seq_len
    engine = knobs.vllm_bytes or free_bytes
    kv_budget = engine - weights - 0.05 * profile.mem_bytes  # activations and workspace
    waved = 0
    if knobs.all_rows:  # the native engine: every row at once, or waves of rollout.decode_slots
        at_once = min(rows, knobs.decode_rows) if knobs.decode_rows else rows
        if not knobs.decode_rows and weights + at_once * kv_row > free_bytes:  # the plan sets decode_slots: waves
            groups = int((free_bytes - weights) // (kv_row * knobs.samples)) if free_bytes > weights else 0
            at_once = waved = groups * knobs.samples  # whole prompts (their n samples) per wave
        kv_budget = at_once * kv_row if weights + at_once * kv_row <= free_bytes else 0.0
    if kv_budget < kv_row:
        return CallCost(INFEASIBLE, INFEASIBLE)
    waves = math.ceil(rows / max(1, int(kv_budget // kv_row)))
    batch = math.ceil(rows / waves)
    spans = mesh.spans(tg)
    prompt_tokens = batch * w.prompt_len
    prefill = (_compute(profile, _flops_per_token(model, w.prompt_len / 2) * prompt_tokens / tg, prompt_tokens,
                        profile.infer_efficiency)
               + model.layers * profile.layer_overhead_s
               + 2 * model.layers * _ring(profile, prompt_tokens * model.hidden * profile.bytes_per_param, tg, spans,
                                                 tp=True))
    context = w.prompt_len + w.response_len / 2
    step_compute = _compute(profile, _flops_per_token(model, context) * batch / tg, batch, profile.infer_efficiency)
    reads = (weights + batch * model.kv_bytes_per_token * profile.bytes_per_param / 2 / tg * context)
    step_memory = reads / (profile.mem_bw * profile.mem_bw_efficiency)
    step = (max(step_compute, step_memory) + profile.decode_step_overhead_s + model.layers * profile.layer_overhead_s
            + 2 * model.layers * _ring(profile, batch * model.hidden * profile.bytes_per_param, tg, spans, tp=True))
    if s.gen_ep > 1:  # each MoE layer: the group's tokens gathered, the experts' outputs reduce-scattered back
        ep_spans = mesh.spans(s.gen_ep)
        prefill += 2 * model.layers * _ring(profile, s.gen_ep * prompt_tokens * model.hidden * profile.bytes_per_param,
                                            s.gen_ep, ep_spans, factor=1.0)
        step += 2 * model.layers * _ring(profile, s.gen_ep * batch * model.hidden * profile.bytes_per_param,
                                         s.gen_ep, ep_spans, factor=1.0)
    time_s = waves * (prefill + w.response_len * step) + profile.call_overhead_s
    held_out = (knobs.decode_rows or waved) if knobs.all_rows else 0  # the evaluation's waves: decode_slots rows each
    return CallCost(time_s, sum(generation(model, max(batch, held_out), w.seq_len, tg, knobs).values()), waved)


def weights_moved(s: Strategy, held: float, profile: DeviceProfile) -> float:
    """actor.offload=all: the models' `held` bytes (a device's, the optimizer's already away) to host
    memory after the reshard and back before the next pass, at the profile's host bandwidth."""
    if not s.offload_weights:
        return 0.0
    return 2 * held / (profile.host_bw or profile.mem_bw * profile.mem_bw_efficiency)


def reshard(model: ModelSpec, s: Strategy, mesh: Mesh, profile: DeviceProfile) -> float:
    """Colocated hybrid engine: gather the training shards into the generation layout (FSDP
    shards over dp, then the micro-DP all-gather inside each training TP·PP group)."""
    full = generation_params(model, s.gen_ep, gathered=True) * profile.bytes_per_param
    fsdp = _ring(profile, full / (s.tp * s.pp), s.dp, mesh.spans(s.dp, s.tp * s.pp), factor=1.0)
    micro_dp = s.tp * s.pp // s.gen_tp
    micro = _ring(profile, full / s.gen_tp, micro_dp, mesh.spans(s.tp * s.pp), factor=1.0)
    return fsdp + micro + profile.call_overhead_s


def weight_broadcast(model: ModelSpec, profile: DeviceProfile, across_nodes: bool) -> float:
    """Split placement: the training pool broadcasts the whole model to the rollout pool
    (bucketed, pipelined, so about one model's bytes over the slowest link)."""
    bw, latency = profile.bandwidth(across_nodes)
    return model.params * profile.bytes_per_param / bw + latency + profile.call_overhead_s


def sequence_transfer(w: Workload, profile: DeviceProfile) -> float:
    """Moving a batch's token ids, masks and per-token values between pools (small)."""
    bw, latency = profile.bandwidth(True)
    return latency + w.sequences * w.seq_len * 4 * 4 / bw
