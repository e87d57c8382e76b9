"""What a process forked from a fork server reports about itself (tests only): its parent, what
the server imported, and how writing fresh and reused memory faults."""

from __future__ import annotations

import json
import os
import resource
import sys


def _faults_writing(n: int) -> int:
    import torch

    block = torch.empty(n, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block.fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def report(path: str) -> None:
    """Write the report to `path` as JSON (its own session first, as a node's worker does)."""
    os.setsid()
    fresh = _faults_writing(64 << 20)
    _faults_writing(1 << 20)
    reused = _faults_writing(512 << 10)  # in the freed 1 MiB: glibc's heap, not a fresh mapping
    with open(path, "w") as f:
        json.dump({"parent": os.getppid(), "fresh_faults": fresh, "reused_faults": reused,
                   "json_loaded": "json.decoder" in sys.modules, "env": dict(os.environ)}, f)


def progress_bar_semaphores() -> list[str]:
    """The named semaphores (files in /dev/shm) this process makes to draw a tqdm bar, as
    transformers does while it loads weights."""
    import io
    import multiprocessing.synchronize as sync

    from tqdm.auto import tqdm

    made, init = [], sync.SemLock.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._semlock.name:  # None: unlinked as it was made (a forked process's)
            made.append(self._semlock.name)

    sync.SemLock.__init__ = spy
    try:
        for _ in tqdm(range(3), file=io.StringIO()):
            pass
    finally:
        sync.SemLock.__init__ = init
    return made
