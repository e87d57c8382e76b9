"""Benchmarks of asyncrl against peers and physical limits; each prints one JSON object last.

Torch in a benchmark's own process allocates as asyncrl's workers do (huge pages, glibc's heap
reused: `daemons.proc.ALLOCATOR_ENV`); `USER_ENV` is the environment as the user started the
benchmark, what another checkout under comparison is launched with."""

from __future__ import annotations

import os

from daemons.proc import use_allocator_settings

USER_ENV = dict(os.environ)
use_allocator_settings()
