"""A module whose import takes 3 s, like a role's first import of torch and transformers on a
loaded machine: a worker must keep answering while it loads."""

from __future__ import annotations

import time

IMPORT_S = 3.0
time.sleep(IMPORT_S)


def loaded() -> bool:
    return True
