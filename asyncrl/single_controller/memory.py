"""A worker process's memory: resident now, its peak, and the peak of each named phase.

`phase("update_actor")` around a method body records the process's peak resident memory while
it ran (Linux resets the kernel's high-water mark, VmHWM, on a write of 5 to
/proc/self/clear_refs); the process-wide peak survives the resets. On a GPU, torch's peak
allocation is tracked the same way. Phases that overlap in time (calls running concurrently on
one worker) each see the other's memory too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_CLEAR_REFS = "/proc/self/clear_refs"
_state = {"peak_rss": 0.0, "cuda_peak": 0.0}  # the peaks before the last reset
_phases: dict[str, dict[str, float]] = {}  # phase -> {"peak_rss": bytes, "cuda_peak_allocated": bytes}


def _status() -> tuple[float, float]:
    """(VmRSS, VmHWM) in bytes from /proc, or the rusage peak twice where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return float(status["VmRSS"].split()[0]) * 1024, float(status["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import resource

        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return peak, peak


def _cuda_peak(device: str) -> float | None:
    if not str(device).startswith("cuda"):
        return None
    import torch

    return float(torch.cuda.max_memory_allocated(torch.device(device)))


def _reset(device: str) -> None:
    """Fold the current peaks into the process-wide ones, then restart the high-water marks."""
    _state["peak_rss"] = max(_state["peak_rss"], _status()[1])
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: phases then report the process-wide peak
        pass
    cuda = _cuda_peak(device)
    if cuda is not None:
        import torch

        _state["cuda_peak"] = max(_state["cuda_peak"], cuda)
        torch.cuda.reset_peak_memory_stats(torch.device(device))


@contextmanager
def phase(name: str, device: str = "cpu") -> Iterator[None]:
    """Record the process's peak memory while the body runs as phase `name` (the max over calls)."""
    _reset(device)
    try:
        yield
    finally:
        seen = _phases.setdefault(name, {})
        seen["peak_rss"] = max(seen.get("peak_rss", 0.0), _status()[1])
        cuda = _cuda_peak(device)
        if cuda is not None:
            seen["cuda_peak_allocated"] = max(seen.get("cuda_peak_allocated", 0.0), cuda)


def process_memory(device: str = "cpu") -> dict:
    """This process's memory in bytes: resident now (`rss`), its peak so far (`peak_rss`), on a
    GPU torch's peak allocation (`cuda_peak_allocated`), and each recorded phase's peaks
    (`phases`: name -> the same keys)."""
    rss, hwm = _status()
    out: dict = {"rss": rss, "peak_rss": max(hwm, _state["peak_rss"])}
    cuda = _cuda_peak(device)
    if cuda is not None:
        out["cuda_peak_allocated"] = max(cuda, _state["cuda_peak"])
    out["phases"] = {name: dict(peaks) for name, peaks in _phases.items()}
    return out
