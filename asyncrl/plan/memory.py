"""Peak memory of one colocated actor/rollout/reference worker, estimated from the config and the
model's shape before anything starts (HybridFlow's colocated placement, no pipeline stages).

What a rank holds between calls (resident) and, on top, the largest of what each phase of a step
allocates (generation, the log-prob passes, the update):

    resident   fp32 master shard + fp32 gradient shard + Adam's two moments (16 bytes per parameter
               over dp x tp ranks), the reference policy's shard in the compute dtype
    generate   the generation weights (the reshard's full tensors over rollout.parallel.tp, in the
               compute dtype) + the native engine's KV cache for this rank's rows
    evaluate   the same for held-out prompts, which decode in waves of rollout.decode_slots rows
               (0: a training batch's rows on the rank), whatever the held-out set's size
    log-probs  one micro-batch's logits at the response positions + an fp32 chunk + two gathered
               layers + the gathered embedding (FSDP's root unit)
    update     one micro-batch's saved activations (one layer's when checkpointing) + its logits
               and their gradient + fp32 chunks + two gathered layers + the gathered embedding
               and its unsharded gradient (compute dtype, and the fp32 copy FSDP reduces)

plus the process's own footprint (Python, torch and transformers loaded: `RUNTIME_BYTES`); rank 0
also reads the checkpoint at load, and at a save holds the HF export's current file (at most
`EXPORT_SHARD_BYTES`) plus one gathered fp32 tensor (host memory: the device's own on a CPU).

The terms (`training_state`, `forward_pass`, `update_pass`, `generation`, ...) are shared: the
preflight's `worker_memory` composes them from a config, and `asyncrl-plan`'s search
(`asyncrl.plan.cost`) from each candidate strategy, so both price a plan alike (a test checks it).
`benchmarks/memory.py` measures the peak against this estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.engines import backend, rollout_engine
from asyncrl.plan.workload import ModelSpec
from asyncrl.train.export import EXPORT_SHARD_BYTES
from asyncrl.train.logits import LOGIT_CHUNK_TOKENS
from asyncrl.train.lora import INPUT_EMBEDDINGS
from asyncrl.train.moe import route_dtype
from transport.checks import ConfigError

GIB = float(1 << 30)
FILL_FRACTION = 0.85  # of a device an auto token budget plans for: the estimate's error, the allocator's slack
RUNTIME_BYTES = 0.75 * GIB  # a worker process with torch, transformers and asyncrl loaded (measured on CPU)
KV = "KV cache (native engine)"  # the part the generate and evaluate phases differ in
# bytes of saved activations per token per layer, in units of the compute dtype's width: attention
# and MLP inputs and outputs, norms, the gated MLP's three ffn-wide tensors (Korthikanti et al. 2022
# count 34 x hidden for GPT without flash attention; a gated MLP adds its third projection)
ACTIVATION_HIDDENS = 18
ACTIVATION_FFNS = 3
MOE_ACTIVATION_HIDDENS = 3  # per routed expert a token goes to (Hugging Face's loop over experts)


@dataclass
class MemoryEstimate:
    """Bytes per worker: each part, the phase that peaks, and the total."""

    parts: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # on the device
    host: dict[str, float] = field(default_factory=dict)  # rank 0's host memory at load and save

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def total(self) -> float:
        return self.phases[self.peak_phase]

    def lines(self) -> list[str]:
        """A readable breakdown: one part per line, GiB."""
        rows = [f"  {name:<40} {b / GIB:8.2f} GiB" for name, b in self.parts.items()]
        rows.append(f"  {'peak (' + self.peak_phase + ')':<40} {self.total / GIB:8.2f} GiB")
        if self.host and not set(self.host) <= set(self.phases):
            rows += [f"  {'host memory at ' + name:<40} {b / GIB:8.2f} GiB" for name, b in self.host.items()]
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"parts_gib": {k: round(v / GIB, 3) for k, v in self.parts.items()},
                "phases_gib": {k: round(v / GIB, 3) for k, v in self.phases.items()},
                "host_gib": {k: round(v / GIB, 3) for k, v in self.host.items()},
                "peak_phase": self.peak_phase, "memory_gib_per_device": round(self.total / GIB, 3)}


@dataclass(frozen=True)
class Knobs:
    """What besides the parallel layout decides a device's memory: the config's knobs, so that
    `asyncrl-plan`'s search and the preflight price a plan with the same terms."""

    compute_bytes: float = 2.0  # the compute dtype's width (bf16 2, fp32 4)
    gradient_checkpointing: bool = False
    max_tokens_per_micro_batch: int = 0  # 0 = rows decide the micro-batch
    vllm_bytes: float = 0.0  # vLLM's share of the device (weights + KV cache)
    # the native engine decodes all its rows at once; neither: a paged engine that fills what
    # the colocated models leave, in waves (HybridFlow's simulator; the planner benchmarks')
    all_rows: bool = False
    decode_rows: int = 0  # the native engine's rows at once (rollout.decode_slots; 0 = all)
    samples: int = 1  # rollout.n: a wave of the native engine holds whole prompts' samples
    async_save: bool = False  # trainer.async_save: a save copies the training state to host memory first
    lora_params: int = 0  # actor.lora: the adapters' parameters (they alone train; no reference model)
    critic_lora_params: int = 0  # critic.lora: its adapters' parameters (they and the value head train)
    megatron: bool = False  # actor.backend=megatron: whole TP x PP shards per rank, optimizer state over DP
    ep: int = 1  # actor.moe.ep (megatron): each rank holds experts / ep of the experts
    sp: int = 1  # actor.parallel.sp (Ulysses): a micro-batch's tokens split over sp ranks
    vision_trains: bool = True  # a vision-language model's tower trains (not actor.freeze_vision, not LoRA)
    offload: bool = False  # actor.offload=optimizer or all: AdamW's state in host memory between its steps
    offload_weights: bool = False  # actor.offload=all: the training and reference weights in host memory while generating
    routes: bool = False  # actor.moe.router_replay != none: each token's experts recorded and carried with its row
    gen_ep: int = 1  # rollout.parallel.ep: generation keeps each rank's block of the experts (experts / gen_ep)

    @classmethod
    def from_config(cls, cfg: Any, on_gpu: bool, device_bytes: float | None = None,
                    spec: ModelSpec | None = None, token_budget: int | None = None) -> Knobs:
        """`token_budget`: the update's, in place of actor.max_tokens_per_micro_batch (whose -1, a
        budget sized to fill the device, prices as its most: micro-batches of micro_batch_size rows)."""
        vllm = rollout_pool_bytes(cfg, on_gpu, device_bytes)
        bf16 = cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and on_gpu)
        budget = max(0, cfg.actor.max_tokens_per_micro_batch) if token_budget is None else token_budget
        return cls(2.0 if bf16 else 4.0, cfg.actor.gradient_checkpointing, budget,
                   vllm, all_rows=not vllm, decode_rows=cfg.rollout.decode_slots, samples=cfg.rollout.n,
                   async_save=cfg.trainer.async_save,
                   lora_params=lora_params(spec, cfg.actor.lora) if spec is not None else 0,
                   critic_lora_params=lora_params(spec, cfg.critic.lora) if spec is not None else 0,
                   megatron=backend(cfg.actor.backend).whole_tp_pp_shards, ep=cfg.actor.moe.ep, sp=cfg.actor.parallel.sp,
                   vision_trains=not (cfg.actor.freeze_vision or cfg.actor.lora.enabled),
                   offload=cfg.actor.offload != "none", offload_weights=cfg.actor.offload == "all",
                   routes=cfg.actor.moe.router_replay != "none",
                   gen_ep=cfg.rollout.parallel.ep)


