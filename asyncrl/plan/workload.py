"""What a plan must run: the models (their shapes) and one RL step's model function calls."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncrl.algorithms.registry import needs_critic
from asyncrl.config import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape (Llama/Qwen-style: gated MLP, grouped KV heads; with
    `experts`, a mixture-of-experts MLP in every layer: Qwen3-MoE, Mixtral, Qwen2-MoE's shared expert)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    value_head: bool = False  # a critic or reward model: one output instead of the vocabulary
    head_dim: int = 0  # 0: hidden / heads
    experts: int = 0  # routed experts per layer (0: a dense MLP `ffn` wide)
    experts_per_token: int = 0
    expert_ffn: int = 0  # each routed expert's width
    shared_ffn: int = 0  # a shared expert's width (Qwen2-MoE), 0 for none
    vision: VisionTower | None = None  # a vision-language model's image encoder, counted in `params`

    @property
    def vision_params(self) -> int:
        return self.vision.params if self.vision is not None else 0

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def attention_params(self) -> int:
        q = self.heads * (self.head_dim or self.hidden // self.heads)
        return 2 * self.hidden * q + 2 * self.hidden * self.kv_dim

    def _mlp_params(self, experts: int) -> int:
        if not self.experts:
            return 3 * self.hidden * self.ffn
        shared = 3 * self.hidden * self.shared_ffn + (self.hidden if self.shared_ffn else 0)
        return experts * 3 * self.hidden * self.expert_ffn + self.hidden * self.experts + shared

    @property
    def layer_params(self) -> int:
        return self.attention_params + self._mlp_params(self.experts) + 2 * self.hidden

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters (all layers): what expert parallelism splits."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def active_ffn(self) -> int:
        """The MLP width one token runs through (k experts and the shared one, or the dense MLP)."""
        return self.experts_per_token * self.expert_ffn + self.shared_ffn if self.experts else self.ffn

    def _total(self, layer: int) -> int:
        head = self.hidden if self.value_head else (0 if self.tied else self.vocab * self.hidden)
        return self.vocab * self.hidden + self.layers * layer + head + self.hidden + self.vision_params

    @property
    def params(self) -> int:
        return self._total(self.layer_params)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (a dense model's are all of them)."""
        return self._total(self.attention_params + self._mlp_params(self.experts_per_token) + 2 * self.hidden)

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V cache per token, at 2 bytes per value (scaled by the device's width)."""
        return 2 * self.layers * self.kv_dim * 2

    def as_value_model(self) -> ModelSpec:
        return replace(self, tied=True, value_head=True)

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict[str, Any]) -> ModelSpec:
        if isinstance(cfg.get("text_config"), dict):  # a vision-language model: its language model, and the tower
            text = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg["text_config"]}
            return replace(cls.from_hf_config(name, text), vision=vision_tower(cfg.get("vision_config")))
        try:
            heads = int(cfg["num_attention_heads"])
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            moe = {} if not experts else {
                "experts": experts, "experts_per_token": int(cfg["num_experts_per_tok"]),
                "expert_ffn": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                "shared_ffn": int(cfg.get("shared_expert_intermediate_size") or 0)}
            return cls(name=name, layers=int(cfg["num_hidden_layers"]), hidden=int(cfg["hidden_size"]), heads=heads,
                       kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn=int(cfg["intermediate_size"]),
                       vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
                       head_dim=int(cfg.get("head_dim") or 0), **moe)
        except KeyError as e:
            raise ConfigError(f"model {name}: its config.json lacks {e}, which the planner needs "
                              "(a Llama/Qwen/Mistral-style decoder)") from None


@dataclass(frozen=True)
class VisionTower:
    """A vision-language model's image encoder, as the planner prices it."""

    params: int
    hidden: int
    depth: int
    ffn: int
    merge: int  # an image token merges merge x merge patches


