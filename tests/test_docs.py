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
