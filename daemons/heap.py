"""What a process has imported, moved out of the cyclic collector's way (`gc.freeze`).

A full collection walks every object the collector tracks: after torch, transformers and asyncrl
that is ~390 K objects, 0.4 s on the 2-core machine (over 1 s when it is loaded), with the GIL
held, so an event loop on another thread of the process stalls as long, and a worker forked from
a server that imported them touches every inherited page (copied on write). Frozen objects sit in
the permanent generation, which no collection walks.
"""

from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit: list[bool] = []


def settle() -> None:
    """Collect once, then freeze what is left: call it after a process's imports, not per step.
    At exit they are unfrozen again, so the exit's collection frees them (an extension that checks
    its objects at teardown, triton's, would otherwise print them as leaks after the job's output)."""
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit.append(True)
