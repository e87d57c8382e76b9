"""The docs hold together: every relative link in the README, the changelog and docs/ (and the
READMEs beside the code) reaches a file of this repository, and its #anchor a heading there;
nothing cites a path outside the repository (a clone has only what is in it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines()]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for doc in _tracked("*.md"):
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.is_relative_to(REPO) or not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_nothing_cites_a_path_outside_the_repository():
    cites = [f"{p.relative_to(REPO)}:{i + 1}" for p in _tracked("*.md", "*.py", "*.yaml", "*.toml", "Makefile")
             for i, line in enumerate(p.read_text().splitlines()) if "../" + "shared/" in line]
    assert not cites, cites


def _marks(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """A test file's module-level marks and each test function's own (slow, gpu, multinode)."""
    import ast

    tree = ast.parse(path.read_text())
    kinds = ("slow", "gpu", "multinode")
    module = {k for node in tree.body if isinstance(node, ast.Assign)
              and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
              for k in kinds if f"mark.{k}" in ast.unparse(node.value)}
    funcs = {node.name: {k for d in node.decorator_list for k in kinds  # not one case of a parametrize
                         if ast.unparse(d).removeprefix("pytest.").startswith(f"mark.{k}")}
             for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
             and node.name.startswith("test")}
    return module, funcs


def test_the_status_table_names_tests_that_exist_and_says_which_ci_skips():
    """docs/status.md: each row's tests exist; those before "not in CI" run by default (no slow or
    gpu mark), those after it carry one."""
    rows = [line for line in (REPO / "docs" / "status.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| capability", "|---"))]
    assert len(rows) >= 20
    wrong = []
    for row in rows:
        cell = row.rstrip(" |").rsplit(" | ", 1)[1]
        ci, _, skipped = cell.partition("not in CI:")
        files: list[Path] = []
        for part, default in ((ci, True), (skipped, False)):
            for name in re.findall(r"`([^`]+)`", part):
                path, _, func = name.partition("::") if name.startswith("tests/") else ("", "", name)
                if path:
                    files.append(REPO / path)
                candidates = [REPO / path] if path else files
                if not all(p.is_file() for p in candidates) or not candidates:
                    wrong.append(f"{name}: no such file")
                    continue
                found = [(m, f.get(func)) for m, f in map(_marks, candidates) if not func or func in f]
                if not found:
                    wrong.append(f"{name}: no such test")
                    continue
                module, own = found[0]
                marks = (module | (own or set())) - {"multinode"}
                if default and marks:
                    wrong.append(f"{name}: marked {sorted(marks)}, yet named as run by CI")
                if not default and not marks:
                    wrong.append(f"{name}: runs in CI, yet named under 'not in CI'")
    assert not wrong, wrong


def test_the_config_reference_is_the_schemas_own():
    """docs/config-reference.md is `python -m asyncrl.config_reference`'s output: every key of the
    RL schema with its type, default and doc, from the dataclasses (regenerate it after a change)."""
    from asyncrl.config import RLConfig
    from asyncrl.config_reference import render

    assert (REPO / "docs" / "config-reference.md").read_text() == render(RLConfig), (
        "docs/config-reference.md is stale: python -m asyncrl.config_reference > docs/config-reference.md")
