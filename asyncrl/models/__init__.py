"""Model builders: the tiny local Llama used by the CPU quickstart."""

from asyncrl.models.tiny import build_tiny_model, ensure_tiny_model

__all__ = ["build_tiny_model", "ensure_tiny_model"]