def rollout_pool_bytes(cfg: Any, on_gpu: bool, device_bytes: float | None) -> float:
    """The device bytes a rollout engine that sizes its own pool takes (vLLM: from
    `gpu_memory_utilization`; it sleeps while the actor trains); 0 for the native engine and off a GPU."""
    if on_gpu and device_bytes:
        return rollout_engine(cfg.rollout.engine).takes_device_bytes(cfg, device_bytes)
    return 0.0


LORA_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(spec: ModelSpec, lora: Any) -> int:
    """The adapters' parameters: rank x (in + out) for each adapted linear of every layer, and
    rank x (vocab + hidden) for an adapted embedding (or untied head)."""
    if not getattr(lora, "rank", 0):
        return 0
    h, kv, f = spec.hidden, spec.hidden * spec.kv_heads // spec.heads, spec.ffn
    sizes = {"q_proj": h + h, "k_proj": h + kv, "v_proj": h + kv, "o_proj": h + h,
             "gate_proj": h + f, "up_proj": h + f, "down_proj": f + h}
    leaves = LORA_LEAVES if "all-linear" in lora.target_modules else [t for t in lora.target_modules if t in sizes]
    embeddings = sum(t in lora.target_modules for t in INPUT_EMBEDDINGS)
    embeddings += "lm_head" in lora.target_modules and not spec.tied
    return lora.rank * (spec.layers * sum(sizes[leaf] for leaf in leaves) + embeddings * (spec.vocab + spec.hidden))