def vision_tower(vc: dict[str, Any] | None) -> VisionTower | None:
    """A Qwen-VL vision tower from its config: the patch embedding, `depth` blocks (attention with
    biases, an MLP, two norms) and the patch merger's MLP. Qwen2.5-VL: a gated MLP and RMS norms;
    Qwen3-VL (`deepstack_visual_indexes`): a plain MLP, layer norms, learned position embeddings
    and one more merger per deepstack layer."""
    if not vc:
        return None
    h = int(vc.get("hidden_size") or vc.get("embed_dim") or 0)
    ffn = int(vc.get("intermediate_size") or 4 * h)
    patch = int(vc.get("patch_size", 14)) ** 2 * int(vc.get("temporal_patch_size", 2)) * int(vc.get("in_channels", 3))
    merge = int(vc.get("spatial_merge_size", 2))
    merged, out = h * merge ** 2, int(vc.get("out_hidden_size") or h)
    merger_mlp = merged * merged + merged + merged * out + out
    depth = int(vc.get("depth", 0))
    if "deepstack_visual_indexes" in vc:
        block = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h
        deepstack = len(vc["deepstack_visual_indexes"]) * (2 * merged + merger_mlp)
        params = (patch * h + h + int(vc.get("num_position_embeddings", 0)) * h + depth * block + 2 * h + merger_mlp
                  + deepstack)
    else:
        block = 4 * h * h + 4 * h + 3 * h * ffn + 2 * ffn + h + 2 * h
        params = patch * h + depth * block + h + merger_mlp
    return VisionTower(params, h, depth, ffn, merge)


