"""The suite's own limits and isolation: the pytest timeout in force for a test (its mark, its module's, or
pyproject's) is above every timeout the test gives a subprocess or a wait, so that a slow
machine stops the subprocess first and the test prints why, rather than pytest killing it silently."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mark_timeout(nodes: list[ast.expr]) -> int | None:
    for node in nodes:
        found = re.search(r"mark\.timeout\((\d+)", ast.unparse(node))
        if found:
            return int(found.group(1))
    return None


def test_every_limit_a_test_sets_is_below_the_pytest_timeout_in_force():
    glob = int(re.search(r"^timeout = (\d+)", (REPO / "pyproject.toml").read_text(), re.M).group(1))
    bad = []
    for p in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(p.read_text())
        module = [_mark_timeout([n.value]) for n in tree.body if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)]
        in_module = next((t for t in module if t), glob)
        for f in [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
            limit = (_mark_timeout(f.decorator_list) or in_module) if f.name.startswith("test") else in_module
            for c in ast.walk(f):
                for k in getattr(c, "keywords", []) if isinstance(c, ast.Call) else []:
                    if (k.arg in ("timeout", "timeout_s") and isinstance(k.value, ast.Constant)
                            and isinstance(k.value.value, int | float) and k.value.value >= limit):
                        bad.append(f"{p.relative_to(REPO)}:{c.lineno} {f.name}: timeout={k.value.value} >= {limit}")
    assert not bad, bad


def test_a_write_to_the_checkouts_outputs_is_noticed(tmp_path, monkeypatch):
    """The conftest's isolation from `make run`'s outputs/: the before/after record of outputs/
    it keeps for each test changes when a file is written."""
    from tests import conftest

    monkeypatch.setattr(conftest, "REPO", tmp_path / "checkout")
    assert conftest._outputs_state() is None
    (tmp_path / "checkout" / "outputs" / "quickstart").mkdir(parents=True)
    before = conftest._outputs_state()
    assert before == conftest._outputs_state()
    (tmp_path / "checkout" / "outputs" / "quickstart" / "metrics.jsonl").write_text("{}\n")
    assert conftest._outputs_state() != before


def test_a_test_marked_alone_runs_while_no_other_test_does(tmp_path):
    """Under `make test`'s two xdist workers, a file's tests run on one worker, other files' tests
    run beside them, and a test marked `alone` (with its fixtures) overlaps none of them."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_runtest_protocol, pytest_xdist_make_scheduler  # noqa: F401\n")
    body = ("import os, time, pytest\n"
            "@pytest.fixture\n"
            "def span(request):\n"
            "    t0 = time.monotonic(); yield; time.sleep(0.2)\n"
            "    with open(os.environ['SPANS'], 'a') as f: f.write(f'{request.node.name} {os.environ[\"PYTEST_XDIST_WORKER\"]} {t0} {time.monotonic()}\\n')\n")
    (tmp_path / "test_a.py").write_text(body + "".join(
        f"def test_x{i}(span): time.sleep(0.3)\n" for i in range(6)))
    (tmp_path / "test_b.py").write_text(body + "".join(
        f"def test_y{i}(span): time.sleep(0.3)\n" for i in range(3)) + "@pytest.mark.alone\ndef test_alone(span): time.sleep(0.5)\n")
    spans = tmp_path / "spans"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                        "-o", "markers=alone", f"--rootdir={tmp_path}", str(tmp_path)],
                       cwd=REPO, env={**os.environ, "SPANS": str(spans), "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.split() for line in spans.read_text().splitlines()]
    rows = {name: (float(a), float(b)) for name, _, a, b in lines}
    assert len(rows) == 10
    assert len({w for name, w, _, _ in lines if name.startswith("test_x")}) == 1

    def overlap(x: str, y: str) -> bool:
        return rows[x][0] < rows[y][1] and rows[y][0] < rows[x][1]
    assert not [n for n in rows if n != "test_alone" and overlap(n, "test_alone")]
    assert any(overlap(a, b) for a in rows if a.startswith("test_x") for b in rows if b.startswith("test_y"))


def test_the_venv_is_byte_compiled():
    """`make`'s installs compile the venv (pip's own compile is skipped for a parallel one): with
    PYTHONDONTWRITEBYTECODE set, a module left uncompiled is compiled again by every process."""
    import importlib.util

    import torch
    import transformers
    for module in (torch, transformers, torch.nn.modules.module, transformers.modeling_utils):
        assert Path(importlib.util.cache_from_source(module.__file__)).exists(), module.__file__
