"""Typed configs: the machinery every config schema shares.

A schema is a dataclass of sections; each section may have `check(at)` (ranges and choices,
`at` being its dotted path). `typed(schema, cfg)` merges a config onto the schema's defaults,
refuses unknown keys, runs every `check` and returns dataclass instances; `explain` turns an
OmegaConf/Hydra error into one paragraph naming the key, where it was set and the closest valid
key.

Schemas join the registry through the `asyncrl.schemas` entry-point group (pyproject.toml:
`rl_schema = "asyncrl.preflight:RL_SCHEMA"`), as a `JobSchema` (the class and the hooks
`asyncrl-launch` calls without knowing the job) or a bare dataclass; `register_with_hydra` makes
them available to a YAML defaults list (`- rl_schema`).
"""

from __future__ import annotations

import difflib
import functools
import logging
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from importlib.metadata import entry_points
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from transport.checks import ConfigError, check_one_of

ENTRY_POINT_GROUP = "asyncrl.schemas"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSchema:
    """A job's config schema as `asyncrl-launch` sees it: the dataclass and the job's hooks."""

    config: type
    # checks before anything starts: (typed config, Hydra's run dir if set on the command line,
    # whether this node runs the driver) -> None, raising ConfigError
    preflight: Callable[[Any, str | None, bool], None] | None = None
    run_dir_key: str | None = None  # the key that receives Hydra's run directory (trainer.output_dir)


@functools.cache
def schemas() -> dict[str, JobSchema]:
    """Every registered schema by its config-store name (`launch_schema`, `rl_schema`, ...)."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if "launch_schema" not in found:
        raise ConfigError("asyncrl's config schemas are not registered: install the package "
                          "(`pip install -e .` in the checkout, or `make test` / `make run`)")
    loaded = {}
    for name, ep in sorted(found.items()):
        try:
            schema = ep.load()
        except Exception as e:  # one broken plugin must not stop every launch
            log.warning("config schema %s (%s) does not load, skipped: %s: %s", name, ep.value, type(e).__name__, e)
            continue
        loaded[name] = schema if isinstance(schema, JobSchema) else JobSchema(schema)
    return loaded


def job_schema(config: type | None) -> JobSchema | None:
    """The registered schema whose dataclass is `config` (None for an unregistered one)."""
    return next((s for s in schemas().values() if s.config is config), None)


def register_with_hydra() -> None:
    """Make the schemas available to a YAML defaults list (`- rl_schema`)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, schema in schemas().items():
        store.store(name=name, node=schema.config)


# typed views --------------------------------------------------------------------------------------
def typed(schema: type, cfg: DictConfig | dict) -> Any:
    """`cfg` merged onto `schema`'s defaults, checked, as dataclass instances."""
    data = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    unknown = _unknown_keys(schema, data or {})
    if unknown:  # Hydra's `+key=`/`++key=` add keys a schema's merge would let through
        key = unknown[0]
        best = closest_key(schema, key)
        raise ConfigError(f"bad configuration: {key}: no such key" + (f"; did you mean {best}?" if best else "")
                          + f". Valid keys in {key.rpartition('.')[0] or 'the top level'}: "
                          + ", ".join(valid_keys(schema, key.rpartition(".")[0])) + ".")
    try:
        merged = OmegaConf.merge(_defaults(schema), cfg)  # merge copies the cached defaults first
        value = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, schema)) from None
    try:
        validate(value)
    except ConfigError:
        raise
    except ValueError as e:  # a lower layer's section (objectstore) raises ValueError, naming the key
        raise ConfigError(str(e)) from None
    return value


def _unknown_keys(schema: type, data: dict, prefix: str = "") -> list[str]:
    """Dotted keys in `data` that `schema` does not have (Hydra's own `hydra` node aside)."""
    names = {f.name: f for f in fields(schema)}
    out = []
    for k, v in data.items():
        if prefix == "" and k == "hydra":
            continue
        if k not in names:
            out.append(f"{prefix}{k}")
            continue
        inner = _dataclass_of(names[k].type, schema)
        if inner is not None and isinstance(v, dict):
            out += _unknown_keys(inner, v, f"{prefix}{k}.")
    return out


def validate(value: Any, at: str = "") -> None:
    """Check every field's declared choices (`choices_of`) and run every section's `check`
    (ranges, choices that depend on other keys), inner sections first; keys are named by their
    full dotted path."""
    hints = _hints(type(value))
    for f in fields(value):
        inner = getattr(value, f.name)
        if is_dataclass(inner):
            validate(inner, f"{at}{f.name}.")
        allowed = choices_of(hints.get(f.name))
        if allowed is not None:
            check_one_of(at + f.name, inner, allowed)
    if hasattr(value, "check"):
        value.check(at)


def choices_of(hint: Any) -> tuple | None:
    """The values a field may take when its type says so: `Annotated[str, Literal[...]]`.
    (A bare `Literal` is what vLLM's configs use; OmegaConf 2.3, which hydra-core 1.3 requires,
    refuses it, so the `Literal` rides in the annotation's metadata: one place names the choices,
    `validate` enforces them, the config reference lists them.)"""
    if typing.get_origin(hint) is not typing.Annotated:
        return None
    return next((typing.get_args(m) for m in hint.__metadata__ if typing.get_origin(m) is typing.Literal), None)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