def route_bytes(spec: ModelSpec, knobs: Knobs) -> float:
    """A token's recorded experts (routing replay): every layer's top-k, in the smallest integer
    type that holds the expert count and -1 (asyncrl.train.moe.route_dtype)."""
    if not (knobs.routes and spec.experts):
        return 0.0
    return spec.layers * spec.experts_per_token * route_dtype(spec.experts).itemsize


def _moe_extra(spec: ModelSpec) -> float:
    """Saved activations a mixture-of-experts layer adds per token, in compute-dtype widths: each
    of its k experts' gathered input, output and weighted output, and the router's fp32 logits
    and probabilities."""
    return spec.experts_per_token * MOE_ACTIVATION_HIDDENS * spec.hidden + 4 * spec.experts if spec.experts else 0.0


# the terms: each a few named parts, bytes per device ------------------------------------------
ADAM = "Adam moments (fp32 shard)"
MEGATRON_ADAM = "Adam moments (over DP)"
OFFLOADED = "Adam moments (host; on device to step)"
ROUTES = "routed experts (routing replay)"


def training_state(spec: ModelSpec, shards: int, trained: float | None = None) -> dict[str, float]:
    """A trained model's FSDP shard: fp32 master weights, fp32 gradients, Adam's two moments
    (`trained`: the parameters that train, when not all do: LoRA's adapters)."""
    shard = spec.params / shards
    grads = (spec.params if trained is None else trained) / shards
    return {"weights (fp32 master shard)": 4 * shard, "gradients (fp32 shard)": 4 * grads, ADAM: 8 * grads}


def actor_trained(spec: ModelSpec, knobs: Knobs) -> float | None:
    """The actor's parameters that train when not all do: LoRA's adapters, or all but a frozen vision tower."""
    if knobs.lora_params:
        return knobs.lora_params
    return None if knobs.vision_trains else spec.params - spec.vision_params


def megatron_held(spec: ModelSpec, model_shards: int, ep: int = 1) -> float:
    """Parameters a megatron rank holds: its TP x PP shard, of the experts only its EP rank's."""
    return (spec.params - spec.expert_params + spec.expert_params / ep) / model_shards


def megatron_state(spec: ModelSpec, model_shards: int, dp: int, cb: float, ep: int = 1) -> dict[str, float]:
    """A megatron-core rank: its TP x PP shard in the compute dtype (a mixture's experts also over
    `ep`), an fp32 grad buffer of it, the distributed optimizer's fp32 masters (a copy only below
    fp32) and Adam moments over DP (an expert's over the dp / ep ranks that hold it: the same
    share), and the fp32 temporaries of Adam's multi-tensor step over them (measured on an H100:
    +4 bytes a parameter at the step)."""
    held, shard = megatron_held(spec, model_shards, ep), spec.params / model_shards
    return {"weights (TP x PP shard)": cb * held, "gradients (fp32 buffer)": 4 * held,
            "fp32 masters (over DP)": (4 * shard / dp) if cb < 4 else 0.0, MEGATRON_ADAM: 8 * shard / dp,
            "Adam step temporaries (over DP)": 4 * shard / dp}


def forward_only_weights(spec: ModelSpec, shards: int, knobs: Knobs) -> float:
    """A forward-only model (reference policy, reward model): sharded like the actor, compute dtype."""
    return knobs.compute_bytes * spec.params / shards


