"""A worker process's memory: resident now, its peak, and the peak of each named phase.

`phase("update_actor")` around a method body records the process's peak resident memory while
it ran (Linux resets the kernel's high-water mark, VmHWM, on a write of 5 to
/proc/self/clear_refs); the process-wide peak survives the resets. On a GPU, torch's peak
allocation is tracked the same way. Phases that overlap in time (calls running concurrently on
one worker) each see the other's memory too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from daemons.node import NODE_DEVICES_ENV

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


# A trim walks every free chunk of the C heap (2-5 ms a call on the quickstart's workers, twice a
# step); skipped while the process holds less than this many resident bytes more than after its
# last trim, so at most this much freed memory stays mapped between trims
TRIM_MIN_GROWTH = 32 << 20
_trimmed_at = 0  # resident bytes after the last trim
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release_host_memory() -> None:
    """Return the C allocator's free pages to the OS (glibc keeps freed blocks mapped for reuse,
    so a process's resident memory stays at its peak long after tensors are gone) once the
    process grew by TRIM_MIN_GROWTH since the last time."""
    global _trimmed_at
    rss = resident_bytes()
    if rss is not None and rss - _trimmed_at < TRIM_MIN_GROWTH:
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
    _trimmed_at = resident_bytes() or 0


def resident_bytes() -> int | None:
    """This process's resident memory now (None where /proc does not say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def workers_on_node() -> int:
    """How many workers share this node's cores and memory (one per device, or the launcher's
    local world)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get(NODE_DEVICES_ENV, "1")))


def spare_bytes(device: str) -> float:
    """Memory this process could still take: on a GPU the device's free memory and the blocks
    torch holds cached; on a CPU this worker's share of the node's available memory."""
    if str(device).startswith("cuda"):
        import torch

        dev = torch.device(device)
        free, _ = torch.cuda.mem_get_info(dev)
        return float(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0.0
    return available / workers_on_node()


def _cuda_peak(device: str) -> float | None:
    if not str(device).startswith("cuda"):
        return None
    import torch

    return float(torch.cuda.max_memory_allocated(torch.device(device)))


def _reset(device: str) -> None:
    """Fold the current peaks into the process-wide ones, give the C heap's free pages back (the
    workers' glibc keeps freed blocks for reuse: `daemons.proc.ALLOCATOR_ENV`), then restart the
    high-water marks."""
    _state["peak_rss"] = max(_state["peak_rss"], _status()[1])
    release_host_memory()
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
