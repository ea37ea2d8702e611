"""The file I/O of a verification: positioned reads through a one-page window, read-ahead
hints to the kernel, and a cap on the read rate. Standard library only.
"""
from __future__ import annotations

import errno
import io
import os
import stat
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


class NotRegularFile(OSError):
    """The path names something that is not a regular file (a FIFO, a device, a socket, a
    directory): never read, since a read could block forever or never end."""


class ChangedFile(OSError):
    """The file opened is not the one that was looked at (replaced in between)."""


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """'a FIFO', 'a character device', ... for what is not a regular file."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "not a regular file"


def open_file(path: str, follow_symlinks: bool = True,
              identity: tuple | None = None) -> CheckedFile:
    """The regular file at `path`, open for reading. Opened without blocking (a FIFO's open
    would wait for a writer) and checked on the descriptor itself, so a name swapped for a
    FIFO or a device after a look at it is never read: NotRegularFile. follow_symlinks=False:
    a symbolic link as the last component is not followed (OSError ELOOP). identity: the
    (st_dev, st_ino) the caller saw; another file is ChangedFile."""
    fd = os.open(path, _OPEN_FLAGS | (0 if follow_symlinks else os.O_NOFOLLOW))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{kind_of(st.st_mode)}, not a regular file")
        if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
            raise ChangedFile(errno.ESTALE, "replaced while it was being looked at")
        os.set_blocking(fd, True)
        return CheckedFile(io.FileIO(fd, "rb", closefd=True))
    except BaseException:
        os.close(fd)
        raise


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