def forward_pass(spec: ModelSpec, rows: float, width: float, tp: int, knobs: Knobs) -> dict[str, float]:
    """A log-prob (or value) pass over `rows` rows of `width` scored positions: the logits there and
    an fp32 chunk, two gathered layers, and the gathered embedding (FSDP's root unit)."""
    cb, scored = knobs.compute_bytes, rows * width / knobs.sp  # sequence parallel: a rank scores its slice
    return {"log-prob logits": scored * _outputs(spec) / tp * cb + 2 * _chunk(spec, scored, knobs.sp),
            **_gathered(spec, tp, cb, knobs)}


def update_pass(spec: ModelSpec, rows: float, seq: float, width: float, tp: int, knobs: Knobs,
                layers: float | None = None, in_flight: int = 1) -> dict[str, float]:
    """A training micro-batch of `rows` rows of `seq` tokens (`width` scored): its saved
    activations (`in_flight` micro-batches of them on a pipeline stage of `layers` layers; one
    layer's when checkpointing), its logits and their gradient, the gathered layers and embedding
    and the embedding's unsharded gradient (compute dtype, and the fp32 copy FSDP reduces)."""
    cb, layers = knobs.compute_bytes, spec.layers if layers is None else layers
    if knobs.max_tokens_per_micro_batch:
        rows = min(rows, max(1.0, knobs.max_tokens_per_micro_batch / seq))
    tokens = rows * seq / knobs.sp  # this rank's slice of the micro-batch (Ulysses)
    per_layer = tokens * (ACTIVATION_HIDDENS * spec.hidden + ACTIVATION_FFNS * spec.active_ffn + _moe_extra(spec)) * cb / tp
    kept = tokens * spec.hidden * cb * layers + per_layer if knobs.gradient_checkpointing else per_layer * layers
    gathered = _gathered(spec, tp, cb, knobs)
    scored = rows * width / knobs.sp
    return {"update activations": kept * in_flight,
            **({"vision tower activations": vision_activations(spec, rows * (seq - width), knobs)}
               if spec.vision is not None else {}),
            **({"Ulysses all-to-all buffers": ulysses_buffers(spec, tokens, tp, knobs)} if knobs.sp > 1 else {}),
            "update logits and their gradient": 2 * scored * _outputs(spec) / tp * cb
            + 3 * _chunk(spec, scored, knobs.sp),
            **gathered,  # LoRA: the embedding is frozen, no gradient
            "embedding gradient (unsharded)": 0.0 if knobs.lora_params or knobs.megatron else
            (cb + 4) / cb * gathered["gathered embedding (FSDP root)"]}


def vision_activations(spec: ModelSpec, prompt_tokens: float, knobs: Knobs) -> float:
    """What a training vision tower keeps for the backward of a micro-batch whose prompts hold
    `prompt_tokens` tokens, all of them image tokens at most (each merge x merge patches); nothing
    when the tower is frozen (no graph through it)."""
    tower = spec.vision
    if tower is None or not knobs.vision_trains:
        return 0.0
    patches = prompt_tokens * tower.merge ** 2
    per_layer = patches * (ACTIVATION_HIDDENS * tower.hidden + ACTIVATION_FFNS * tower.ffn) * knobs.compute_bytes
    if knobs.gradient_checkpointing:
        return patches * tower.hidden * knobs.compute_bytes * tower.depth + per_layer
    return per_layer * tower.depth


