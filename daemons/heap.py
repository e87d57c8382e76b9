"""What a process has imported, moved out of the cyclic collector's way (`gc.freeze`).

A full collection walks every object the collector tracks: after torch, transformers and asyncrl
that is ~390 K objects, 0.4 s on the 2-core machine (over 1 s when it is loaded), with the GIL
held, so an event loop on another thread of the process stalls as long, and a worker forked from
a server that imported them touches every inherited page (copied on write). Frozen objects sit in
the permanent generation, which no collection walks. At exit they are unfrozen, so the exit's
collection frees them (an extension that checks its objects at teardown, triton's, would
otherwise print them as leaks after a job's output).
"""

from __future__ import annotations

import atexit
import gc

atexit.register(gc.unfreeze)


def settle(generation: int = 2) -> None:
    """Collect `generation` (2: the whole heap), then freeze what is left: after a process's imports,
    or a run's set-up (`gc.unfreeze()` when the run ends), never per step."""
    gc.collect(generation)
    gc.freeze()
