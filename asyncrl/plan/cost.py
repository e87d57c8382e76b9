"""The cost model: time and memory per device of each model function call under a parallel
strategy, and of moving weights between the layouts (HybridFlow §6's simulators, REAL §5's
estimator). Pure arithmetic on a `DeviceProfile`, microseconds per call, so a search can price
millions of plans.

Conventions: FLOPs of a forward pass are 2·params per token plus attention; training is 3× a
forward; weights move at the profile's `bytes_per_param`; training state (weights, gradients,
fp32 master and Adam moments) is 16 bytes per parameter, sharded over data-parallel ranks
(FSDP); collectives are ring collectives, inside a node unless the group spans nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncrl.plan.hardware import DeviceProfile
from asyncrl.plan.workload import Call, ModelSpec, Workload

TRAIN_STATE_BYTES = 16  # per parameter: weights + grads (bf16) + fp32 master, exp_avg, exp_avg_sq
ACTIVATION_BYTES_PER_HIDDEN = 34  # per token per layer per hidden unit kept for backward (Megatron's count, 16-bit)
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

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        text = f"dp{self.dp}·tp{self.tp}·pp{self.pp} mb{self.micro_batch}"
        return text + (f" gen-tp{self.gen_tp}" if self.gen_tp > 1 else "")


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
    """Forward FLOPs per token: the matmuls (2 per weight) and causal attention over `context`."""
    return 2.0 * model.params + 2.0 * model.layers * model.hidden * context


@dataclass(frozen=True)
class CallCost:
    time_s: float
    memory_bytes: float  # transient, on top of the model's resident state


def resident_bytes(model: ModelSpec, s: Strategy, trained: bool, profile: DeviceProfile) -> float:
    """What a model keeps on each device between calls: training state, or sharded weights."""
    per_param = TRAIN_STATE_BYTES if trained else profile.bytes_per_param
    return model.params * per_param / (s.tp * s.pp * s.dp)


def forward_backward(model: ModelSpec, s: Strategy, w: Workload, call: Call, mesh: Mesh,
                     profile: DeviceProfile) -> CallCost:
    """A training call (`call.kind == "train"`) or a forward-only one (`"infer"`) over the batch."""
    train = call.kind == "train"
    passes = 3.0 if train else 1.0  # backward costs two forwards
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
    if train:  # the optimizer reads and writes the state shard
        per_step += 2 * model.params * TRAIN_STATE_BYTES / (s.tp * s.pp * s.dp) / (profile.mem_bw * profile.mem_bw_efficiency)
    time_s = steps * per_step + profile.call_overhead_s
    layers_here = model.layers / s.pp
    kept = ACTIVATION_BYTES_PER_HIDDEN / 2 * profile.bytes_per_param * model.hidden / s.tp * layers_here * tokens
    in_flight = min(s.pp, micro) if train else 1
    out_width = 1 if model.value_head else model.vocab / s.tp
    logits = tokens * out_width * 4 * (2 if train else 1)
    gathered = 2 * model.layer_params * profile.bytes_per_param / s.tp  # FSDP unshards a layer or two at a time
    memory = (kept * in_flight if train else act * 4) + logits + gathered
    return CallCost(time_s, memory)


def generate(model: ModelSpec, s: Strategy, w: Workload, mesh: Mesh, profile: DeviceProfile,
             free_bytes: float) -> CallCost:
    """The rollout: `devices / gen_tp` engine replicas share the sequences; each prefills its
    prompts and decodes `response_len` steps, as many rows at once as its KV cache holds
    (`free_bytes` per device is what the colocated models leave)."""
    tg = s.gen_tp
    replicas = mesh.devices // tg
    rows = math.ceil(w.sequences / replicas)
    weights = model.params * profile.bytes_per_param / tg
    kv_row = model.kv_bytes_per_token * profile.bytes_per_param / 2 / tg * w.seq_len
    kv_budget = free_bytes - weights - 0.05 * profile.mem_bytes  # activations and workspace
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
    time_s = waves * (prefill + w.response_len * step) + profile.call_overhead_s
    return CallCost(time_s, weights + batch * kv_row)


def reshard(model: ModelSpec, s: Strategy, mesh: Mesh, profile: DeviceProfile) -> float:
    """Colocated hybrid engine: gather the training shards into the generation layout (FSDP
    shards over dp, then the micro-DP all-gather inside each training TP·PP group)."""
    full = model.params * profile.bytes_per_param
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
