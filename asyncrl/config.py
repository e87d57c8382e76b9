"""The RL job's configuration schema (`rl_schema`): one typed dataclass per section, the single
source of every default.

The YAML files in `configs/` set only what differs from these classes. `RLConfig` extends the
launch sections every job has (`asyncrl.single_controller.config.LaunchConfig`: cluster, worker,
job, objectstore, seed) with the RL ones. Each section's `check` tests ranges and choices; the
shared machinery (`asyncrl.single_controller.schema`) runs them, so a YAML file that lists
`rl_schema` in its defaults — and every command-line override — is checked: an unknown key, a
wrong type or an out-of-range value is a `ConfigError` (exit 2) that names the key, the file and
the closest valid key.

Library code reads typed values (`cfg.actor.optim.lr`), never `dict.get(key, default)`.
Workers get the config as a plain dict over the wire and rebuild the typed value with `rl_config(...)`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Annotated, Literal

from omegaconf import DictConfig

from asyncrl.agents.config import MultiTurnConfig
from asyncrl.algorithms.losses import is_behaviour_loss, policy_losses
from asyncrl.algorithms.registry import algorithms, needs_critic, needs_teacher
from asyncrl.data.config import DataConfig, tiny_model_tasks
from asyncrl.data.config import SyntheticDataConfig as SyntheticDataConfig
from asyncrl.engines import backend, backends, rollout_engine, rollout_engines
from asyncrl.single_controller.config import LaunchConfig
from asyncrl.single_controller.parallel import (
    GenerationParallelConfig,
    LayoutError,
    ParallelConfig,
    ParallelLayout,
    generation_layout,
)
from asyncrl.single_controller.schema import choices_of, to_dict, typed
from asyncrl.train.lora import INPUT_EMBEDDINGS
from asyncrl.train.optim import OptimConfig as OptimConfig
from transport.checks import ConfigError
from transport.checks import check as _check
from transport.checks import check_one_of as _one_of
from transport.checks import check_positive as _positive

__all__ = ["ConfigError", "RLConfig", "rl_config", "to_dict", "typed"]  # and every section below

ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo", "remax", "reinforce_pp", "safe_rlhf")
FILL_TOKEN_BUDGET = -1  # actor.max_tokens_per_micro_batch: sized from the memory estimate by each worker

# a field's choices are its type: `Annotated[str, Literal[...]]` (`schema.choices_of`), checked by `validate`
LossAggMode = Annotated[str, Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]]
ModelDtype = Annotated[str, Literal["auto", "bfloat16", "float32"]]
WeightSync = Annotated[str, Literal["full", "delta"]]
Decode = Annotated[str, Literal["eager", "compiled"]]
KLType = Annotated[str, Literal["kl", "k1", "k2", "k3", "low_var_kl", "mse", "abs"]]
LOSS_AGG_MODES, MODEL_DTYPES, KL_TYPES = (choices_of(t) for t in (LossAggMode, ModelDtype, KLType))


# the RL job --------------------------------------------------------------------------------------
@dataclass
class TinyModelConfig:
    """Build a random-init Llama-architecture model (a Qwen3 or Qwen3-MoE if asked) and word-level
    tokenizer (the quickstarts)."""

    task: str = "sort"  # a synthetic task, or reasoning_gym: vocabulary and warm start from data.source
    hidden: int = 64
    layers: int = 2
    heads: int = 2  # head_dim 32: vLLM's CPU attention takes multiples of 32
    experts: int = 0  # > 0: a Qwen3-MoE of this many experts (moe_quickstart), each 4 * hidden / experts_per_token wide
    experts_per_token: int = 2
    # Qwen3's attention, queries and keys RMS-normalised per head: true builds a dense Qwen3 (the
    # dense twin of the experts' Qwen3-MoE); null: the family's (a Llama has none, a Qwen3-MoE has it)
    qk_norm: bool | None = None
    sft_steps: int = 0
    # the warm start's answers: "format" (random symbols of the right shape: RL learns the task)
    # or "task" (the true answers; for `lookup`, a fifth of the conversations call the tool)
    sft_targets: Annotated[str, Literal["format", "task"]] = "format"
    sft_lr: float = 1e-3

    def check(self, at: str) -> None:
        _one_of(at + "task", self.task, tiny_model_tasks())
        _positive(at + "sft_lr", self.sft_lr)
        for name in ("hidden", "layers", "heads"):
            _positive(at + name, getattr(self, name))
        _check(self.hidden % self.heads == 0, at + "hidden", self.hidden,
               f"must divide by {at}heads={self.heads}")
        _positive(at + "experts", self.experts, allow_zero=True)
        _positive(at + "experts_per_token", self.experts_per_token)
        _check(not self.experts or self.experts_per_token <= self.experts, at + "experts_per_token",
               self.experts_per_token, f"must be at most {at}experts={self.experts}")
        _check(not self.experts or self.qk_norm is not False, at + "qk_norm", self.qk_norm,
               f"a Qwen3-MoE ({at}experts={self.experts}) normalises its queries and keys; leave it unset")
        _positive(at + "sft_steps", self.sft_steps, allow_zero=True)


@dataclass
class ModelConfig:
    path: str = "outputs/tiny-model"  # a local Hugging Face model directory (or a cached Hub name)
    build_tiny: TinyModelConfig | None = None  # build a toy model at `path` (the quickstart does)
    # the compute dtype of the training passes: "auto" = bfloat16 on a GPU, float32 on a CPU (the
    # quickstart's tiny model trains fastest in fp32 on CPU cores); "bfloat16" everywhere; or
    # "float32". Trained weights and optimizer state stay fp32 (the master copy); forward-only
    # copies (the reference policy) are stored in the compute dtype
    dtype: ModelDtype = "auto"

    def check(self, at: str) -> None:
        _check(bool(self.path.strip()), at + "path", self.path,
               "must name a local Hugging Face model directory (or a cached Hub name such as Qwen/Qwen2.5-0.5B)")


@dataclass
class VLLMConfig:
    """The vLLM engine of `rollout.engine=vllm`: one per generation replica, inside the worker."""

    gpu_memory_utilization: float = 0.5  # CUDA: share of the device vLLM may take (weights + KV cache)
    kv_cache_gib: float = 0.0  # 0 = CUDA: what gpu_memory_utilization leaves; CPU: max_num_seqs full-length rows
    max_num_seqs: int = 256  # rows decoded together
    cuda_graphs: bool = True  # CUDA only (CPU runs eager)
    sleep: bool = True  # CUDA: free vLLM's weights and KV cache while the actor trains
    # actor.lora: `adapter` serves each version's A and B over vLLM's frozen base (megabytes per
    # sync; unmerged adapters cost decode time), `merged` loads W0 + (alpha/rank) B A as full
    # weights (colocated only). A model vLLM has no LoRA support for falls back to merged.
    lora: Annotated[str, Literal["adapter", "merged"]] = "adapter"

    def check(self, at: str) -> None:
        _check(0 < self.gpu_memory_utilization <= 1, at + "gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        _positive(at + "kv_cache_gib", self.kv_cache_gib, allow_zero=True)
        _positive(at + "max_num_seqs", self.max_num_seqs)


Placement = Annotated[str, Literal["colocated", "split"]]
CorrectionMode = Annotated[str, Literal["none", "tis", "mis", "icepop", "geo_mask"]]  # actor.rollout_correction.mode
CORRECTION_LEVELS = ("token", "sequence")  # losses that weigh by pi_old / pi_rollout themselves
RouterReplay = Annotated[str, Literal["none", "rollout", "old_policy"]]  # actor.moe.router_replay
PLACEMENTS, CORRECTION_MODES, ROUTER_REPLAY = (choices_of(t) for t in (Placement, CorrectionMode, RouterReplay))


@dataclass
class RolloutConfig:
    engine: str = "native"  # native (asyncrl.rollout.engine) or vllm (asyncrl.rollout.vllm_engine)
    n: int = 8  # samples per prompt
    temperature: float = 1.0  # sampling temperature of training rollouts (the log-probs use it too)
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = 0  # 0 = off
    max_tokens: int = 6  # the generation budget; also Dr.GRPO's constant length normaliser
    # generation model parallelism (HybridFlow's pg, tg); must divide actor.parallel's pp, tp
    parallel: GenerationParallelConfig = field(default_factory=GenerationParallelConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    # asynchronous RL: generation may run up to max_staleness policy versions ahead of training
    # (0 = synchronous: each batch is generated by the policy that trains on it)
    max_staleness: int = 0
    # synchronous on one pool: the next step's generation is sent with this step's last update and
    # runs right after it on every rank (no driver round trip between steps; the same samples)
    launch_next_early: bool = True
    n_workers: int = 1  # the rollout pool's workers (devices) with trainer.placement=split
    interrupt_on_update: bool = False  # split: load new weights between decode steps, not only between batches
    # split: rollout workers may leave (a lost worker's prompts are generated again elsewhere) and
    # join (`asyncrl-launch --join HEAD:PORT` on a new node), pulling the current weights by version
    elastic: bool = False
    min_workers: int = 1  # elastic: below this many live rollout workers a step waits for one to join
    min_workers_wait_s: float = 600.0  # ... this long, then the run ends saying so
    sync_bucket_mb: int = 64  # split: the weight broadcast's bucket size
    # split: each update whole, or as each tensor's difference from the last version sent (XOR or
    # changed elements, zstd, a checksum each; a mismatch falls back to a full sync, logged). Split
    # placement: FSDP ranks send their own shards' deltas, a gathering layout's (tensor parallel) rank 0
    # each gathered tensor's, keeping a host copy of what it sent; the push is not overlapped with the
    # next step (it encodes, then sends); the elastic pool's workers pull deltas where they hold the version before. Deltas pay
    # off on links slower than the codec: 2 cores encode and apply ~0.5 GB/s (faster than 1 Gbit/s, slower
    # than 10: docs/results/2026-11-28-node-copies.md)
    weight_sync: WeightSync = "full"
    # native engine: rows a worker decodes together, the KV cache it holds (colocated: a call's
    # prompts in waves of decode_slots / n; split: the continuous batch's slots); 0 = every row
    # of a call (split: of one batch on one rollout worker)
    decode_slots: int = 0
    # native engine: each decode step eager, or compiled once per (rows, cache width) over a preallocated
    # KV cache (inductor, no CUDA graphs; colocated: "all rows done?" read back every 8 steps; split: the
    # continuous batch's cache, twice its longest row, its columns moved left in place when full). Compiling
    # takes seconds (CPU: ~10 s tiny, ~35 s at 0.5B) and pays off on a GPU, where the eager step waits on
    # kernel launches; on CPU (oneDNN-packed linears, attention by matmuls, the prefill without padding)
    # it is ~2.1x eager at 0.5B x 32 rows (docs/results/2026-11-29-compiled-decode-cpu.md)
    decode: Decode = "eager"
    # trajectories of several turns with an environment (tools, games): asyncrl.agents
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    def check(self, at: str) -> None:
        _one_of(at + "engine", self.engine, tuple(rollout_engines()))
        _positive(at + "max_staleness", self.max_staleness, allow_zero=True)
        _positive(at + "n_workers", self.n_workers)
        _positive(at + "min_workers", self.min_workers)
        _positive(at + "min_workers_wait_s", self.min_workers_wait_s)
        _positive(at + "sync_bucket_mb", self.sync_bucket_mb)
        _positive(at + "decode_slots", self.decode_slots, allow_zero=True)
        _positive(at + "n", self.n)
        _positive(at + "temperature", self.temperature, allow_zero=True)
        _check(0 < self.top_p <= 1, at + "top_p", self.top_p, "must be in (0, 1]")
        _positive(at + "top_k", self.top_k, allow_zero=True)
        _positive(at + "max_tokens", self.max_tokens)
        if self.multi_turn.enable:  # a TP group's ranks would have to decode the same waves in lock step
            _check(self.parallel.tp == 1, at + "multi_turn.enable", True,
                   f"multi-turn rollouts need {at}parallel.tp=1 (each rank runs its own trajectories); "
                   f"got tp={self.parallel.tp}")


@dataclass
class PPOUpdateConfig:
    """The epoch × mini-batch × micro-batch loop shared by the actor and the critic."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = 1  # passes over each step's batch
    ppo_mini_batches: int = 1  # optimizer steps per pass (the batch split into this many mini-batches)
    micro_batch_size: int = 64  # rows per forward/backward (gradient accumulation over them)
    # > 0: micro-batches by tokens instead (verl's ppo_max_token_len_per_gpu): rows sorted by
    # length and packed so that rows x the longest row (padding counted) stays within it, at most
    # micro_batch_size rows each; the loss is weighted to equal one pass over the mini-batch.
    # -1 (the actor's): each worker sizes it from the memory estimate (asyncrl.plan.memory) to fill
    # 85 % of its device (a GPU, or its share of a CPU node's memory), logged as it starts
    max_tokens_per_micro_batch: int = 0
    # each micro-batch's rows as one packed row, no padding computed (asyncrl.train.packing):
    # null = wherever the model has a varlen path (FSDP2 without pipeline stages), true = required
    pack_sequences: bool | None = None
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    shuffle: bool = True  # shuffle rows into mini-batches
    loss_agg_mode: LossAggMode = "token-mean"  # the loss's mean over every token, or per sequence then over sequences
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # this model's training layout

    def check(self, at: str) -> None:
        _positive(at + "ppo_epochs", self.ppo_epochs)
        _positive(at + "ppo_mini_batches", self.ppo_mini_batches)
        _positive(at + "micro_batch_size", self.micro_batch_size)
        _check(self.max_tokens_per_micro_batch >= FILL_TOKEN_BUDGET, at + "max_tokens_per_micro_batch",
               self.max_tokens_per_micro_batch, "must be > 0 (a token budget), 0 (micro-batches by rows) or -1 "
               "(the actor's: sized from the memory estimate)")
        _check(not self.max_tokens_per_micro_batch or self.parallel.pp == 1, at + "max_tokens_per_micro_batch",
               self.max_tokens_per_micro_batch, f"needs {at}parallel.pp=1 (pipeline stages exchange activations "
               "of one shape, so their micro-batches are rows); set it to 0")
        _check(self.pack_sequences is not True or self.parallel.pp == 1, at + "pack_sequences", True,
               f"needs {at}parallel.pp=1 (pipeline stages exchange activations of one padded shape); "
               "set it to null or false")
        if self.parallel.sp > 1:
            sp = at + "parallel.sp"
            _check(self.pack_sequences is not False, sp, self.parallel.sp,
                   f"Ulysses shards packed micro-batches; set {at}pack_sequences to null or true, or sp=1")
            _check(self.parallel.pp == 1, sp, self.parallel.sp,
                   f"runs without pipeline stages; set {at}parallel.pp=1 or sp=1")


