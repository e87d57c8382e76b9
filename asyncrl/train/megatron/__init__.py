"""The megatron-core training backend (`actor.backend=megatron`): see docs/megatron.md."""

from __future__ import annotations

from transport.checks import ConfigError


def require_megatron() -> None:
    """Raise a `ConfigError` that says how to install megatron-core when it is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ConfigError("actor.backend=megatron needs megatron-core: pip install 'asyncrl[megatron]' "
                          f"(megatron-core 0.16.1 on Python 3.11); it failed to import: {e}") from e
