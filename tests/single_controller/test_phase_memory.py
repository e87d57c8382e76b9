"""Per-phase peak memory of a worker process (`asyncrl.single_controller.memory`)."""

import numpy as np

from asyncrl.single_controller.memory import phase, process_memory


def test_phase_peaks_are_per_phase_and_the_process_peak_survives():
    with phase("big"):
        a = np.ones(300 << 20, dtype=np.uint8)  # 300 MiB touched
        del a
    with phase("small"):
        b = np.ones(10 << 20, dtype=np.uint8)
        del b
    m = process_memory()
    big, small = m["phases"]["big"]["peak_rss"], m["phases"]["small"]["peak_rss"]
    assert big - small > 200 << 20, (big, small)  # the reset between phases worked
    assert m["peak_rss"] >= big