def _check_lora_layout(section: ActorConfig | CriticConfig, at: str) -> None:
    """LoRA trains over FSDP alone for now (the adapters' merge and gathers assume whole layers)."""
    if section.lora.enabled:
        _check(section.parallel.tp == 1 and section.parallel.pp == 1, at + "lora.rank", section.lora.rank,
               f"LoRA trains with {at}parallel.tp=1 and pp=1 for now (FSDP over every rank); "
               f"got tp={section.parallel.tp}, pp={section.parallel.pp}")


def _those(key: str, capability: str) -> str:
    """`key=name` for each training backend that has `capability` ("key=a or key=b"), for a message."""
    return " or ".join(f"{key}={name}" for name, b in backends().items() if getattr(b, capability)) or "none"


def _check_backend(section: ActorConfig | CriticConfig, at: str) -> None:
    """What the section's backend (asyncrl.engines) does not run: each a paragraph naming the key."""
    _one_of(at + "backend", section.backend, tuple(backends()))
    b, name = backend(section.backend), section.backend
    _check(b.lora or not section.lora.enabled, at + "lora.rank", section.lora.rank,
           f"LoRA does not train on {at}backend={name}; set {at}lora.rank=0 or {_those(at + 'backend', 'lora')}")
    _check(b.sequence_parallel or section.parallel.sp == 1, at + "parallel.sp", section.parallel.sp,
           f"Ulysses sequence parallelism does not run on {at}backend={name} (megatron's context parallelism is not "
           f"wired); set sp=1 or {_those(at + 'backend', 'sequence_parallel')}")
    _check(b.packing or section.pack_sequences is not True, at + "pack_sequences", True,
           f"packed sequences do not run on {at}backend={name} (its micro-batches are padded; it trims their "
           f"padding columns); set it to null or false, or {_those(at + 'backend', 'packing')}")


