"""Shared-memory segments for same-node pulls, who owns them, and the pool of pre-faulted spares.

One segment per object, a file under /dev/shm named `asyncrl-os-<owner>-<id>`. A batch's columns
lie one after another, each starting on a page boundary, so a consumer can map exactly the pages
of the rows it wants.

Ownership does not rest on pids. `<owner>` is the token of the store that made the segment, and
the store holds an exclusive `flock` on its owner file `asyncrl-owner-<owner>` for as long as it
lives. The kernel drops that lock when the process ends, however it ends (SIGKILL, the OOM
killer), and a lock belongs to the file, not to a pid: a sweep that can take it has proved the
owner gone, even when the owner ran in another PID namespace sharing /dev/shm (`--ipc=host`),
where its pid means nothing, or when its pid has since been reused. `remove_stale_segments`
removes only such segments.

Capacity. A tmpfs hands out pages when they are first touched, so a segment larger than what is
left of it used to kill its owner with SIGBUS in the middle of the copy. Now a segment is made
only when `shm_free_bytes` says it fits with room to spare, and its pages are reserved when it is
made (fallocate), so a tmpfs filled by someone else in between is a `ShmFullError` then, with
nothing left behind, and never a SIGBUS later.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from objectstore.errors import ShmFullError
from objectstore.memory import format_bytes

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
SEGMENT_PREFIX = "asyncrl-os-"
OWNER_PREFIX = "asyncrl-owner-"
PAGE = mmap.ALLOCATIONGRANULARITY
# Pre-faulting the whole segment in one syscall is much cheaper than one page fault per 4 KiB
# while copying; Linux only.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# A segment may take at most this share of the free shared memory: the rest stays for others
# (NCCL's and torch's own shared memory, other stores).
SHM_MAX_SHARE = 7 / 8


def align_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Page-aligned offsets for regions of `sizes` bytes, and the segment size."""
    offsets, pos = [], 0
    for size in sizes:
        offsets.append(pos)
        pos = align_up(pos + size)
    return offsets, max(pos, PAGE)


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes still free in the filesystem of `shm_dir` (a tmpfs: its size limit minus its use)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def check_fits(size: int, shm_dir: str, free_bytes: Callable[[str], int] = shm_free_bytes) -> None:
    """ShmFullError unless a segment of `size` bytes fits in `shm_dir` with room to spare."""
    free = free_bytes(shm_dir)
    if size > free * SHM_MAX_SHARE:
        raise ShmFullError(errno.ENOSPC, f"a {format_bytes(size)} segment does not fit in {shm_dir} "
                           f"({format_bytes(free)} free)")


# ownership --------------------------------------------------------------------------------------
def _new_token() -> str:
    return "o" + uuid.uuid4().hex[:15]  # a letter first: never mistaken for a pid of the old scheme


def _is_token(text: str) -> bool:
    return len(text) == 16 and text[0] == "o" and all(c in "0123456789abcdef" for c in text[1:])


