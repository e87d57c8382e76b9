"""Tests marked `slow` (a second or third layout of a learning run, a benchmark run whole) are
skipped by `make test`, with the reason printed, and run by `make test-all` (`pytest --run-slow`,
or `-m slow`).

Every test runs from a directory of its own (a relative `outputs/...` lands there), and a test
that changed the checkout's `outputs/` (what `make run` leaves) fails: no test reads or writes
it, so a fresh clone without one passes the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("markexpr") or ""
    if config.getoption("--run-slow") or ("slow" in wanted and "not slow" not in wanted):
        return
    skip = pytest.mark.skip(reason="slow: `make test-all` (pytest --run-slow) runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test's working directory is its tmp_path, never the checkout; a test that changed the
    checkout's outputs/ (a subprocess run from the checkout, say) fails, named."""
    before = _outputs_state()
    monkeypatch.chdir(tmp_path)
    yield
    if _outputs_state() != before:
        pytest.fail(f"this test wrote to {REPO / 'outputs'} (make run's directory): run its jobs from "
                    "tmp_path (cwd=tmp_path) or give them an output directory under it", pytrace=False)


def _outputs_state() -> list[tuple[str, int]] | None:
    """The checkout's outputs/ as (path, mtime) pairs; None when there is none."""
    root = REPO / "outputs"
    if not root.is_dir():
        return None
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))
