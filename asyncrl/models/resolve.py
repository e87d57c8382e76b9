"""`model.path` to a local Hugging Face model directory, or a `ConfigError` that says what to do.

Nothing here deletes or overwrites a directory asyncrl did not create.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from asyncrl.config import ModelConfig
from daemons.errors import ConfigError

HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(mc: ModelConfig, key: str = "model.path") -> str:
    """The directory to load the model from: `model.path` itself (built first when
    `model.build_tiny` is set), or a Hub-style name's snapshot in the local Hugging Face cache.
    `key` names the setting in errors (`critic.model_path`, `cost_model.path` resolve the same way)."""
    path = Path(mc.path).expanduser()
    if mc.build_tiny is not None:
        from asyncrl.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model(path, **asdict(mc.build_tiny)))
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