# Shapes of well-known checkpoints, so a plan for a model this machine does not hold needs no download
# (from each model's published config.json).
KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec("meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 11008, 32000),
        ModelSpec("meta-llama/Llama-2-13b-hf", 40, 5120, 40, 40, 13824, 32000),
        ModelSpec("meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 28672, 32000),
        ModelSpec("meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 14336, 128256),
        ModelSpec("codellama/CodeLlama-34b-hf", 48, 8192, 64, 8, 22016, 32000),
        ModelSpec("Qwen/Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tied=True),
        ModelSpec("Qwen/Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, tied=True),
        ModelSpec("Qwen/Qwen2.5-3B", 36, 2048, 16, 2, 11008, 151936, tied=True),
        ModelSpec("Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064),
        ModelSpec("Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064),
        ModelSpec("Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064),
        ModelSpec("Qwen/Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 151936, head_dim=128, experts=128,
                  experts_per_token=8, expert_ffn=768),
        ModelSpec("Qwen/Qwen3-235B-A22B", 94, 4096, 64, 4, 12288, 151936, head_dim=128, experts=128,
                  experts_per_token=8, expert_ffn=1536),
        ModelSpec("mistralai/Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 14336, 32000, experts=8, experts_per_token=2,
                  expert_ffn=14336),
        # vision-language: Qwen2.5-VL's tower (32 blocks of 1280, MLP 3420) before its language model
        ModelSpec("Qwen/Qwen2.5-VL-3B", 36, 2048, 16, 2, 11008, 151936, tied=True,
                  vision=vision_tower({"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                                                     "out_hidden_size": 2048})),
        ModelSpec("Qwen/Qwen2.5-VL-7B", 28, 3584, 28, 4, 18944, 152064,
                  vision=vision_tower({"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                                                     "out_hidden_size": 3584})),
        # Qwen3-VL: a 27-block tower of 1152 with three deepstack mergers before Qwen3-8B's shape
        ModelSpec("Qwen/Qwen3-VL-8B", 36, 4096, 32, 8, 12288, 151936, head_dim=128,
                  vision=vision_tower({"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                                                     "out_hidden_size": 4096, "patch_size": 16,
                                                     "num_position_embeddings": 2304,
                                                     "deepstack_visual_indexes": [8, 16, 24]})),
    )
}
# instruction-tuned checkpoints have their base model's shape
KNOWN_MODELS.update({f"{name}-Instruct": replace(spec, name=f"{name}-Instruct")
                     for name, spec in list(KNOWN_MODELS.items()) if name.startswith("Qwen/")})


def model_spec(path: str) -> ModelSpec:
    """The shape of `model.path`: its config.json when it is a local directory, else a known Hub name."""
    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return ModelSpec.from_hf_config(str(local), json.loads((local / "config.json").read_text()))
    if path in KNOWN_MODELS:
        return KNOWN_MODELS[path]
    raise ConfigError(f"model.path={path!r}: no config.json there and not a known model name; point it at a "
                      f"Hugging Face model directory or use one of: {', '.join(KNOWN_MODELS)}")


def config_model_spec(cfg: Any) -> ModelSpec:
    """The shape of an RL config's model without building or downloading it (the quickstart's
    tiny model from its `model.build_tiny` settings when it is not built yet)."""
    if cfg.model.build_tiny is not None and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        from asyncrl.models.tiny import build_config, build_tokenizer

        tiny = cfg.model.build_tiny
        hf = build_config(build_tokenizer(), hidden=tiny.hidden, layers=tiny.layers, heads=tiny.heads)
        return ModelSpec.from_hf_config(cfg.model.path, hf.to_dict())
    return model_spec(cfg.model.path)


class Stage:
    """HybridFlow's three stages of an RL step; calls of one stage on disjoint devices run together."""

    GENERATE = "generate"
    PREPARE = "prepare"
    TRAIN = "train"
    ORDER = (GENERATE, PREPARE, TRAIN)


@dataclass(frozen=True)
class Call:
    """One model function call of an RL step."""

    model: str  # actor | critic | ref | reward
    kind: str  # generate | infer | train
    stage: str
    epochs: int = 1  # passes over the batch (train)
    optimizer_steps: int = 1  # mini-batches x epochs (train)

    @property
    def name(self) -> str:
        return f"{self.model}.{self.kind}"


@dataclass(frozen=True)
class Workload:
    """One RL step: `sequences` = prompts x samples, each `prompt_len + response_len` tokens."""

    models: dict[str, ModelSpec]
    calls: tuple[Call, ...]
    sequences: int
    prompt_len: int
    response_len: int
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_staleness: int = 0  # >= 1: generation on its own devices overlaps the training stages
    fixed: dict[str, Any] = field(default_factory=dict)  # config values the plan keeps (micro-batch sizes)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(self.models)


def rl_calls(algorithm: str, *, critic: bool, ref: bool, reward_model: bool, recompute: bool,
             actor_epochs: int, actor_minis: int, critic_epochs: int = 1, critic_minis: int = 1) -> tuple[Call, ...]:
    """The calls of one step of an asyncrl algorithm (the same order as `asyncrl/algorithms/`)."""
    calls = [Call("actor", "generate", Stage.GENERATE)]
    if recompute:
        calls.append(Call("actor", "infer", Stage.PREPARE))
    if ref:
        calls.append(Call("ref", "infer", Stage.PREPARE))
    if reward_model:
        calls.append(Call("reward", "infer", Stage.PREPARE))
    if critic:
        calls.append(Call("critic", "infer", Stage.PREPARE))
    calls.append(Call("actor", "train", Stage.TRAIN, actor_epochs, actor_epochs * actor_minis))
    if critic:
        calls.append(Call("critic", "train", Stage.TRAIN, critic_epochs, critic_epochs * critic_minis))
    return tuple(calls)


def workload_from_config(cfg: Any, spec: ModelSpec) -> Workload:
    """The step an asyncrl RL config runs (`cfg`: a typed RLConfig)."""
    name = cfg.algorithm.name
    critic = needs_critic(name)
    ref = bool(cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss)
    recompute = cfg.actor.recompute_old_log_probs()
    models = {"actor": spec}
    if ref:
        models["ref"] = spec
    if critic:
        models["critic"] = spec.as_value_model()
    if cfg.cost_model.enable:
        models["reward"] = spec.as_value_model()
    calls = rl_calls(name, critic=critic, ref=ref, reward_model=cfg.cost_model.enable, recompute=recompute,
                     actor_epochs=cfg.actor.ppo_epochs, actor_minis=cfg.actor.ppo_mini_batches,
                     critic_epochs=cfg.critic.ppo_epochs, critic_minis=cfg.critic.ppo_mini_batches)
    return Workload(models=models, calls=calls, sequences=cfg.data.batch_size * cfg.rollout.n,
                    prompt_len=cfg.plan.prompt_len or cfg.data.max_prompt_len,
                    response_len=cfg.plan.response_len or cfg.rollout.max_tokens,
                    max_staleness=cfg.rollout.max_staleness)
