"""Configuration errors and the checks a config section runs, for every layer (transport is the
bottom one: the object store, the daemons and asyncrl's schemas all raise `ConfigError`)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and how to fix it."""


# the checks a config section's `check(at)` runs; `at` + name is the key's dotted path
def check(ok: bool, key: str, value: object, want: str) -> None:
    if not ok:
        raise ConfigError(f"bad configuration: {key}={value!r}: {want}")


def check_one_of(key: str, value: object, choices: tuple) -> None:
    check(value in choices, key, value, f"must be one of {', '.join(map(str, choices))}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    check(value >= 0 if allow_zero else value > 0, key, value, "must be >= 0" if allow_zero else "must be > 0")
