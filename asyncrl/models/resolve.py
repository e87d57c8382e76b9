"""`model.path` to a local Hugging Face model directory, or a `ConfigError` that says what to do.

Nothing here deletes or overwrites a directory asyncrl did not create.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncrl.config import ModelConfig, TinyModelConfig
from asyncrl.data.config import DataConfig
from asyncrl.data.reasoning_gym import GYM_TASK, is_gym_source, json_safe
from transport.checks import ConfigError

HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(mc: ModelConfig, key: str = "model.path", data: DataConfig | None = None) -> str:
    """The directory to load the model from: `model.path` itself (built first when
    `model.build_tiny` is set; a reasoning-gym build needs `data`), or a Hub-style name's snapshot
    in the local Hugging Face cache. `key` names the setting in errors (`critic.model_path`,
    `cost_model.path` resolve the same way)."""
    path = Path(mc.path).expanduser()
    if mc.build_tiny is not None:
        from asyncrl.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model(path, **tiny_settings(mc.build_tiny, data)))
    if path.is_dir():
        if (path / "config.json").exists():
            return str(path)
        raise ConfigError(f"{key}={mc.path} is a directory but not a Hugging Face model (no config.json); "
                          "point model.path at a directory written by save_pretrained (it was left as it is)")
    if path.exists():
        raise ConfigError(f"{key}={mc.path} is a file; it must be a model directory")
    if HUB_NAME.fullmatch(mc.path):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(mc.path, local_files_only=True)
        except Exception:  # not cached (or no huggingface_hub): asyncrl never downloads at run time
            raise ConfigError(
                f"{key}={mc.path} is not a local directory and not in the local Hugging Face cache, and "
                "asyncrl does not download models: fetch it where a hub is reachable (`huggingface-cli "
                f"download {mc.path} --local-dir DIR`) and set {key}=DIR") from None
    raise ConfigError(f"{key}={mc.path} does not exist; set it to a local Hugging Face model directory "
                      "(or build a toy one: python -m asyncrl.models.tiny DIR)")


def tiny_settings(tiny: TinyModelConfig, data: DataConfig | None) -> dict[str, Any]:
    """`model.build_tiny` as `ensure_tiny_model`'s keywords. A reasoning-gym build also takes
    data.source and data.reasoning_gym: its rows make the vocabulary and the warm start, and a
    build with other rows is another model."""
    settings = asdict(tiny)
    if tiny.task != GYM_TASK:
        return settings
    if data is None or not is_gym_source(data.source):
        raise ConfigError(f"model.build_tiny.task={GYM_TASK} builds the tiny model from data.source's reasoning-gym "
                          f"tasks, but data.source={data.source if data else None!r}; set "
                          "data.source=reasoning_gym:<task>[,<task>...] (or a synthetic model.build_tiny.task)")
    return {**settings, "reasoning_gym": json_safe({"source": data.source, **asdict(data.reasoning_gym)})}
