"""Peak memory of one colocated actor/rollout/reference worker, estimated from the config and the
model's shape before anything starts (HybridFlow's colocated placement, no pipeline stages).

What a rank holds between calls (resident) and, on top, the largest of what each phase of a step
allocates (generation, the log-prob passes, the update):

    resident   fp32 master shard + fp32 gradient shard + Adam's two moments (16 bytes per parameter
               over dp x tp ranks), the reference policy's shard in the compute dtype
    generate   the generation weights (the reshard's full tensors over rollout.parallel.tp, in the
               compute dtype) + the native engine's KV cache for this rank's rows
    log-probs  one micro-batch's logits at the response positions + an fp32 chunk + two gathered
               layers + the gathered embedding (FSDP's root unit)
    update     one micro-batch's saved activations (one layer's when checkpointing) + its logits
               and their gradient + fp32 chunks + two gathered layers + the gathered embedding
               and its unsharded gradient (compute dtype, and the fp32 copy FSDP reduces)

plus the process's own footprint (Python, torch and transformers loaded: `RUNTIME_BYTES`); rank 0
also reads the checkpoint at load, and at a save holds the HF export's current file (at most
`EXPORT_SHARD_BYTES`) plus one gathered fp32 tensor.
`benchmarks/memory.py` measures the peak against this estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.plan.workload import ModelSpec

GIB = float(1 << 30)
EXPORT_SHARD_BYTES = 2 << 30  # the HF export's safetensors files (asyncrl.train.fsdp writes them): rank 0 holds one
RUNTIME_BYTES = 0.75 * GIB  # a worker process with torch, transformers and asyncrl loaded (measured on CPU)
LOGIT_CHUNK_TOKENS = 1024  # positions whose fp32 logits exist at once in asyncrl.roles.forward (x vocab x 4 bytes)
# bytes of saved activations per token per layer, in units of the compute dtype's width: attention
# and MLP inputs and outputs, norms, the gated MLP's three ffn-wide tensors (Korthikanti et al. 2022
# count 34 x hidden for GPT without flash attention; a gated MLP adds its third projection)
ACTIVATION_HIDDENS = 18
ACTIVATION_FFNS = 3


@dataclass
class MemoryEstimate:
    """Bytes per worker: each part, the phase that peaks, and the total."""

    parts: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)

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
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"parts_gib": {k: round(v / GIB, 3) for k, v in self.parts.items()},
                "phases_gib": {k: round(v / GIB, 3) for k, v in self.phases.items()},
                "peak_phase": self.peak_phase, "memory_gib_per_device": round(self.total / GIB, 3)}


def worker_memory(cfg: Any, spec: ModelSpec, on_gpu: bool, device_bytes: float | None = None) -> MemoryEstimate:
    """The estimate for one rank of the actor's pool of `cfg` (an RLConfig) and model `spec`
    (`device_bytes`: a GPU's memory, which vLLM takes its `gpu_memory_utilization` share of)."""
    ac, rc, dc = cfg.actor, cfg.rollout, cfg.data
    par = ac.parallel
    dp = par.dp or max(1, cfg.trainer.n_workers // (par.tp * par.pp))
    shard = spec.params / (dp * par.tp * par.pp)
    cb = 2.0 if cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and on_gpu) else 4.0
    seq = dc.max_prompt_len + rc.max_tokens
    width = rc.max_tokens + 1  # the response positions whose logits are computed
    rows = dc.batch_size * rc.n / dp  # this rank's rows of a step
    gen_rows = rows * par.tp / rc.parallel.tp  # a generation TP group shares its rows
    layer = spec.layer_params * cb / par.tp

    parts = {
        "actor weights (fp32 master shard)": 4 * shard,
        "gradients (fp32 shard)": 4 * shard,
        "Adam moments (fp32 shard)": 8 * shard,
        "reference policy (shard)": cb * shard,
    }
    if rc.engine == "vllm" and on_gpu and device_bytes:  # vLLM sizes itself, and sleeps while training
        parts["vLLM (weights + KV cache)"] = rc.vllm.gpu_memory_utilization * device_bytes
        generation = parts["vLLM (weights + KV cache)"]
    else:
        parts["generation weights (full, / rollout tp)"] = cb * spec.params / rc.parallel.tp
        parts["KV cache (native engine)"] = gen_rows * seq * spec.kv_bytes_per_token / 2 * cb / rc.parallel.tp
        generation = parts["generation weights (full, / rollout tp)"] + parts["KV cache (native engine)"]
    lp_rows = min(ac.log_prob_micro_batch_size, rows)
    parts["log-prob logits"] = lp_rows * width * spec.vocab / par.tp * cb + 2 * _chunk(spec, lp_rows * width)
    mb_rows = min(ac.micro_batch_size, rows)
    if ac.max_tokens_per_micro_batch:
        mb_rows = min(mb_rows, max(1.0, ac.max_tokens_per_micro_batch / seq))
    tokens = mb_rows * seq
    per_layer = tokens * (ACTIVATION_HIDDENS * spec.hidden + ACTIVATION_FFNS * spec.ffn) * cb / par.tp
    kept = (tokens * spec.hidden * cb * spec.layers + per_layer) if ac.gradient_checkpointing else per_layer * spec.layers
    parts["update activations"] = kept
    parts["update logits and their gradient"] = (2 * mb_rows * width * spec.vocab / par.tp * cb
                                                 + 3 * _chunk(spec, mb_rows * width))
    parts["gathered layers (FSDP)"] = 2 * layer
    # FSDP's root unit (embedding, LM head when untied) gathered for the whole forward and, in the
    # update, its unsharded gradient in the compute dtype plus the fp32 copy reduced from it
    embed = spec.vocab * spec.hidden * (1 if spec.tied else 2) / par.tp
    parts["gathered embedding (FSDP root)"] = cb * embed
    parts["embedding gradient (unsharded)"] = (cb + 4) * embed
    parts["process (python, torch)"] = RUNTIME_BYTES

    resident = sum(parts[k] for k in ("actor weights (fp32 master shard)", "gradients (fp32 shard)",
                                      "Adam moments (fp32 shard)", "reference policy (shard)",
                                      "process (python, torch)"))
    phases = {
        "generate": resident + generation,
        "log-probs": resident + parts["log-prob logits"] + parts["gathered layers (FSDP)"]
        + parts["gathered embedding (FSDP root)"],
        "update": resident + parts["update activations"] + parts["update logits and their gradient"]
        + parts["gathered layers (FSDP)"] + parts["gathered embedding (FSDP root)"]
        + parts["embedding gradient (unsharded)"],
        # rank 0 reads the checkpoint (its tensors, and each file's as read); at a save it gathers
        # one tensor at a time in fp32 and keeps the export's current file in the compute dtype
        "load (rank 0)": 4 * shard + 6 * spec.params + RUNTIME_BYTES,
        "save (rank 0)": resident + min(cb * spec.params, EXPORT_SHARD_BYTES) + 4 * spec.vocab * spec.hidden,
    }
    return MemoryEstimate(parts, phases)


def _chunk(spec: ModelSpec, tokens: float) -> float:
    """One fp32 chunk of logits in the log-prob and entropy computation (its softmax and, in the
    backward, its gradient are as large: counted by the callers)."""
    return min(LOGIT_CHUNK_TOKENS, tokens) * spec.vocab * 4.0