class SegmentOwner:
    """A store's claim on its segments: an exclusive flock on its owner file while it lives."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.token = _new_token()
        self.path = os.path.join(shm_dir, OWNER_PREFIX + self.token)
        self._fd: int | None = None

    def acquire(self) -> None:
        # Locked under a name the sweep ignores, then renamed: no sweep can lock the file between
        # its creation and ours.
        tmp = os.path.join(self.shm_dir, f".{OWNER_PREFIX}{self.token}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        self._fd = fd

    def release(self) -> None:
        """Give up the claim; call after the store has unlinked its segments."""
        if self._fd is not None:
            _unlink(self.path)
            os.close(self._fd)
            self._fd = None


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
    def create(cls, size: int, tag: str = "", shm_dir: str = SHM_DIR, *, owner: str) -> Segment:
        """A new segment of `size` bytes owned by the store whose token is `owner`; its pages are
        reserved now (ShmFullError when the filesystem has no room, leaving nothing behind)."""
        name = f"{SEGMENT_PREFIX}{owner}-{tag[:12]}{uuid.uuid4().hex[:12]}"
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            _reserve(fd, size, path)
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


def _reserve(fd: int, size: int, path: str) -> None:
    """Size the file and allocate every page of it now, so no later touch can fault (SIGBUS)."""
    if not hasattr(os, "posix_fallocate"):  # not Linux: sparse, as before
        os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise ShmFullError(errno.ENOSPC, f"no room for a {format_bytes(size)} segment in "
                               f"{os.path.dirname(path)}") from None
        raise


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


def list_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names of every object-store segment in `shm_dir`."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


def list_owner_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Names of every store's owner file in `shm_dir` (one per live store, or per store killed
    since the last sweep)."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(OWNER_PREFIX))
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def _claim_if_gone(shm_dir: str, token: str):
    """Yields True, holding its lock, when the store `token` is provably gone: its owner file is
    unlocked, or absent (the store closed). False when it lives or cannot be checked."""
    try:
        fd = os.open(os.path.join(shm_dir, OWNER_PREFIX + token), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True  # the owner file goes after the segments: the store released them
        return
    except OSError:  # another user's store: not ours to judge
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: the owner lives (in whatever PID namespace)
            yield False
            return
        yield True
    finally:
        os.close(fd)


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments and owner files of stores that are provably gone (their owner file's
    lock is free); returns the segment names removed. Live stores, wherever they run, keep theirs."""
    segments: dict[str, list[str]] = {}
    for name in list_segments(shm_dir):
        token = name[len(SEGMENT_PREFIX):].split("-", 1)[0]
        if _is_token(token):  # names of the old pid scheme prove nothing: left alone
            segments.setdefault(token, []).append(name)
    owners = {n[len(OWNER_PREFIX):] for n in list_owner_files(shm_dir)}
    removed = []
    for token in sorted(owners | set(segments)):
        with _claim_if_gone(shm_dir, token) as gone:
            if not gone:
                continue
            for name in segments.get(token, []):
                _unlink(os.path.join(shm_dir, name))
                removed.append(name)
            _unlink(os.path.join(shm_dir, OWNER_PREFIX + token))
    if removed:
        log.info("removed %d shared-memory segments of stores that are gone", len(removed))
    return removed


class SegmentPool:
    """Spare, pre-faulted segments of `segment_bytes` each, made off the pull's critical path.

    Allocating and zeroing fresh pages costs more than the copy into them, so a spare segment is
    made ahead of time (one at a time, in `executor`) and refilled after each use. A segment is
    never reused after a consumer could have mapped it. Holds `segment_bytes` of shared memory
    while idle; 0 disables the pool. Every segment it makes is checked against the free shared
    memory (`free_bytes`) first: `take` raises ShmFullError, a spare that does not fit is skipped.
    """

    def __init__(self, segment_bytes: int, executor: Executor, shm_dir: str = SHM_DIR, *,
                 owner: SegmentOwner, free_bytes: Callable[[str], int] = shm_free_bytes) -> None:
        self.segment_bytes = segment_bytes
        self.shm_dir = shm_dir
        self.owner = owner
        self.free_bytes = free_bytes
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
            segment = self._create(align_up(self.segment_bytes), "pool")
            # A first write still costs a fault per page even after MAP_POPULATE; pay it here.
            segment.view(0, segment.size).zero_()
            return segment

        async def refill() -> None:
            try:
                segment = await asyncio.get_running_loop().run_in_executor(self._executor, make)
            except ShmFullError as e:  # a pull then makes its own segment, or goes over TCP
                log.debug("no spare shared-memory segment: %s", e)
                return
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
        return await loop.run_in_executor(self._executor, self._create, size, tag)

    def _create(self, size: int, tag: str) -> Segment:
        check_fits(size, self.shm_dir, self.free_bytes)
        return Segment.create(size, tag, self.shm_dir, owner=self.owner.token)

    async def close(self) -> None:
        self._open = False
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refill
        for segment in self._ready:
            segment.unlink()
        self._ready.clear()
