"""Tests marked `slow` (a second or third layout of a learning run, a benchmark run whole) are
skipped by `make test`, with the reason printed, and run by `make test-all` (`pytest --run-slow`,
or `-m slow`).

A test that changed the checkout's `outputs/` (what `make run` leaves) fails: no test writes
there, and none reads it (tests give their jobs output directories under their tmp_path), so a
fresh clone without one passes the same.

`make test` runs the suite on two pytest-xdist workers (`-n 2`): a file's tests stay on one worker
(its module fixtures are built once), the files in `SERIAL_GROUPS` share one, and a test marked
`alone` (it checks host-wide state: every /dev/shm segment, every process) runs while no other
test does."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemons.proc import use_allocator_settings

use_allocator_settings()  # before torch loads: this process allocates as the workers do

REPO = Path(__file__).resolve().parents[1]
# files whose jobs would collide if run at once on one host: vLLM's CPU tensor-parallel groups name
# their /dev/shm files after the group alone ("-tp:0-[0-1]-cpushm_<rank>") until the engine is built
SERIAL_GROUPS = {"vllm-cpu-tp": ["tests/rl/test_vllm_rollout.py", "tests/rl/test_lora.py", "tests/rl/test_moe.py",
                                 "tests/rl/test_plan.py", "tests/rl/test_async_rl.py"]}
_GROUP_OF = {path: group for group, paths in SERIAL_GROUPS.items() for path in paths}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """pytest-xdist's default (`-n N`, `--dist load`) becomes: each file, or group of files in
    `SERIAL_GROUPS`, is one unit of work, the units with the most tests sent first."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return _GROUP_OF.get(path, path)

    return ByFile(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("markexpr") or ""
    if config.getoption("--run-slow") or ("slow" in wanted and "not slow" not in wanted):
        return
    skip = pytest.mark.skip(reason="slow: `make test-all` (pytest --run-slow) runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist, each test (its fixtures' set-up and teardown included) holds the run's
    room shared, and a test marked `alone` holds it exclusively; one waiting to be alone holds the
    gate, so the others' next tests wait behind it rather than overtake it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    shared = item.config._tmp_path_factory.getbasetemp().parent  # the run's, above each worker's
    alone = item.get_closest_marker("alone") is not None
    with open(shared / "gate.lock", "a") as gate, open(shared / "room.lock", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


_SESSION_LOAD_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="session")
def _fork_server() -> None:
    """The session's pre-imported fork server, started as the session starts: rank groups,
    launches and the CPU workers of this process's node daemons fork from it."""
    from daemons.node import _read_at_start
    from tests.helpers import forked

    _SESSION_LOAD_ENV.update(_read_at_start(dict(os.environ)))
    forked.context()


@pytest.fixture(autouse=True)
def _load_time_environment_as_the_session_started() -> Iterator[None]:
    """After each test, the settings a process reads as it loads (`daemons.node._read_at_start`:
    LD_*, OMP_*, TORCH_*, ...) are the session's again: importing vLLM adds to LD_LIBRARY_PATH
    (cv2's libraries), after which every later launch of this worker would start its workers cold
    instead of from the fork server (slower, and starved past the heartbeat beside other tests)."""
    from daemons.node import _read_at_start

    yield
    now = _read_at_start(dict(os.environ))
    for key in now.keys() - _SESSION_LOAD_ENV.keys():
        del os.environ[key]
    os.environ.update({k: v for k, v in _SESSION_LOAD_ENV.items() if now.get(k) != v})


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
