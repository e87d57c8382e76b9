"""Logging with the process role and rank in every line."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(role: str, rank: int | str | None = None, level: str | int | None = None) -> None:
    level = level or os.environ.get("ASYNCRL_LOG_LEVEL", "INFO")
    tag = role if rank is None else f"{role}:{rank}"
    fmt = f"%(asctime)s %(levelname)s [{tag} pid=%(process)d] %(name)s: %(message)s"
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
