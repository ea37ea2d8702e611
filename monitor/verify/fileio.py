"""The file I/O of a verification: positioned reads through a one-page window, read-ahead
hints to the kernel, and a cap on the read rate. Standard library only.
"""
from __future__ import annotations

import io
import os
import time

PAGE = 4096

_fadvise = getattr(os, "posix_fadvise", None)          # not on macOS
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 0)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 0)
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


class CheckedFile(io.BufferedReader):
    """A buffered file plus a one-page window for pread: a record's data descriptor and the
    next record's local header are adjacent, so one page read serves both (this halves the
    random reads of a structural check on a cold cache)."""

    window = (0, b"")


def open_file(path: str) -> CheckedFile:
    return CheckedFile(io.FileIO(path, "rb"))


def pread(f, offset: int, n: int) -> bytes:
    """n bytes at offset (fewer at the end of the file), without moving the file position."""
    if n <= 0:
        return b""
    win_off, win = f.window
    if win_off <= offset and offset + n <= win_off + len(win):
        return win[offset - win_off:offset - win_off + n]
    want = max(n, PAGE)
    out = os.pread(f.fileno(), want, offset)
    while len(out) < want:
        more = os.pread(f.fileno(), want - len(out), offset + len(out))
        if not more:
            break
        out += more
    if want == PAGE:
        f.window = (offset, out)
    return out[:n]


def will_need(f, offset: int, length: int) -> None:
    """Ask the kernel to fetch a range now, ahead of its read (nothing without fadvise)."""
    if _fadvise is not None:
        _fadvise(f.fileno(), offset, length, _WILLNEED)


def prefetch(f, probe: int, spans) -> bool:
    """Ask the kernel for every (offset, length) in spans at once, so it queues the reads in
    parallel, but only when the page at `probe` is not cached: on cached pages this would cost
    a syscall per span for nothing. Returns whether the file was cold (and spans were asked
    for); False without fadvise."""
    fd = f.fileno()
    if _fadvise is None or is_cached(fd, probe):
        return False
    for offset, length in spans:
        _fadvise(fd, offset, length, _WILLNEED)
    return True


def forget(f, spans) -> None:
    """Drop the cached pages of every (offset, length) in spans (nothing without fadvise)."""
    if _fadvise is None:
        return
    fd = f.fileno()
    for offset, length in spans:
        _fadvise(fd, offset, length, _DONTNEED)


def is_cached(fd: int, offset: int) -> bool:
    """Is the page at offset in the page cache? (preadv2 RWF_NOWAIT fails with EAGAIN if a
    read would have to wait for the disk; unknown, e.g. on NFS, counts as not cached.)"""
    if _NOWAIT is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, _NOWAIT) == 1
    except OSError:
        return False


class Throttle:
    """Keeps the average read rate at or below max_bytes_per_second by sleeping."""

    def __init__(self, max_bytes_per_second: float | None):
        self.rate = max_bytes_per_second if max_bytes_per_second and \
            max_bytes_per_second > 0 else None
        self.start = time.monotonic()
        self.bytes = 0

    def account(self, n: int) -> None:
        if self.rate is None:
            return
        self.bytes += n
        ahead = self.bytes / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)