@dataclass
class LoRAConfig:
    """LoRA adapters on the actor or the critic (asyncrl/train/lora.py): only they train (and the
    critic's value head), the actor's reference policy is the base with them switched off (no
    second copy), generation uses W0 + (alpha / rank) B A or vLLM's adapters (rollout.vllm.lora).
    LoRA wants a higher learning rate than full fine-tuning: ~10x on real models; the tiny tool
    task learns at 3-5x and diverges at 10-20x (benchmarks/lora.py)."""

    rank: int = 0  # 0 = off (full fine-tuning)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    # leaf names to adapt (q_proj ... down_proj for Llama/Qwen), all-linear (every linear layer but
    # the LM head), embed_tokens (the input embedding, and the LM head tied to it) or an untied
    # lm_head. An adapted embedding moves what full fine-tuning moves most on a small vocabulary;
    # vLLM's adapters cover linear layers only: it then needs colocated placement or the native engine.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # LoRA-FA: A keeps its random draw and only B trains (half the optimizer state); the update is
    # then linear in B, which keeps GRPO from sharpening a policy it must build early (benchmarks/lora.py)
    freeze_a: bool = False

    def check(self, at: str) -> None:
        _positive(at + "rank", self.rank, allow_zero=True)
        _positive(at + "alpha", self.alpha)
        _check(0 <= self.dropout < 1, at + "dropout", self.dropout, "must be in [0, 1)")
        _check(bool(self.target_modules), at + "target_modules", self.target_modules,
               "name at least one module (or all-linear)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def adapts_embeddings(self) -> bool:
        """Whether an embedding matrix (input or output) is adapted: vLLM's adapters cannot serve it."""
        return self.enabled and bool(set(self.target_modules) & {*INPUT_EMBEDDINGS, "lm_head"})


@dataclass
class MoEConfig:
    """Mixture-of-experts actors (asyncrl/train/moe.py): routing replay and the router's losses;
    a dense model refuses router_replay and ignores the rest."""

    # none; rollout: the log-prob and update passes route each token to the experts the rollout
    # engine chose (R3; the native engine records them); old_policy: the update routes as the
    # old-policy log-prob pass did. The gate weights always come from the live router.
    router_replay: RouterReplay = "none"
    # the Switch load-balancing loss (1.0 when balanced) and ST-MoE's router z-loss, added to the
    # policy loss with these weights; both are logged every step either way. Off by default: a
    # balancing push moves routing away from what the rollout engine sampled with.
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0  # the router z-loss's weight (see aux_loss_coef)
    # keep the routers' weights as loaded (backend=fsdp2): the policy moves its experts, not which
    # expert a token goes to
    freeze_router: bool = False
    # expert parallelism (backend=megatron): each of ep data-parallel ranks holds experts/ep whole
    # experts, tokens reach them through megatron's all-gather dispatcher
    ep: int = 1

    def check(self, at: str) -> None:
        _positive(at + "ep", self.ep)
        _positive(at + "aux_loss_coef", self.aux_loss_coef, allow_zero=True)
        _positive(at + "z_loss_coef", self.z_loss_coef, allow_zero=True)


@dataclass
class GSPOConfig:
    """GSPO's clip range on the length-normalised sequence ratio (the paper's 3e-4 / 4e-4)."""

    clip_low: float = 3e-4  # the sequence ratio's clip below 1 (GSPO's epsilon_low)
    clip_high: float = 4e-4  # its clip above 1

    def check(self, at: str) -> None:
        _positive(at + "clip_low", self.clip_low)
        _positive(at + "clip_high", self.clip_high)


@dataclass
class CISPOConfig:
    """CISPO's bounds on the detached importance weight (absolute; no lower clip by default)."""

    weight_low: float = 0.0  # floor of the detached importance weight (0: none)
    weight_high: float = 4.0  # its cap

    def check(self, at: str) -> None:
        _positive(at + "weight_low", self.weight_low, allow_zero=True)
        _check(self.weight_high > max(1.0, self.weight_low), at + "weight_high", self.weight_high,
               f"must be > 1 and > {at}weight_low")


@dataclass
class CovConfig:
    """Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs")."""

    clip_ratio: float = 2e-4  # clip_cov: share of tokens whose gradient is detached
    clip_low: float = 1.0  # clip_cov: the covariance band they are drawn from
    clip_high: float = 5.0  # clip_cov: the band's upper bound
    kl_ratio: float = 2e-3  # kl_cov: share of tokens (largest covariance) given the KL penalty
    kl_coef: float = 1.0  # kl_cov: the penalty's weight

    def check(self, at: str) -> None:
        for name in ("clip_ratio", "kl_ratio"):
            _check(0 < getattr(self, name) <= 1, at + name, getattr(self, name), "must be in (0, 1]")
        _check(self.clip_high > self.clip_low, at + "clip_high", self.clip_high, f"must be > {at}clip_low")
        _positive(at + "kl_coef", self.kl_coef, allow_zero=True)


# each mode's (level, low, high) when left null; from the papers (docs/algorithms.md)
CORRECTION_DEFAULTS = {"tis": ("token", 0.0, 2.0), "mis": ("token", 0.0, 2.0), "icepop": ("token", 0.5, 5.0),
                       "geo_mask": ("sequence", 0.999, 1.001)}


@dataclass
class RolloutCorrectionConfig:
    """Importance correction for the rollout engine sampling from a slightly different policy than
    the trainer's (r = pi_trainer / pi_rollout per token; docs/algorithms.md#rollout-correction)."""

    mode: CorrectionMode = "none"
    level: str | None = None  # token | sequence (tis, mis); null = the mode's
    low: float | None = None  # the ratio band kept (mis, icepop, geo_mask); null = the mode's
    high: float | None = None  # tis: the weight cap; the others: the band's top

    def check(self, at: str) -> None:
        if self.mode == "none":
            for name in ("level", "low", "high"):
                _check(getattr(self, name) is None, at + name, getattr(self, name),
                       f"has no effect while {at}mode=none; set the mode (tis, mis, icepop, geo_mask) or drop it")
            return
        if self.level is not None:
            _one_of(at + "level", self.level, CORRECTION_LEVELS)
        fixed = {"icepop": "token", "geo_mask": "sequence"}.get(self.mode)
        _check(fixed is None or self.level in (None, fixed), at + "level", self.level,
               f"{self.mode} is defined at {fixed} level; leave it null")
        level, low, high = self.resolved()
        _check(0 <= low <= 1 <= high and low < high, at + "high" if self.high is not None else at + "low",
               f"[{low}, {high}]", "the kept ratio band must contain 1 (0 <= low <= 1 <= high, low < high)")

    def resolved(self) -> tuple[str, float, float]:
        """(level, low, high) with the mode's defaults filled in."""
        level, low, high = CORRECTION_DEFAULTS[self.mode]
        return (self.level or level, low if self.low is None else self.low, high if self.high is None else self.high)


@dataclass
class ActorConfig(PPOUpdateConfig):
    log_prob_micro_batch_size: int = 128  # rows per forward-only pass (old and reference log-probs)
    log_prob_max_tokens_per_micro_batch: int = 0  # > 0: the log-prob passes' micro-batches by tokens
    # auto: only when off-policy (ppo_epochs or ppo_mini_batches > 1)
    recompute_log_prob: Annotated[str, Literal["auto", "always", "never"]] = "auto"
    clip_ratio: float = 0.2  # PPO's clip of the probability ratio, both sides
    clip_ratio_low: float | None = None  # None = clip_ratio
    clip_ratio_high: float | None = None  # None = clip_ratio (DAPO's clip-higher sets it above)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    entropy_coeff: float = 0.0  # weight of the entropy bonus in the loss
    use_kl_loss: bool = False  # GRPO-style KL term in the loss
    kl_loss_coef: float = 0.001  # weight of the KL to the reference policy (use_kl_loss)
    kl_loss_type: KLType = "low_var_kl"  # k1 (kl), k2 (mse), k3 (low_var_kl), abs
    pretrain_coef: float = 0.0  # weight of the SFT loss step (Safe-RLHF's ptx term)
    # ppo: PPO against the old policy; decoupled: AReaL's decoupled PPO (clip around the
    # proximal policy, importance weight to the behaviour policy that sampled); tis: PPO with
    # truncated importance sampling to the behaviour policy. For rollout.max_staleness > 0.
    # gspo, cispo, clip_cov, kl_cov: the losses of 2025 (docs/algorithms.md#policy-losses)
    policy_loss: str = "ppo"
    behav_imp_weight_cap: float = 5.0  # decoupled: tokens above it are dropped; tis: weights clipped to it
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    cov: CovConfig = field(default_factory=CovConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters instead of full fine-tuning (rank > 0)
    moe: MoEConfig = field(default_factory=MoEConfig)  # routing replay and router losses (MoE models)
    freeze_vision: bool = False  # a vision-language model's vision tower (and its merger) stays as loaded
    # fsdp2: FSDP2 x DTensor TP (x pipeline stages); megatron: megatron-core's GPTModel, TP x DP with
    # its distributed optimizer (docs/megatron.md); the reference policy runs on the same backend
    backend: str = "fsdp2"
    # optimizer: AdamW's moments in host memory except while the optimizer steps or a checkpoint
    # reads them (asyncrl.train.offload): the forward, backward and generation run without them;
    # all: besides, the actor's and the reference's weight shards while the rollout generates
    offload: Annotated[str, Literal["none", "optimizer", "all"]] = "none"

    def check(self, at: str) -> None:
        super().check(at)
        self.lora.check(at + "lora.")
        _one_of(at + "offload", self.offload, ("none", "optimizer", "all"))
        _check(self.offload == "none" or backend(self.backend).offload, at + "offload", self.offload,
               f"the optimizer's state does not move to host memory on {at}backend={self.backend} yet; set "
               f"{at}offload=none or {_those(at + 'backend', 'offload')}")
        _check(self.offload != "all" or backend(self.backend).offload_weights, at + "offload", self.offload,
               f"the weights do not move to host memory on {at}backend={self.backend} yet; set {at}offload=optimizer "
               f"or {_those(at + 'backend', 'offload_weights')}")
        _check(self.offload != "all" or not self.lora.enabled, at + "offload", self.offload,
               "LoRA's frozen base is read while the rollout generates (adapters merged or served): set "
               f"{at}offload=optimizer (the adapters' optimizer state is small anyway)")
        self.moe.check(at + "moe.")
        _check_lora_layout(self, at)
        _check_backend(self, at)
        _check(self.moe.router_replay == "none" or self.parallel.pp == 1, at + "moe.router_replay",
               self.moe.router_replay, f"needs {at}parallel.pp=1 (a pipeline interleaves micro-batches, so a "
               "stage would replay another micro-batch's experts); set it to none or pp=1")
        _one_of(at + "policy_loss", self.policy_loss, tuple(policy_losses()))
        self.gspo.check(at + "gspo.")
        self.cispo.check(at + "cispo.")
        self.cov.check(at + "cov.")
        self.rollout_correction.check(at + "rollout_correction.")
        _check(self.policy_loss != "gspo" or self.loss_agg_mode == "seq-mean-token-mean", at + "loss_agg_mode",
               self.loss_agg_mode, f"{at}policy_loss=gspo is a sequence-level objective: it is defined with "
               "seq-mean-token-mean (each sequence's tokens averaged, then the sequences); set "
               f"{at}loss_agg_mode=seq-mean-token-mean (configs/gspo.yaml does)")
        _check(self.rollout_correction.mode == "none" or not is_behaviour_loss(self.policy_loss),
               at + "rollout_correction.mode", self.rollout_correction.mode,
               f"{at}policy_loss={self.policy_loss} already weighs tokens by pi_old / pi_rollout; use one of the "
               f"two: {at}policy_loss=ppo with the correction, or the correction off")
        _check(self.behav_imp_weight_cap > 1, at + "behav_imp_weight_cap", self.behav_imp_weight_cap,
               "must be > 1 (the largest pi_old / pi_behaviour ratio a token may carry)")
        _check(not is_behaviour_loss(self.policy_loss) or self.recompute_log_prob != "never", at + "recompute_log_prob",
               self.recompute_log_prob, f"must not be never with {at}policy_loss={self.policy_loss}: it needs "
               "the current policy's log-probs before the update (the proximal/old policy)")
        _positive(at + "log_prob_micro_batch_size", self.log_prob_micro_batch_size)
        _positive(at + "log_prob_max_tokens_per_micro_batch", self.log_prob_max_tokens_per_micro_batch, allow_zero=True)
        _check(not self.log_prob_max_tokens_per_micro_batch or self.parallel.pp == 1,
               at + "log_prob_max_tokens_per_micro_batch", self.log_prob_max_tokens_per_micro_batch,
               f"needs {at}parallel.pp=1; set it to 0")
        _positive(at + "clip_ratio", self.clip_ratio)
        _check(self.clip_ratio_c > 1, at + "clip_ratio_c", self.clip_ratio_c, "must be > 1")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if getattr(self, name) is not None:
                _positive(at + name, getattr(self, name), allow_zero=True)
        _positive(at + "entropy_coeff", self.entropy_coeff, allow_zero=True)
        _positive(at + "kl_loss_coef", self.kl_loss_coef, allow_zero=True)
        _positive(at + "pretrain_coef", self.pretrain_coef, allow_zero=True)

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def recompute_old_log_probs(self) -> bool:
        """Whether old log-probs need a forward pass of their own (only when off-policy, or for
        a loss that compares them with the behaviour policy's)."""
        if self.recompute_log_prob == "auto":
            return self.ppo_epochs > 1 or self.ppo_mini_batches > 1 or is_behaviour_loss(self.policy_loss)
        return self.recompute_log_prob == "always"


@dataclass
class CriticConfig(PPOUpdateConfig):
    model_path: str | None = None  # None = the actor's model with a fresh value head
    cliprange_value: float = 0.5  # PPO's clip of the new values around the old ones
    # adapters on the value model's body (rank > 0); its fresh value head trains in full
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    backend: str = "fsdp2"  # fsdp2 | megatron (the body as a megatron-core GPTModel, the head replicated)

    def check(self, at: str) -> None:
        super().check(at)
        _positive(at + "cliprange_value", self.cliprange_value)
        self.lora.check(at + "lora.")
        _check_lora_layout(self, at)
        _check_backend(self, at)


@dataclass
class RewardConfig:
    fn: str | None = None  # None = by data_source (gsm8k, synthetic, exact match); or module:fn / file.py:fn
    cost_fn: str | None = None  # Safe-RLHF rule cost, same signature
    # reward.fn takes the whole batch: fn(data_sources, solution_strs, ground_truths, extra_infos) -> list
    batched: bool = False
    # a learned reward model as the reward: a sequence-classification model directory (or a causal
    # LM whose fresh one-output head is then trained nowhere: for tests); scores (prompt,
    # response) at the last real token, micro-batches of cost_model.micro_batch_size
    model_path: str | None = None
    # DAPO's soft overlong punishment: a response longer than rollout.max_tokens - overlong_buffer
    # loses penalty_factor x (its excess / overlong_buffer), reaching -penalty_factor at the cap; 0 = off
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0  # the overlong penalty at the cap (see overlong_buffer)

    def check(self, at: str) -> None:
        _check(not (self.model_path and (self.fn or self.batched)), at + "model_path", self.model_path,
               f"replaces the rule reward; remove {at}fn / {at}batched (or {at}model_path)")
        _check(not self.batched or bool(self.fn), at + "batched", self.batched,
               "needs reward.fn (the built-in rewards score one response at a time); set reward.fn=module:fn")
        _positive(at + "overlong_buffer", self.overlong_buffer, allow_zero=True)
        _positive(at + "overlong_penalty_factor", self.overlong_penalty_factor, allow_zero=True)


@dataclass
class CostModelConfig:
    enable: bool = False  # a sequence-classification cost model instead of reward.cost_fn
    path: str | None = None  # None = the actor's model with a fresh head
    micro_batch_size: int = 16  # rows per scoring pass

    def check(self, at: str) -> None:
        _positive(at + "micro_batch_size", self.micro_batch_size)


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (algorithm.name=opd): a frozen policy that scores the
    student's sampled tokens; each token's reward is kl_coef * (log pi_teacher - log pi_student)."""

    path: str | None = None  # a causal LM with the student's tokenizer
    n_workers: int = 0  # 0: on the actor's pool (colocated); > 0: a pool of its own
    backend: str = "fsdp2"  # a training backend (asyncrl.engines) that builds forward-only teacher engines
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # its layout over the teacher's workers
    micro_batch_size: int = 64  # rows per forward
    kl_coef: float = 1.0  # weight of the per-token reverse-KL reward
    task_reward_coef: float = 0.0  # > 0: plus this times GRPO's advantage of the task reward

    def check(self, at: str) -> None:
        _positive(at + "n_workers", self.n_workers, allow_zero=True)
        _one_of(at + "backend", self.backend, tuple(backends()))
        _check(backend(self.backend).teacher_engine is not None, at + "backend", self.backend,
               f"{at}backend={self.backend} builds no teacher engine; use {_those(at + 'backend', 'teacher_engine')}")
        _positive(at + "micro_batch_size", self.micro_batch_size)
        _positive(at + "kl_coef", self.kl_coef)
        _positive(at + "task_reward_coef", self.task_reward_coef, allow_zero=True)


@dataclass
class KLControllerConfig:
    type: Annotated[str, Literal["fixed", "adaptive"]] = "fixed"
    kl_coef: float = 0.001  # the reward's KL penalty weight (adaptive: its start)
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only

    def check(self, at: str) -> None:
        _positive(at + "kl_coef", self.kl_coef, allow_zero=True)
        _positive(at + "horizon", self.horizon)
        _positive(at + "target_kl", self.target_kl)


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (grpo and rloo): a prompt whose n samples all score the same teaches
    nothing (its advantages are 0), so its group is dropped and more prompts are sampled until the
    step has data.batch_size prompts whose samples differ."""

    enable: bool = False  # drop groups whose samples all score the same, sample more prompts
    metric: str = "score"  # the reward's score, or a key of a dict-returning reward (e.g. acc)
    # generation batches per step at most (0 = no limit); when they run out, the step is filled
    # with groups that were dropped (their advantages are 0) and dynamic/flat_groups says how many
    max_num_gen_batches: int = 10

    def check(self, at: str) -> None:
        _positive(at + "max_num_gen_batches", self.max_num_gen_batches, allow_zero=True)
        _check(bool(self.metric), at + "metric", self.metric, "must name the score or a reward key")


@dataclass
class SafeRLHFConfig:
    lagrange_init: float = 1.0  # the Lagrange multiplier on the cost at the start
    lagrange_lr: float = 0.1  # its step size: it grows while the mean cost is above cost_limit
    cost_limit: float = 0.0  # the mean cost the policy is held to
    lagrange_max: float | None = None  # its cap; None = none

    def check(self, at: str) -> None:
        _positive(at + "lagrange_init", self.lagrange_init)
        _positive(at + "lagrange_lr", self.lagrange_lr, allow_zero=True)
        if self.lagrange_max is not None:
            _check(self.lagrange_max >= self.lagrange_init, at + "lagrange_max", self.lagrange_max,
                   f"must be >= {at}lagrange_init={self.lagrange_init}")


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # the step (asyncrl/algorithms/registry.py): ppo | grpo | rloo | reinforce_pp | remax | safe_rlhf | opd
    estimator: Annotated[str, Literal["grpo", "drgrpo"]] = "grpo"  # for name=grpo
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE's lambda
    norm_adv_by_std: bool = True  # GRPO: divide each group's advantages by its standard deviation
    use_kl_in_reward: bool = False  # subtract a KL to the reference policy from the reward (kl_ctrl)
    kl_penalty: KLType = "kl"  # the KL estimator in the reward
    kl_ctrl: KLControllerConfig = field(default_factory=KLControllerConfig)
    safe: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)

    def check(self, at: str) -> None:
        _one_of(at + "name", self.name, tuple(algorithms()))
        _check(0 <= self.gamma <= 1, at + "gamma", self.gamma, "must be in [0, 1]")
        _check(0 <= self.lam <= 1, at + "lam", self.lam, "must be in [0, 1]")


PlanSearch = Annotated[str, Literal["auto", "hybridflow", "mcmc", "exhaustive"]]
PLAN_SEARCHES = choices_of(PlanSearch)


@dataclass
class PlanConfig:
    """`asyncrl-plan` only (`asyncrl-launch` ignores it): the devices a plan is for and how to search."""

    # h100 | h200 | a100 | cpu (measured by `asyncrl-plan profile`) | a profile JSON file;
    # auto: this machine's GPU, h100 for a cluster.gpus_per_node plan made without one, else cpu
    device: str = "auto"
    search: PlanSearch = "auto"  # auto: exhaustive on small spaces, else hybridflow refined by mcmc
    time_limit_s: float = 10.0  # the search's time budget
    runners_up: int = 3  # plans printed after the best
    seed: int = 0  # the MCMC search's seed
    # the lengths a batch trains at (its longest prompt and response after padding is trimmed);
    # 0 = the caps, data.max_prompt_len and rollout.max_tokens
    prompt_len: int = 0
    response_len: int = 0  # see prompt_len
    # a node's host memory, where actor.offload's state waits (GiB); 0: the profile's (DGX: 2 TB for h100/h200)
    host_memory_gib: float = 0.0

    def check(self, at: str) -> None:
        _positive(at + "prompt_len", self.prompt_len, allow_zero=True)
        _positive(at + "host_memory_gib", self.host_memory_gib, allow_zero=True)
        _positive(at + "response_len", self.response_len, allow_zero=True)
        _positive(at + "time_limit_s", self.time_limit_s)
        _positive(at + "runners_up", self.runners_up, allow_zero=True)


TrainerMode = Annotated[str, Literal["train", "eval", "replay"]]
TRAINER_MODES = choices_of(TrainerMode)
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


@dataclass
class EvaluationConfig:
    """`trainer.mode=eval` (`--config-name eval`): rollout.n samples per held-out prompt at
    rollout.temperature, scored by the reward; pass@k and mean@n per data_source."""

    ks: list[int] = field(default_factory=lambda: [1])  # each k <= rollout.n
    correct_at: float = 1.0  # a sample counts as correct for pass@k when its score is at least this
    write_generations: bool = True  # every sample to trainer.output_dir/eval-<time>.jsonl

    def check(self, at: str) -> None:
        for k in self.ks:
            _check(isinstance(k, int) and k >= 1, at + "ks", self.ks, "must be positive integers")


@dataclass
class ReplayConfig:
    """Replay bundles: each training step's update as it ran (the actor's rows, the random
    states, the result), so `asyncrl replay RUN_DIR --step N` re-runs it and says whether the loss,
    gradient norm and weights come out bit for bit the same."""

    window: int = 0  # keep the last this many steps' bundles (0: off, nothing is recorded)
    max_mb: int = 1024  # the bundles' disk budget on each training rank (the oldest step goes first)
    # trainer.mode=replay (`asyncrl replay` sets these): the step to re-run, its log-prob pass
    # recomputed and compared too, the first non-finite activation named (its layer and micro-batch)
    step: int = 0
    log_probs: bool = False
    nonfinite: bool = False
    plant_nan: str = ""  # MODULE@MICRO_BATCH: NaN into that module's output on the replay (tests the finder)

    def check(self, at: str) -> None:
        _positive(at + "window", self.window, allow_zero=True)
        _positive(at + "max_mb", self.max_mb)
        _positive(at + "step", self.step, allow_zero=True)
        _check(not self.plant_nan or "@" in self.plant_nan, at + "plant_nan", self.plant_nan,
               "names MODULE@MICRO_BATCH, e.g. model.layers.1.mlp@0")

    def check_mode(self, at: str, mode: str) -> None:
        """The step and checks belong to a replay (`asyncrl replay`), which names a step."""
        asked = self.step or self.log_probs or self.nonfinite or self.plant_nan
        _check(mode == "replay" or not asked, at + "step", self.step,
               "is for trainer.mode=replay (`asyncrl replay RUN_DIR --step N` sets it)")
        _check(mode != "replay" or self.step >= 1, at + "step", self.step, "trainer.mode=replay re-runs a step >= 1")


@dataclass
class FailoverConfig:
    """A training rank lost mid-run without restarting the job: each step's end is kept twice
    (every rank's own state, and a copy in its ring neighbour's memory); when a rank dies, a
    replacement starts, every rank rebuilds its engines on a new process group, takes the kept
    state back, and the step runs again (asyncrl.train.failover, docs/cluster.md)."""

    enable: bool = False
    max_failovers: int = 3  # in one launch; beyond, the run fails (or trainer.max_restarts restarts it)

    def check(self, at: str) -> None:
        _positive(at + "max_failovers", self.max_failovers)


@dataclass
class TrainerConfig:
    n_workers: int = 2  # worker processes (devices) for the colocated actor/rollout/ref/critic/reward
    total_steps: int = 200  # training steps of the run
    eval_every: int = 25  # held-out evaluation every this many steps (and at step 0 and the end)
    save_every: int = 50  # a checkpoint every this many steps (and at the end)
    keep_checkpoints: int = 2  # the newest complete checkpoints kept; older ones asyncrl wrote are removed
    # write the sharded training state (dcp/) in a background thread while training goes on: the
    # state is first copied to host memory (one more copy of each rank's shard while it writes);
    # the checkpoint counts as complete once the write ends (at the next save, or the run's end)
    async_save: bool = False
    resume: str = "auto"  # auto | none | path/to/checkpoints/step_N
    # a worker dying mid-run: every worker of the job is restarted from the last complete
    # checkpoint, up to this many times in one launch (0 = the run ends, naming the worker)
    max_restarts: int = 0
    output_dir: str = "outputs/${job.name}"  # the run directory: metrics, checkpoints, logs, traces
    # where each step's metrics go: metrics.jsonl (jsonl, the run's record: resume, plots and
    # `asyncrl submit` read it, so it is required), the step line on the console, TensorBoard
    # (trainer.output_dir/tensorboard), Weights & Biases (pip install wandb; WANDB_MODE=offline
    # keeps it local, its files under trainer.output_dir/wandb)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project: str = "asyncrl"  # the wandb project (the run is named after job.name)
    torch_threads: int = 0  # per worker; 0 = the node's cores divided by its workers
    # colocated: every role on one pool of n_workers; split: training (actor, ref, critic) on n_workers
    # and generation on a pool of rollout.n_workers, weights broadcast between them
    placement: Placement = "colocated"
    overlap_weight_sync: bool = True  # split, rollout.max_staleness >= 1: the broadcast runs beside the next step
    mode: TrainerMode = "train"  # eval: no training, sample the held-out prompts, pass@k per data_source
    log_samples: int = 3  # held-out prompts whose completions each evaluation shows and saves (samples.jsonl)
    # training rollouts kept per step for reading later, each data source in turn, written as parquet by the
    # ranks that hold them every 10 steps and at each checkpoint (<output_dir>/rollouts); -1 = every row, 0 = none
    keep_rollouts: int = 32
    # steps (1-based) whose spans on the controller and every worker go to trace/step_N.json, a
    # Chrome trace-event file (ui.perfetto.dev, chrome://tracing): e.g. trainer.trace=[5,6]
    trace: list[int] = field(default_factory=list)
    # the step's bookkeeping every this many steps (1 = every step): the workers' peak memory and
    # bytes pulled across ranks (perf/peak_rss_gib, perf/*_cross_rank_mb), and on the first step
    stats_every: int = 10
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    failover: FailoverConfig = field(default_factory=FailoverConfig)

    def check(self, at: str) -> None:
        self.replay.check_mode(at + "replay.", self.mode)
        for step in self.trace:
            _check(isinstance(step, int) and 1 <= step, at + "trace", self.trace,
                   "lists steps to trace, each an int from 1 (the first step)")
        _positive(at + "stats_every", self.stats_every)
        for name in self.loggers:
            _one_of(at + "loggers", name, LOGGERS)
        _check(len(set(self.loggers)) == len(self.loggers), at + "loggers", self.loggers, "names a logger twice")
        _check("jsonl" in self.loggers, at + "loggers", self.loggers,
               "must keep jsonl: metrics.jsonl is the run's record (resume, the plots and `asyncrl submit` read it)")
        if "wandb" in self.loggers and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"bad configuration: {at}loggers names wandb but wandb is not installed here: "
                              f"pip install wandb (or drop it from {at}loggers)")
        _positive(at + "log_samples", self.log_samples, allow_zero=True)
        _check(self.keep_rollouts >= -1, at + "keep_rollouts", self.keep_rollouts,
               "is rows kept per step: 0 (none), N, or -1 (every row)")
        _positive(at + "n_workers", self.n_workers)
        _positive(at + "total_steps", self.total_steps)
        _positive(at + "eval_every", self.eval_every)
        _positive(at + "save_every", self.save_every)
        _positive(at + "keep_checkpoints", self.keep_checkpoints)
        _positive(at + "max_restarts", self.max_restarts, allow_zero=True)
        _positive(at + "torch_threads", self.torch_threads, allow_zero=True)


