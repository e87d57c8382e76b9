"""The sections every job's config has, whatever the job: `cluster`, `worker`, `job`,
`objectstore` and `seed` (`LaunchConfig`). `asyncrl-launch` reads these; a job's own schema
(the RL trainer's `asyncrl.config.RLConfig`) extends `LaunchConfig` with its sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.single_controller.schema import typed
from daemons.cluster import ClusterConfig
from objectstore.config import ObjectStoreConfig
from transport.checks import check_positive

COLLECTIVE_TIMEOUT_ENV = "ASYNCRL_COLLECTIVE_TIMEOUT_S"  # how worker.collective_timeout_s reaches workers


@dataclass
class WorkerConfig:
    """Deadlines of the calls the driver makes on worker groups, and of the workers' collectives."""

    # a group call that has not finished on every rank after this long fails with
    # CallTimeoutError naming the ranks still running it (0 = no deadline)
    call_timeout_s: float = 3600.0
    # torch.distributed process groups: a collective waiting longer than this raises in the worker
    collective_timeout_s: float = 1800.0

    def check(self, at: str) -> None:
        check_positive(at + "call_timeout_s", self.call_timeout_s, allow_zero=True)
        check_positive(at + "collective_timeout_s", self.collective_timeout_s)

    @classmethod
    def of(cls, cfg: Any) -> WorkerConfig:
        """The `worker` section of a job's config (typed, plain or absent: the defaults)."""
        section = cfg.get("worker") if cfg is not None and hasattr(cfg, "get") else getattr(cfg, "worker", None)
        if section is None or isinstance(section, WorkerConfig):
            return section or cls()
        return typed(LaunchConfig, {"worker": section}).worker  # errors name `worker.KEY`


@dataclass
class JobConfig:
    entry: str | None = None
    """The driver: "package.module:main" or "path/to/script.py:main"."""
    name: str = "job"
    """The job's name: its id (`name-3fa2c1`), its state file and its log folder start with it."""


@dataclass
class LaunchConfig:
    """What `asyncrl-launch` itself reads; every job config has these sections."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    job: JobConfig = field(default_factory=JobConfig)
    objectstore: ObjectStoreConfig = field(default_factory=ObjectStoreConfig)
    seed: int = 0  # seeds sampling, shuffling and fresh weights (heads, adapters)

    def check(self, at: str) -> None:
        check_positive(at + "seed", self.seed, allow_zero=True)