@functools.cache
def _plain_hints(cls: type) -> dict[str, Any]:
    """`cls`'s resolved annotations, once a process (resolving them is most of a config check's time)."""
    return typing.get_type_hints(cls)


@functools.cache
def _defaults(schema: type) -> DictConfig:
    """`schema`'s defaults as a structured config, built once a process: never changed in place."""
    return OmegaConf.structured(schema)


def warm(schema: type) -> None:
    """What `typed(schema, ...)` resolves on its first call, resolved now (a fork server does it
    once for the workers it forks)."""
    _defaults(schema)
    todo = [schema]
    while todo:
        cls = todo.pop()
        _hints(cls)  # what `validate` reads
        todo += [inner for f in fields(cls) if (inner := _dataclass_of(f.type, cls)) is not None]


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, resolved dict of a typed config (what travels to workers and into run dirs)."""
    node = OmegaConf.structured(cfg) if is_dataclass(cfg) else cfg
    return OmegaConf.to_container(node, resolve=True)


# error messages ------------------------------------------------------------------------------------
def valid_keys(schema: type, path: str) -> list[str]:
    """The field names of the section at dotted `path` in `schema` (empty when it is no section)."""
    node = _section(schema, path)
    return [f.name for f in fields(node)] if node is not None else []


def _section(schema: type, path: str) -> type | None:
    """The dataclass of the section at dotted `path` in `schema` (None when it is no section)."""
    node: Any = schema
    for part in [p for p in path.split(".") if p]:
        hit = next((f for f in fields(node) if f.name == part), None) if is_dataclass(node) else None
        node = _dataclass_of(hit.type, node) if hit is not None else None
        if node is None:
            return None
    return node if is_dataclass(node) else None


def _is_mapping(schema: type, path: str) -> bool:
    """Whether dotted `path` in `schema` is a dict-typed field (free-form keys)."""
    section, _, name = path.rpartition(".")
    node = _section(schema, section)
    if node is None or name not in {f.name for f in fields(node)}:
        return False
    hint = _plain_hints(node)[name]
    return (typing.get_origin(hint) or hint) is dict


def _dataclass_of(annotation: Any, owner: type) -> type | None:
    hints = _plain_hints(owner)
    for f in fields(owner):
        if f.type is annotation:
            annotation = hints[f.name]
            break
    if is_dataclass(annotation):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if is_dataclass(arg):
            return arg
    return None


def closest_key(schema: type, full_key: str) -> str | None:
    section, _, name = full_key.rpartition(".")
    match = difflib.get_close_matches(name, valid_keys(schema, section), n=1, cutoff=0.5)
    return f"{section}.{match[0]}" if match and section else (match[0] if match else None)


_NOISE = ("In '", "Error merging", "Could not override", "To append", "full_key:", "reference_type",
          "object_type", "ConfigKeyError raised", "ValidationError raised")


def explain(e: BaseException, schema: type | None, files: dict[str, str] | None = None) -> str:
    """One paragraph for a composition/validation error: the key, where it was set (a YAML file or
    the command line) and, for an unknown key, the closest valid one.

    `files` maps a config name as Hydra reports it ("grpo") to the file it came from.
    """
    text = "\n".join(str(x) for x in (e, e.__cause__) if x is not None)
    full_key = re.search(r"full_key: (\S+)", text)
    key = full_key.group(1) if full_key else ""
    if not key:
        m = re.search(r"Could not override '([^']+)'", text) or re.search(r"override (\S+?)=", text)
        key = m.group(1) if m else ""
    reasons = [ln.strip() for ln in text.splitlines()
               if ln.strip() and not any(ln.strip().startswith(n) for n in _NOISE)]
    reason = reasons[0] if reasons else text.strip().splitlines()[0]
    msg = f"bad configuration: {key}: {reason}" if key else f"bad configuration: {reason}"
    source = re.search(r"In '([^']+)'", text)
    if source:
        name = source.group(1)
        msg += f" (set in {(files or {}).get(name, name + '.yaml')})"
    elif "override" in text:
        msg += " (set on the command line)"
    if schema is None:
        schema = _schema_of(key, text)
    if schema is not None and key and "not in struct" in text and _is_mapping(schema, key.rpartition(".")[0]):
        return msg + f"; {key.rpartition('.')[0]} is a free-form mapping: add a key with +{key}=VALUE"
    if schema is not None and key and ("not in" in text or "Could not override" in text):
        best = closest_key(schema, key)
        section = key.rpartition(".")[0]
        if best and best != key:
            msg += f"; did you mean {best}?"
        keys = valid_keys(schema, section)
        if keys:
            msg += f" Valid keys in {section or 'the top level'}: {', '.join(keys)}."
    return msg


def _schema_of(key: str, text: str) -> type | None:
    """The schema an error is about: the one Hydra names (`not in 'RLConfig'`), else the largest
    registered one whose sections hold the key's section, else the largest (a typo in a
    top-level key belongs to none)."""
    known = sorted((s.config for s in schemas().values()), key=lambda c: -len(fields(c)))
    named = re.search(r"not in '(\w+)'", text)
    by_name = next((c for c in known if named and c.__name__ == named.group(1)), None)
    top = key.split(".")[0]
    return by_name or next((c for c in known if top in {f.name for f in fields(c)}), known[0] if known else None)
