"""Tests marked `slow` (a second or third layout of a learning run, a benchmark run whole) are
skipped by `make test`, with the reason printed, and run by `make test-all` (`pytest --run-slow`,
or `-m slow`)."""

from __future__ import annotations

import pytest


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