@dataclass
class RLConfig(LaunchConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    def _check_teacher(self, at: str) -> None:
        """A teacher where the algorithm distils, and nowhere else; its layout fits its pool."""
        wants = needs_teacher(self.algorithm.name)
        _check(not wants or bool(self.teacher.path), at + "teacher.path", self.teacher.path,
               f"algorithm.name={self.algorithm.name} distils from a teacher: set {at}teacher.path to its model")
        _check(wants or self.teacher.path is None, at + "teacher.path", self.teacher.path,
               f"only algorithm.name=opd uses a teacher (got {self.algorithm.name}); remove it")
        if wants:
            self._check_teacher_layout(at)
            _check(self.teacher.task_reward_coef == 0 or self.rollout.n >= 2, at + "rollout.n", self.rollout.n,
                   "teacher.task_reward_coef > 0 compares each prompt's samples (GRPO's advantage); set rollout.n >= 2")
            size = self.teacher.n_workers or self.trainer.n_workers
            try:
                ParallelLayout.from_config(self.teacher.parallel, size)
            except LayoutError as e:
                raise ConfigError(f"bad configuration: {at}teacher.{e} (its pool: {size} workers)") from None

    def _check_teacher_layout(self, at: str) -> None:
        """Pipeline stages where the teacher's backend runs them; a teacher on the actor's processes
        shares megatron-core's one parallel state per process with an actor on the same backend."""
        t, a = self.teacher.parallel, self.actor.parallel
        _check(t.pp == 1 or backend(self.teacher.backend).teacher_pipeline, at + "teacher.parallel.pp", t.pp,
               f"teacher.backend={self.teacher.backend} runs the teacher without pipeline stages; set it to 1, or "
               f"{_those(at + 'teacher.backend', 'teacher_pipeline')}")
        shared = (not self.teacher.n_workers and self.teacher.backend == self.actor.backend
                  and backend(self.teacher.backend).one_layout_per_process)
        if not shared:
            return
        _check((t.tp, t.pp) == (a.tp, a.pp), at + "teacher.parallel", f"tp={t.tp} pp={t.pp}",
               f"must equal {at}actor.parallel (tp={a.tp} pp={a.pp}): a teacher on the actor's workers shares "
               f"{self.actor.backend}'s one parallel layout per process; set the same tp and pp, or give the "
               f"teacher a pool of its own ({at}teacher.n_workers)")
        _check(self.actor.moe.ep == 1, at + "actor.moe.ep", self.actor.moe.ep,
               f"a teacher on the actor's workers runs without expert parallelism in the same {self.actor.backend} "
               f"parallel state; give the teacher a pool of its own ({at}teacher.n_workers), or set it to 1")

    def _check_token_budgets(self, at: str) -> None:
        """A row is never split across micro-batches: every token budget holds the longest row."""
        longest = self.data.max_prompt_len + self.rollout.max_tokens
        budgets = {"actor.max_tokens_per_micro_batch": self.actor.max_tokens_per_micro_batch,
                   "actor.log_prob_max_tokens_per_micro_batch": self.actor.log_prob_max_tokens_per_micro_batch,
                   "critic.max_tokens_per_micro_batch": self.critic.max_tokens_per_micro_batch}
        _check(self.critic.max_tokens_per_micro_batch != FILL_TOKEN_BUDGET, at + "critic.max_tokens_per_micro_batch",
               FILL_TOKEN_BUDGET, "-1 (a budget sized from the memory estimate) is the actor's alone; give the critic "
               "a token budget, or 0 (micro-batches by rows)")
        for key, budget in budgets.items():
            _check(budget in (0, FILL_TOKEN_BUDGET) or budget >= longest, at + key, budget,
                   f"a row can reach data.max_prompt_len + rollout.max_tokens = {longest} tokens and a row is "
                   f"never split across micro-batches; raise {key} to at least {longest} (or to 0: micro-batches "
                   "by rows)")

    def check(self, at: str) -> None:
        super().check(at)
        if self.algorithm.name != "grpo" and self.algorithm.estimator != "grpo":
            raise ConfigError(f"bad configuration: {at}algorithm.estimator={self.algorithm.estimator!r} only "
                              f"applies to algorithm.name=grpo (got {self.algorithm.name!r}); remove it")
        self._check_layouts(at)
        self._check_placement(at)
        self._check_backends(at)
        self._check_router_replay(at)
        self._check_expert_generation(at)
        self._check_token_budgets(at)
        self._check_teacher(at)
        self._check_failover(at)
        training = self.trainer.mode != "eval"  # an evaluation samples and scores only: n=1 and any batch do
        if training and self.rollout.n < 2 and (self.algorithm.name in ("grpo", "rloo")):
            raise ConfigError(f"bad configuration: {at}rollout.n={self.rollout.n}: {self.algorithm.name} compares "
                              "each prompt's samples with each other, so one sample per prompt gives zero "
                              "advantages; set rollout.n >= 2")
        if training:
            self._check_mini_batches(at)
        if self.algorithm.filter_groups.enable:
            fg = at + "algorithm.filter_groups.enable"
            _check(self.algorithm.name in ("grpo", "rloo"), fg, True,
                   f"dynamic sampling drops prompt groups; it applies to grpo and rloo, not {self.algorithm.name}")
            _check(self.rollout.max_staleness == 0, fg, True,
                   f"needs rollout.max_staleness=0 (refill batches are generated within the step); "
                   f"got {self.rollout.max_staleness}")
        self.data.check_val_only(at + "data.", self.trainer.mode)
        _check(self.reward.overlong_buffer < self.rollout.max_tokens, at + "reward.overlong_buffer",
               self.reward.overlong_buffer, f"must be below {at}rollout.max_tokens={self.rollout.max_tokens} (the "
               "penalty starts at max_tokens - overlong_buffer)")
        too_big = [k for k in self.evaluation.ks if k > self.rollout.n]
        _check(not too_big or self.trainer.mode != "eval", at + "evaluation.ks", self.evaluation.ks,
               f"pass@k needs k <= {at}rollout.n={self.rollout.n} samples per prompt; raise rollout.n or drop {too_big}")
        if self.cost_model.enable and self.reward.cost_fn:
            raise ConfigError(f"bad configuration: {at}cost_model.enable=true and {at}reward.cost_fn="
                              f"{self.reward.cost_fn!r} both produce the cost; set reward.cost_fn=null to use the "
                              "cost model (or cost_model.enable=false for the rule)")

    def _check_failover(self, at: str) -> None:
        """Failover rebuilds one colocated FSDP2 pool of data-parallel ranks whose only state is the
        actor's (and the reference policy's): what else a rank holds has no kept copy yet."""
        if not self.trainer.failover.enable:
            return
        a, key = self.actor.parallel, at + "trainer.failover.enable"
        why = {"trainer.placement=split (a rollout pool's ranks are another group: rollout.elastic survives them)":
               self.trainer.placement != "colocated",
               f"actor.backend={self.actor.backend} ({_those('actor.backend', 'failover')} only)":
               not backend(self.actor.backend).failover,
               f"actor.parallel tp={a.tp} pp={a.pp} sp={a.sp} (data parallel only: the mesh is rebuilt on one group)":
               (a.tp, a.pp, a.sp) != (1, 1, 1),
               f"rollout.engine={self.rollout.engine} (an engine that generates from the actor's weights only: "
               f"{' or '.join(f'rollout.engine={n}' for n, k in rollout_engines().items() if k.failover)})":
               not rollout_engine(self.rollout.engine).failover,
               f"rollout.max_staleness={self.rollout.max_staleness} (generation ahead of the step is not redone)":
               self.rollout.max_staleness > 0,
               "rollout.launch_next_early (the next step's generation would start before the step's end is kept)":
               self.rollout.launch_next_early,
               f"algorithm.name={self.algorithm.name}, which trains a critic (its state has no kept copy)":
               needs_critic(self.algorithm.name),
               "cost_model.enable (its worker's state has no kept copy)": self.cost_model.enable,
               "a teacher on the training pool": needs_teacher(self.algorithm.name) and not self.teacher.n_workers,
               "algorithm.filter_groups.enable (refill batches are drawn inside the step)":
               self.algorithm.filter_groups.enable,
               "actor.offload=optimizer (the kept state reads the optimizer's moments on the device)":
               self.actor.offload != "none"}
        refused = [k for k, bad in why.items() if bad]
        _check(not refused, key, True, "does not cover " + "; ".join(refused) + "; set it to false, or change those")

    def _check_backends(self, at: str) -> None:
        """megatron-core keeps one parallel state per process, and the critic's workers share the
        actor's processes."""
        a, c = self.actor.parallel, self.critic.parallel
        both = (self.actor.backend == self.critic.backend and backend(self.actor.backend).one_layout_per_process
                and needs_critic(self.algorithm.name))
        _check(not both or (a.tp, a.pp) == (c.tp, c.pp), at + "critic.parallel", f"tp={c.tp} pp={c.pp}",
               f"must equal {at}actor.parallel (tp={a.tp} pp={a.pp}) when both the actor and the critic run on "
               f"{self.actor.backend}, which keeps one parallel layout per process; set the same tp and pp, or "
               f"{at}critic.backend to another backend")

    def _check_router_replay(self, at: str) -> None:
        """router_replay=rollout needs an engine that records each token's experts: the native one,
        a call's rows decoded together (not the split pool's continuous batch, not agent turns)."""
        ep, par = self.actor.moe.ep, self.actor.parallel
        trains = backend(self.actor.backend)
        _check(ep == 1 or trains.expert_parallel, at + "actor.moe.ep", ep,
               f"expert parallelism runs on {_those(at + 'actor.backend', 'expert_parallel')} (FSDP2 shards experts "
               "with the rest); set it, or actor.moe.ep=1")
        _check(not self.actor.moe.freeze_router or trains.hf_routers, at + "actor.moe.freeze_router", True,
               f"freezes the Hugging Face routers, which {_those(at + 'actor.backend', 'hf_routers')} trains; "
               f"set it to false on {self.actor.backend}")
        dp = self.trainer.n_workers // (par.tp * par.pp) if self.trainer.placement == "colocated" else 0
        _check(ep == 1 or (dp and dp % ep == 0), at + "actor.moe.ep", ep,
               f"must divide the data-parallel ranks (trainer.n_workers / (tp x pp) = {dp}): experts are split "
               "over ep of them")
        mode, key = self.actor.moe.router_replay, at + "actor.moe.router_replay"
        if mode != "rollout":
            return
        _check(rollout_engine(self.rollout.engine).records_routes, key, mode,
               "needs a rollout engine that records each token's experts (rollout.engine=native); vLLM returns them only from its "
               "model runner V2 (enable_return_routed_experts, CUDA with Triton), which asyncrl does not drive "
               "yet: use the native engine, or router_replay=old_policy with vLLM")
        _check(not self.rollout.multi_turn.enable and self.trainer.placement == "colocated", key, mode,
               "records routes in a colocated, single-turn rollout (the split pool's continuous batch and agent "
               "turns do not record them yet): use trainer.placement=colocated without rollout.multi_turn, or "
               "router_replay=old_policy")

    def _check_expert_generation(self, at: str) -> None:
        """rollout.parallel.ep > 1: each rank generates with the experts it trains, in the native
        engine's eager decode, colocated, without generation TP."""
        ep, key = self.rollout.parallel.ep, at + "rollout.parallel.ep"
        _positive(key, ep)
        if ep == 1:
            return
        _check(rollout_engine(self.rollout.engine).expert_parallel, key, ep,
               "expert-parallel generation runs in the native engine: set rollout.engine=native, or ep=1")
        _check(self.trainer.placement == "colocated", key, ep, "generates with the experts the actor's ranks hold: "
               "set trainer.placement=colocated, or ep=1")
        _check(self.rollout.parallel.tp == 1 and self.rollout.decode == "eager", key, ep,
               f"runs with rollout.parallel.tp=1 and rollout.decode=eager (got tp={self.rollout.parallel.tp}, "
               f"decode={self.rollout.decode}): the ranks meet at every MoE layer, which a compiled step cannot")
        par, trains = self.actor.parallel, backend(self.actor.backend)
        split = self.actor.moe.ep if trains.expert_parallel else self.trainer.n_workers // (par.tp * par.pp)
        over = (f"{at}actor.moe.ep on {self.actor.backend}" if trains.expert_parallel
                else f"the data-parallel ranks on {self.actor.backend}, trainer.n_workers / (tp x pp)")
        _check(ep == split, key, ep, f"must equal the ranks the actor splits each MoE layer's experts over ({over} "
               f"= {split}): each rank generates with the experts it trains; set rollout.parallel.ep={split} or 1")

    def _check_placement(self, at: str) -> None:
        _check(backend(self.actor.backend).feeds_split_pool or self.trainer.placement == "colocated",
               at + "trainer.placement", self.trainer.placement, f"the weight sync between pools reads FSDP2 shards: "
               f"{at}actor.backend={self.actor.backend} runs with trainer.placement=colocated for now")
        _check(self.actor.offload != "all" or self.trainer.placement == "colocated", at + "actor.offload", "all",
               "moves the training weights out of the way of a rollout that shares their devices: set "
               "trainer.placement=colocated, or actor.offload=optimizer")
        """What a separate rollout pool can do: it holds a full replica (no generation TP) and
        receives whole weights (no pipeline stages to stitch)."""
        split, engine = self.trainer.placement == "split", rollout_engine(self.rollout.engine)
        _check(not (split and self.actor.lora.adapts_embeddings and not engine.merges_embedding_adapters_on_split_pool),
               at + "actor.lora.target_modules", self.actor.lora.target_modules,
               "vLLM's adapters cover linear layers only, and a split rollout pool's vLLM has no pristine base "
               "to merge an embedding's adapter into: drop embed_tokens/lm_head, use rollout.engine=native, "
               "or trainer.placement=colocated")
        _check(not (split and self.actor.lora.enabled and not engine.merges_adapters_on_split_pool
                    and self.rollout.vllm.lora == "merged"), at + "rollout.vllm.lora", "merged",
               "a split rollout pool's vLLM has no pristine base to merge LoRA adapters into: use "
               "rollout.vllm.lora=adapter (the default), or trainer.placement=colocated")
        _check(split or not self.rollout.elastic, at + "rollout.elastic", True,
               "an elastic rollout pool is a pool of its own: set trainer.placement=split")
        _check(self.rollout.weight_sync == "full" or split, at + "rollout.weight_sync", self.rollout.weight_sync,
               "deltas travel between a training pool and a rollout pool of its own: set trainer.placement=split, "
               "or rollout.weight_sync=full")
        _check(self.rollout.decode == "eager" or (engine.compiles_decode and self.rollout.parallel.tp == 1),
               at + "rollout.decode", self.rollout.decode,
               "a compiled decode runs in the native engine with rollout.parallel.tp=1 (tensor-parallel "
               "generation decodes eagerly): set rollout.decode=eager, or rollout.engine=native with "
               "rollout.parallel.tp=1")
        _check(not self.rollout.elastic or self.rollout.min_workers <= self.rollout.n_workers, at + "rollout.min_workers",
               self.rollout.min_workers, f"must be <= rollout.n_workers={self.rollout.n_workers} (the workers it starts with)")
        if not split:
            _check(not self.rollout.interrupt_on_update, at + "rollout.interrupt_on_update", True,
                   "only applies with trainer.placement=split (a colocated rollout shares the actor's "
                   "weights, which never change mid-generation); remove it or set trainer.placement=split")
            return
        for key, value in (("rollout.parallel.tp", self.rollout.parallel.tp), ("actor.parallel.pp", self.actor.parallel.pp)):
            _check(value == 1, at + key, value, "must be 1 with trainer.placement=split (each rollout worker "
                   "holds the whole model and receives whole weights); use trainer.placement=colocated for "
                   "tensor-parallel generation or pipeline-parallel training")

    def _check_mini_batches(self, at: str) -> None:
        """Every data-parallel rank must hold at least one row per mini-batch (fewer rows than
        mini-batches would silently mean fewer optimizer steps than configured)."""
        rows = self.data.batch_size * self.rollout.n
        for role in ("actor", "critic") if needs_critic(self.algorithm.name) else ("actor",):
            section = getattr(self, role)
            par = section.parallel
            dp = par.dp or max(1, self.trainer.n_workers // (par.tp * par.pp))
            per_rank = rows // dp
            _check(section.ppo_mini_batches <= per_rank, f"{at}{role}.ppo_mini_batches", section.ppo_mini_batches,
                   f"each of the {dp} data-parallel ranks updates on {per_rank} rows per step "
                   f"(data.batch_size={self.data.batch_size} x rollout.n={self.rollout.n} / {dp}), fewer than "
                   f"its mini-batches; set {role}.ppo_mini_batches <= {max(1, per_rank)} or raise data.batch_size")

    def _check_layouts(self, at: str) -> None:
        """The actor/critic layouts fit trainer.n_workers; the generation layout fits the actor's."""
        try:
            for role in ("actor", "critic"):
                par = getattr(self, role).parallel
                if par.pp > 1 and role == "critic":
                    raise LayoutError(f"{at}critic.parallel.pp={par.pp}: pipeline stages need an LM head; "
                                      "value models train with tp and dp only (set critic.parallel.pp=1)")
                try:
                    layout = ParallelLayout.from_config(par, self.trainer.n_workers)
                except LayoutError as e:
                    hint = f" (trainer.n_workers={self.trainer.n_workers})" if "world size" in str(e) else ""
                    raise LayoutError(f"{at}{role}.{e}{hint}") from None
                if role == "actor":
                    generation_layout(layout, self.rollout.parallel, at=f"{at}rollout.parallel",
                                      train_at=f"{at}actor.parallel")
                    tg = self.rollout.parallel.tp
                    if not rollout_engine(self.rollout.engine).any_generation_tp and tg > 1 and tg != par.tp:
                        raise LayoutError(f"{at}rollout.parallel.tp={tg}: vLLM's tensor-parallel engines take "
                                          f"consecutive ranks, which a generation TP group is only when it is the "
                                          f"whole training TP group; set rollout.parallel.tp={par.tp} or 1, or "
                                          "rollout.engine=native")
                    if self.rollout.parallel.pp > 1:
                        raise LayoutError(f"{at}rollout.parallel.pp={self.rollout.parallel.pp}: pipeline-"
                                          "parallel generation is not implemented; set rollout.parallel.pp=1 "
                                          "(each generation rank gathers every training stage)")
        except LayoutError as e:
            raise ConfigError(f"bad configuration: {e}") from None


def rl_config(cfg: RLConfig | DictConfig | dict) -> RLConfig:
    """The typed RL config from whatever form it arrives in (a worker gets a plain dict)."""
    return cfg if isinstance(cfg, RLConfig) else typed(RLConfig, cfg)
