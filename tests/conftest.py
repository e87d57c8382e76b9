"""Tests marked `slow` (a second or third layout of a learning run, a benchmark run whole) are
skipped by `make test`, with the reason printed, and run by `make test-all` (`pytest --run-slow`,
or `-m slow`).

A test that changed the checkout's `outputs/` (what `make run` leaves) fails: no test writes
there, and none reads it (tests give their jobs output directories under their tmp_path), so a
fresh clone without one passes the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from daemons.proc import use_allocator_settings

use_allocator_settings()  # before torch loads: this process allocates as the workers do

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


@pytest.fixture(autouse=True, scope="session")
def _fork_server() -> None:
    """The session's pre-imported fork server, started as the session starts: rank groups,
    launches and the CPU workers of this process's node daemons fork from it."""
    from tests.helpers import forked

    forked.context()


@pytest.fixture(autouse=True)
def _outputs_untouched() -> Iterator[None]:
    """A test that changed the checkout's outputs/ (a job launched from the checkout with no
    output directory of its own, say) fails, named."""
    before = _outputs_state()
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