def ulysses_buffers(spec: ModelSpec, tokens: float, tp: int, knobs: Knobs) -> float:
    """One layer's all-to-all exchange around attention: q, k and v (kv heads repeated up to the
    query heads when they do not divide by sp) sent and received, and the output's way back."""
    kv = spec.kv_heads if spec.kv_heads % knobs.sp == 0 else spec.heads
    width = (spec.head_dim or spec.hidden // spec.heads) * (2 * spec.heads + 2 * kv) / tp
    return 2 * tokens * width * knobs.compute_bytes


def generation_params(spec: ModelSpec, gen_ep: int, gathered: bool = False) -> float:
    """The parameters a generation rank holds: all of them, or with expert-parallel generation the
    dense ones and its block of the experts (`gathered`: of those, the ones a reshard gathers:
    the dense ones only, each rank's experts being the ones it trains)."""
    if gen_ep <= 1 or not spec.experts:
        return spec.params
    dense = spec.params - spec.expert_params
    return dense if gathered else dense + spec.expert_params / gen_ep


def generation(spec: ModelSpec, rows: float, seq: float, gen_tp: int, knobs: Knobs) -> dict[str, float]:
    """The rollout on one device: vLLM's share of it, or the native engine's weights (the
    reshard's full tensors over the generation TP group, a mixture's experts over rollout ep,
    compute dtype) and its KV cache for `rows` rows of `seq` tokens."""
    if knobs.vllm_bytes:
        return {"vLLM (weights + KV cache)": knobs.vllm_bytes}
    cb = knobs.compute_bytes
    return {"generation weights (/ rollout tp, experts / ep)": cb * generation_params(spec, knobs.gen_ep) / gen_tp,
            KV: rows * seq * spec.kv_bytes_per_token / 2 * cb / gen_tp}


def checkpoint_phases(spec: ModelSpec, shards: int, knobs: Knobs, resident: float) -> dict[str, float]:
    """Rank 0's host memory at load (its shard, the checkpoint's tensors and each file's as read)
    and at a save (one gathered fp32 tensor at a time and the export's current file, in the
    compute dtype, on top of what it holds; an asynchronous save's host copy of the training state)."""
    staged = sum(training_state(spec, shards).values()) if knobs.async_save else 0.0
    return {"load (rank 0)": 4 * spec.params / shards + 6 * spec.params + RUNTIME_BYTES,
            "save (rank 0)": resident + min(knobs.compute_bytes * spec.params, EXPORT_SHARD_BYTES)
            + 4 * spec.vocab * spec.hidden + staged}


def _outputs(spec: ModelSpec) -> int:
    return 1 if spec.value_head else spec.vocab


def _gathered(spec: ModelSpec, tp: int, cb: float, knobs: Knobs | None = None) -> dict[str, float]:
    """What FSDP unshards during a pass: a layer or two at a time (prefetch), and its root unit
    (embedding, and the LM head when untied) for the whole forward; nothing under megatron."""
    if knobs is not None and knobs.megatron:
        return {}
    embed = spec.vocab * spec.hidden * (1 if spec.tied else 2) / tp
    return {"gathered layers (FSDP)": 2 * spec.layer_params * cb / tp, "gathered embedding (FSDP root)": cb * embed}


# one worker of the colocated actor ------------------------------------------------------------
def worker_memory(cfg: Any, spec: ModelSpec, on_gpu: bool, device_bytes: float | None = None,
                  token_budget: int | None = None) -> MemoryEstimate:
    """The estimate for one rank of the actor's pool of `cfg` (an RLConfig) and model `spec`
    (`device_bytes`: a GPU's memory, which vLLM takes its `gpu_memory_utilization` share of;
    `token_budget`: the update's micro-batch budget in place of the config's)."""
    ac, rc, dc = cfg.actor, cfg.rollout, cfg.data
    par = ac.parallel
    knobs = Knobs.from_config(cfg, on_gpu, device_bytes, spec, token_budget)
    dp = par.dp or max(1, cfg.trainer.n_workers // (par.tp * par.pp))
    shards = dp * par.tp * par.pp
    seq = dc.max_prompt_len + rc.max_tokens
    width = rc.max_tokens + 1  # the response positions whose logits are computed
    rows = dc.batch_size * rc.n / dp  # this rank's rows of a step
    batch_rows = rows * rc.parallel.tp / par.tp  # a TP group's rows, over its tp / rollout tp replicas
    gen_rows = min(batch_rows, knobs.decode_rows) if knobs.decode_rows else batch_rows  # in waves of at most this
    eval_rows = knobs.decode_rows or batch_rows  # held-out prompts: waves of decode_slots, else of a batch's rows

    lora = knobs.lora_params  # the reference is the base with the adapters off: no copy
    if knobs.megatron:  # its DP ranks hold whole TP x PP shards
        resident = {**megatron_state(spec, par.tp * par.pp, dp, knobs.compute_bytes, knobs.ep),
                    "reference policy (shard)": knobs.compute_bytes * megatron_held(spec, par.tp * par.pp, knobs.ep),
                    "process (python, torch)": RUNTIME_BYTES}
    else:
        resident = {**training_state(spec, shards, actor_trained(spec, knobs)),
                    "reference policy (shard)": 0.0 if lora else forward_only_weights(spec, shards, knobs),
                    "process (python, torch)": RUNTIME_BYTES}
    gen = generation(spec, gen_rows, seq, rc.parallel.tp, knobs)
    held_out = generation(spec, eval_rows, seq, rc.parallel.tp, knobs)
    eval_kv = {"KV cache (evaluation waves)": held_out[KV]} if KV in held_out and eval_rows != gen_rows else {}
    lp = forward_pass(spec, min(ac.log_prob_micro_batch_size, rows), width, par.tp, knobs)
    up = update_pass(spec, min(ac.micro_batch_size, rows / ac.ppo_mini_batches), seq, width, par.tp, knobs)
    # on a GPU: its bytes leave the device between steps (a CPU's host memory is its device memory)
    moved = {OFFLOADED: resident.pop(MEGATRON_ADAM if knobs.megatron else ADAM)} if knobs.offload and on_gpu else {}
    if knobs.routes and spec.experts:  # the rank's rows carry their tokens' experts from generation to the update
        routes = {ROUTES: rows * seq * route_bytes(spec, knobs)}
        gen, lp, up = {**gen, **routes}, {**lp, **routes}, {**up, **routes}
    base = sum(resident.values())
    # actor.offload=all on a GPU: the rollout runs beside the process alone (the weights wait in host memory)
    rollout_base = RUNTIME_BYTES if knobs.offload_weights and on_gpu else base
    phases = {"generate": rollout_base + sum(gen.values()), "evaluate": rollout_base + sum(held_out.values()),
              "log-probs": base + sum(lp.values()),
              "update": base + sum(up.values())}
    if moved:  # the state comes back for the optimizer's step, after the backward's activations are freed
        phases["optimizer step"] = base + moved[OFFLOADED]
    host = {**checkpoint_phases(spec, shards, knobs, base), **({"steps (offloaded optimizer, each rank)": moved[OFFLOADED]} if moved else {}),
            **({"rollout (offloaded weights, each rank)": base - rollout_base + sum(moved.values())}
               if rollout_base != base else {})}
    if not on_gpu:  # the checkpoint's bytes are host memory: the device's own on a CPU
        phases.update(host)
    return MemoryEstimate({**resident, **moved, **gen, **eval_kv, **lp, **up}, phases, host)


def fill_token_budget(cfg: Any, spec: ModelSpec, on_gpu: bool, device_bytes: float) -> tuple[int, float]:
    """actor.max_tokens_per_micro_batch=-1: the largest token budget whose update phase this
    estimate prices within FILL_FRACTION of `device_bytes` (a GPU's memory, or this worker's share
    of its node's) — at least the longest row (a row is never split), at most a micro-batch of
    actor.micro_batch_size such rows — and that phase's estimated bytes."""
    longest = cfg.data.max_prompt_len + cfg.rollout.max_tokens
    target = FILL_FRACTION * device_bytes

    def update(budget: int) -> float:
        return worker_memory(cfg, spec, on_gpu, device_bytes if on_gpu else None, budget).phases["update"]

    if (one_row := update(longest)) > target:
        raise ConfigError(
            f"actor.max_tokens_per_micro_batch=-1: a micro-batch of one {longest}-token row already needs about "
            f"{one_row / GIB:.1f} GiB at the update, more than {FILL_FRACTION:.0%} of the "
            f"{device_bytes / GIB:.1f} GiB this worker has: set actor.gradient_checkpointing=true, "
            "model.dtype=bfloat16, or more trainer.n_workers (fewer parameters a rank)")
    low, high = longest, longest * max(1, cfg.actor.micro_batch_size)
    while low < high:  # the update's estimate grows with the budget
        mid = (low + high + 1) // 2
        low, high = (mid, high) if update(mid) <= target else (low, mid - 1)
    return low, update(low)


def _chunk(spec: ModelSpec, tokens: float, sp: int = 1) -> float:
    """One fp32 chunk of logits in the log-prob and entropy computation (its softmax and, in the
    backward, its gradient are as large: counted by the callers); Ulysses ranks take chunks of
    1/sp the positions."""
    return min(LOGIT_CHUNK_TOKENS // sp, tokens) * spec.vocab * 4.0
