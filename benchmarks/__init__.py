"""Benchmarks of asyncrl against peers and physical limits; each prints one JSON object last.

Torch in a benchmark's own process allocates as asyncrl's workers do (huge pages for large
blocks, `daemons.proc.with_huge_pages`); `USER_ENV` is the environment as the user started the
benchmark, what another checkout under comparison is launched with."""

from __future__ import annotations

import os

from daemons.proc import with_huge_pages

USER_ENV = dict(os.environ)
with_huge_pages(os.environ)  # type: ignore[arg-type]
