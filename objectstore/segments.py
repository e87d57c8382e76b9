"""Shared-memory segments for same-node pulls, and the pool of pre-faulted spare segments.

One segment per object, a file under /dev/shm named `asyncrl-os-<owner pid>-<id>`. A batch's
columns lie one after another, each starting on a page boundary, so a consumer can map exactly
the pages of the rows it wants. The owner pid in the name lets `remove_stale_segments` clean
up after a store that died without closing (a crash, SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import tempfile
import uuid
from concurrent.futures import Executor

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
SEGMENT_PREFIX = "asyncrl-os-"
PAGE = mmap.ALLOCATIONGRANULARITY
# Pre-faulting the whole segment in one syscall is much cheaper than one page fault per 4 KiB
# while copying; Linux only.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def align_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Page-aligned offsets for regions of `sizes` bytes, and the segment size."""
    offsets, pos = [], 0
    for size in sizes:
        offsets.append(pos)
        pos = align_up(pos + size)
    return offsets, max(pos, PAGE)


class Segment:
    """An owner's shared-memory segment, mapped read-write."""

    def __init__(self, path: str, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.mm = mm

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def create(cls, size: int, tag: str = "", shm_dir: str = SHM_DIR) -> Segment:
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{tag[:12]}{uuid.uuid4().hex[:12]}"
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)  # the mapping keeps the memory; the name stays until unlink
        return cls(path, size, mm)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over bytes [offset, offset + nbytes) of the segment."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, offset=offset, count=nbytes)

    def unlink(self) -> None:
        """Remove the name; mappings (ours and consumers') stay valid until dropped."""
        _unlink(self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def map_region(path: str, offset: int, nbytes: int) -> memoryview:
    """Map bytes [offset, offset + nbytes) of a segment copy-on-write: reads share the owner's
    pages (zero-copy), writes stay private to this process."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    start = offset - offset % PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
    finally:
        os.close(fd)
    return memoryview(mm)[offset - start:offset - start + nbytes]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names of every object-store segment in `shm_dir`."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments whose owner process is gone; returns their names."""
    removed = []
    for name in list_segments(shm_dir):
        pid_text = name[len(SEGMENT_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            _unlink(os.path.join(shm_dir, name))
            removed.append(name)
    if removed:
        log.info("removed %d stale shared-memory segments of dead stores", len(removed))
    return removed


class SegmentPool:
    """Spare, pre-faulted segments of `segment_bytes` each, made off the pull's critical path.

    Allocating and zeroing fresh pages costs more than the copy into them, so a spare segment is
    made ahead of time (one at a time, in `executor`) and refilled after each use. A segment is
    never reused after a consumer could have mapped it. Holds `segment_bytes` of shared memory
    while idle; 0 disables the pool.
    """

    def __init__(self, segment_bytes: int, executor: Executor, shm_dir: str = SHM_DIR) -> None:
        self.segment_bytes = segment_bytes
        self.shm_dir = shm_dir
        self._executor = executor
        self._ready: list[Segment] = []
        self._refill: asyncio.Task | None = None
        self._open = False

    def start(self) -> None:
        self._open = True
        self.refill()

    @property
    def bytes_ready(self) -> int:
        return sum(s.size for s in self._ready)

    def refill(self) -> None:
        """Make a spare segment in the background unless one is ready or being made."""
        if (not self._open or self.segment_bytes <= 0 or self._ready
                or (self._refill is not None and not self._refill.done())):
            return

        def make() -> Segment:
            segment = Segment.create(align_up(self.segment_bytes), "pool", self.shm_dir)
            # A first write still costs a fault per page even after MAP_POPULATE; pay it here.
            segment.view(0, segment.size).zero_()
            return segment

        async def refill() -> None:
            segment = await asyncio.get_running_loop().run_in_executor(self._executor, make)
            if self._open:
                self._ready.append(segment)
            else:
                segment.unlink()

        self._refill = asyncio.get_running_loop().create_task(refill())

    async def wait(self) -> None:
        """Wait until the spare segment being made is ready."""
        if self._refill is not None:
            await self._refill

    async def take(self, size: int, tag: str) -> Segment:
        """A segment of at least `size` bytes: a spare one when it fits, else a fresh one."""
        for segment in self._ready:
            if segment.size >= size:
                self._ready.remove(segment)
                return segment  # refilled after the copy, so the two don't share the CPU
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, Segment.create, size, tag, self.shm_dir)

    async def close(self) -> None:
        self._open = False
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refill
        for segment in self._ready:
            segment.unlink()
        self._ready.clear()
