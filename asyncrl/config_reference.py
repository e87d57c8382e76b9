"""Every key of the RL config, its type, default and what it does, from the dataclasses themselves.

    python -m asyncrl.config_reference > docs/config-reference.md

A field's doc is its trailing comment or the string under it (each section's dataclass beside the
code that reads it); tests/test_docs.py keeps docs/config-reference.md equal to this output.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from functools import cache
from typing import Any

from asyncrl.single_controller.schema import choices_of

HEADER = """# Configuration reference

Every key of an RL job's config (`asyncrl-launch --config-name grpo`, the `rl_schema`), its type,
its default in the schema (the shipped recipes change a few: `configs/rl_defaults.yaml`) and what
it does, generated from the dataclasses that declare them:
`python -m asyncrl.config_reference > docs/config-reference.md` (a test keeps this file equal to
that output). How the keys fit together: [configuration.md](configuration.md).
"""


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """Each field's trailing `# comment` or the string literal right under it, from `cls`'s source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("# ").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    docs: dict[str, str] = {}
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above = []  # a comment block on the lines right above the field
        line = node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        parts = above + [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            parts.append(" ".join(after.value.value.split()))
        if parts:
            docs[node.target.id] = " ".join(parts)
    return docs


def _type_name(tp: Any) -> str:
    allowed = choices_of(tp)
    if allowed is not None:
        return " | ".join(repr(v) for v in allowed)
    text = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
    return text.replace("NoneType", "None")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return repr(value) if not dataclasses.is_dataclass(value) else ""
    return "(required)"


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf of `cls`, sections depth first."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = {k: v for base in reversed(cls.__mro__) for k, v in _field_docs(base).items()}  # inherited fields too
    out: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, f.type)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += rows(tp, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, _type_name(tp), _default(f), docs.get(f.name, "")))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(cls: type) -> str:
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in rows(cls):
        sections.setdefault(row[0].split(".")[0] if "." in row[0] else "(top level)", []).append(row)
    lines = [HEADER]
    for name, section in sections.items():
        lines += [f"## {name}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{k}` | `{_cell(t)}` | `{_cell(d)}` | {_cell(doc)} |" if d else f"| `{k}` | `{_cell(t)}` | | {_cell(doc)} |"
                  for k, t, d, doc in section]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    from asyncrl.config import RLConfig

    print(render(RLConfig), end="")


if __name__ == "__main__":
    main()
