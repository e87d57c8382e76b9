"""Model builders: the tiny local Llama used by the CPU quickstart (`asyncrl.models.tiny`)."""

from __future__ import annotations

__all__ = ["build_tiny_model", "ensure_tiny_model"]


def __getattr__(name: str):
    # lazy, so `python -m asyncrl.models.tiny` does not import the module twice
    if name in __all__:
        from asyncrl.models import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module 'asyncrl.models' has no attribute {name!r}")
