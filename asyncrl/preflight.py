"""The checks `asyncrl-launch` runs before anything starts (through `RLConfig.preflight`) and the
trainer runs when it loads its inputs: what workers would otherwise fail on deep inside a run."""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.config import CRITIC_ALGORITHMS, ModelConfig, RLConfig
from asyncrl.models.resolve import resolve_model
from daemons.errors import ConfigError

log = logging.getLogger("asyncrl.preflight")


def check_inputs(cfg: RLConfig) -> None:
    """What the workers would otherwise fail on deep inside: data files, the reward function and
    the parallel sizes against the model (`cfg.model.path` resolved)."""
    check_files(cfg)
    _check_tp_fits_model(cfg)


def check_files(cfg: RLConfig) -> None:
    """The model directory (unless the run builds it), the data files (present, parquet or
    jsonl, with the prompt and ground-truth columns) and the reward functions (importable);
    `asyncrl-launch` runs this before anything starts."""
    from asyncrl.data.dataset import DatasetError, check_data_file
    from asyncrl.rewards import load_reward_fn

    if cfg.model.build_tiny is None:
        resolve_model(cfg.model)
    if cfg.critic.model_path and cfg.algorithm.name in CRITIC_ALGORITHMS:
        resolve_model(ModelConfig(path=cfg.critic.model_path), key="critic.model_path")
    if cfg.cost_model.path and cfg.cost_model.enable:
        resolve_model(ModelConfig(path=cfg.cost_model.path), key="cost_model.path")
    if cfg.reward.model_path:
        cfg.reward.model_path = resolve_model(ModelConfig(path=cfg.reward.model_path), key="reward.model_path")
    for key in ("train_files", "val_files"):
        value = getattr(cfg.data, key)
        if value:
            try:
                check_data_file(value, cfg.data.prompt_key, cfg.data.answer_key)
            except DatasetError as e:
                raise ConfigError(f"data.{key}={value}: {e}") from None
    for key in ("fn", "cost_fn"):
        spec = getattr(cfg.reward, key)
        if spec:
            try:
                load_reward_fn(spec)
            except Exception as e:
                raise ConfigError(f"reward.{key}={spec}: {e}") from None


def _check_tp_fits_model(cfg: RLConfig) -> None:
    """Tensor-parallel sizes must divide the model's heads and intermediate size, and pipeline
    stages not outnumber its layers (read from its config.json, before any worker starts)."""
    sizes = {"actor.parallel.tp": cfg.actor.parallel.tp, "rollout.parallel.tp": cfg.rollout.parallel.tp}
    if all(v == 1 for v in sizes.values()) and cfg.actor.parallel.pp == 1:
        return
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(cfg.model.path)
    if cfg.actor.parallel.pp > model.num_hidden_layers:
        raise ConfigError(f"actor.parallel.pp={cfg.actor.parallel.pp} but the model ({cfg.model.path}) has "
                          f"{model.num_hidden_layers} decoder layers; choose pp <= {model.num_hidden_layers}")
    dims = {"num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": getattr(model, "num_key_value_heads", None) or model.num_attention_heads,
            "intermediate_size": model.intermediate_size}
    for key, tp in sizes.items():
        bad = [f"{k}={v}" for k, v in dims.items() if v % tp]
        if bad:
            raise ConfigError(f"{key}={tp} must divide the model's {', '.join(bad)} ({cfg.model.path}); "
                              "choose a common divisor")


def check_round_trip(tokenizer: Any, items: list) -> bool:
    """Warn when decoding a prompt's tokens does not give its text back (a tokenizer that drops
    spaces or maps characters to <unk> trains on something else than the data); True if all match.
    Spaces a decoder adds between tokens (word-level tokenizers) are not a difference."""
    def same(text: str, back: str) -> bool:
        return "".join(text.split()) == "".join(back.split()) and len(back.split()) >= len(text.split())

    decoded = [(it.raw_prompt, tokenizer.decode(it.input_ids)) for it in items]
    bad = [(text, back) for text, back in decoded if not same(text, back)]
    if bad:
        text, back = bad[0]
        log.warning("the tokenizer does not round-trip %d of %d training prompts checked: %r decodes as %r; "
                    "check model.path's tokenizer (pre-tokenizer, normalizer, unknown characters)",
                    len(bad), len(items), text[:200], back[:200])
    return not bad
