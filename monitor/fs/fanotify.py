"""Who writes a checkpoint, told by the kernel itself: fanotify (Linux, CAP_SYS_ADMIN).

inotify (monitor.fs.watch) says *that* a file was opened, written or closed, never by whom;
a /proc scan (monitor.fs.procscan) answers "who" after the fact and misses a write shorter than
the scan, which under polling is every ordinary save. A fanotify event carries the pid of the
process that opened, modified or closed the file, queued by the kernel in the order things
happened, so even a save of a few microseconds is attributed, in either observer mode (for
this node's processes: no local mechanism sees other NFS clients).

This module only reads events. monitor.fs.tracker.ExactAttribution turns them into write
intervals; the structure (create, delete, rename, root lost) still comes from fswatch.

Marks: one mount mark (FAN_MARK_MOUNT) per mount holding a watched root. A mount mark covers
every file below, directories created later included, with no per-directory bookkeeping; the
price is that events for other files on the same mount are read and dropped (counted in
stats()["unrelated"]), which on a busy shared mount costs the agent a few us per event.
`--watch.attribution proc` turns this off.

Events asked for: FAN_OPEN, FAN_MODIFY, FAN_CLOSE_WRITE, FAN_CLOSE_NOWRITE, reported with the
file's name as it was when the event happened (FAN_REPORT_DFID_NAME, Linux 5.9+; see Fanotify
for why not a descriptor). The kernel merges a new event into a queued, unread one of the
same file, name and pid (open, writes and close of a short save can arrive as one event),
keeping the place of the first. So each event also carries `since`, a time before which
nothing it reports happened (FanotifyWatcher._since). A merged write lies within
[since, read time]. A full queue (16384 events by default) is reported as FAN_Q_OVERFLOW:
counted, and the caller rescans.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

log = logging.getLogger("ckptwatch.fanotify")

# <linux/fanotify.h>
FAN_MODIFY = 0x00000002
FAN_CLOSE_WRITE = 0x00000008
FAN_CLOSE_NOWRITE = 0x00000010
FAN_OPEN = 0x00000020
FAN_Q_OVERFLOW = 0x00004000
FAN_CLOEXEC = 0x00000001
FAN_NONBLOCK = 0x00000002
FAN_CLASS_NOTIF = 0x00000000
FAN_REPORT_DIR_FID = 0x00000400
FAN_REPORT_NAME = 0x00000800
FAN_REPORT_DFID_NAME = FAN_REPORT_DIR_FID | FAN_REPORT_NAME
FAN_EVENT_INFO_TYPE_DFID_NAME = 2
FAN_MARK_ADD = 0x00000001
FAN_MARK_MOUNT = 0x00000010
FAN_NOFD = -1
FANOTIFY_METADATA_VERSION = 3
MASK = FAN_OPEN | FAN_MODIFY | FAN_CLOSE_WRITE | FAN_CLOSE_NOWRITE

# struct fanotify_event_metadata: event_len, vers, reserved, metadata_len, mask, fd, pid
_META = struct.Struct("=IBBHQii")
_INFO_HEADER = struct.Struct("=BBH")      # struct fanotify_event_info_header
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_MAX_DIRS = 4096
DIR_CACHE_SECONDS = 1.0
_AT_FDCWD = -100
_READ_SIZE = 64 * 1024                    # ~1,000 events per read(2)
# metadata + info header + fsid + file_handle (<= 128 bytes) + a 255-byte name + NUL
_MAX_EVENT_SIZE = 24 + 4 + 8 + 8 + 128 + 256
_DELETED = " (deleted)"
# How late the reader thread may wake after the first event of a read was queued (GIL and
# scheduler delays): the bound on how early a merged event's open may lie before the wakeup.
WAKE_SLACK = 0.05


@dataclass(frozen=True)
class FanEvent:
    """One kernel event for a file below a watched root: `mask` may combine several kinds
    (merged events); mono/wall are when the agent read it, mono strictly increasing in the
    kernel's queue order."""

    mask: int
    pid: int
    path: str
    mono: float
    wall: float
    since: float = 0.0          # monotonic: what the event reports happened after this
    since_wall: float = 0.0


class _Libc:
    def __init__(self):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.init = libc.fanotify_init
        self.init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        self.init.restype = ctypes.c_int
        self.mark = libc.fanotify_mark
        self.mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                              ctypes.c_char_p]
        self.mark.restype = ctypes.c_int
        self.open_by_handle_at = libc.open_by_handle_at
        self.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.open_by_handle_at.restype = ctypes.c_int


_libc: _Libc | None = None


def _lib() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


class Fanotify:
    """A notification-class fanotify group that reports names (FAN_REPORT_DFID_NAME, Linux
    5.9+): open, mark, read. Raises OSError (EPERM without CAP_SYS_ADMIN, EINVAL/ENOSYS where
    the kernel lacks it).

    Names, not file descriptors: with a descriptor the name is looked up when the agent reads
    the event, and an atomic save's temporary file has been renamed onto the checkpoint by
    then, so its writes would be taken for writes of the checkpoint itself (and two ranks'
    temporary files for a concurrent collision). With FAN_REPORT_DFID_NAME the kernel records
    the parent directory's file handle and the entry's name when the event happens; the
    directory is resolved to a path through open_by_handle_at (cached per directory).
    """

    def __init__(self):
        try:
            lib = _lib()
        except (OSError, AttributeError) as exc:    # no libc symbol: not Linux
            raise OSError(errno.ENOSYS, f"fanotify is not available: {exc}") from None
        fd = lib.init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME,
                      os.O_RDONLY | getattr(os, "O_LARGEFILE", 0) | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        self.fd = fd
        self.drained = True          # whether the last read() emptied the queue
        self._mount_fds: list[int] = []        # one open directory per marked filesystem
        self._dirs: OrderedDict[bytes, tuple] = OrderedDict()   # handle -> (path, when)

    def mark_mount(self, path: str, mask: int = MASK) -> None:
        r = _lib().mark(self.fd, FAN_MARK_ADD | FAN_MARK_MOUNT, mask, _AT_FDCWD,
                        os.fsencode(path))
        if r < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_mark {path}: {os.strerror(err)}")
        # open_by_handle_at needs any descriptor on the same filesystem.
        self._mount_fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))

    def read(self) -> list[tuple[int, int, str | None]]:
        """(mask, pid, path) of the events queued now (path None for an overflow or a file
        that could not be named); [] when none are."""
        try:
            buf = os.read(self.fd, _READ_SIZE)
        except BlockingIOError:
            self.drained = True
            return []
        # A nearly full buffer may have left events in the queue (older than this read).
        self.drained = len(buf) <= _READ_SIZE - _MAX_EVENT_SIZE
        out, pos = [], 0
        while pos + _META.size <= len(buf):
            event_len, vers, _, meta_len, mask, fd, pid = _META.unpack_from(buf, pos)
            if event_len < _META.size or vers != FANOTIFY_METADATA_VERSION:
                break                                   # a kernel ABI we do not know
            if fd >= 0:                                 # not in name mode; never leak it
                os.close(fd)
            out.append((mask, pid, self._name(buf, pos + meta_len, pos + event_len)))
            pos += event_len
        return out

    def _name(self, buf: bytes, pos: int, end: int) -> str | None:
        """The path in the event's DFID_NAME info record: directory handle + entry name."""
        while pos + 4 <= end:
            info_type, _, length = _INFO_HEADER.unpack_from(buf, pos)
            if length < 4:
                return None
            if info_type == FAN_EVENT_INFO_TYPE_DFID_NAME:
                handle_at = pos + 4 + 8                 # header, then __kernel_fsid_t
                handle_bytes = struct.unpack_from("=I", buf, handle_at)[0]
                handle = buf[handle_at:handle_at + 8 + handle_bytes]
                name_at = handle_at + 8 + handle_bytes
                name = buf[name_at:pos + length].split(b"\0", 1)[0]
                directory = self._directory(handle)
                if directory is None:
                    return None
                return os.path.join(directory, os.fsdecode(name))
            pos += length
        return None

    def _directory(self, handle: bytes) -> str | None:
        now = time.monotonic()
        cached = self._dirs.get(handle)
        # Short-lived: a renamed directory (a trainer's staging dir renamed to checkpoint-N)
        # keeps its handle but changes its path.
        if cached is not None and now - cached[1] < DIR_CACHE_SECONDS:
            return cached[0]
        path = None
        for mount_fd in self._mount_fds:
            fd = _lib().open_by_handle_at(mount_fd, handle, _O_PATH | os.O_CLOEXEC)
            if fd < 0:
                continue                                # ESTALE / another filesystem
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = None
            finally:
                os.close(fd)
            break
        if path is not None and path.endswith(_DELETED):
            return None                                 # gone: do not cache
        self._dirs[handle] = (path, now)
        self._dirs.move_to_end(handle)
        if len(self._dirs) > _MAX_DIRS:
            self._dirs.popitem(last=False)
        return path

    def close(self) -> None:
        for fd in self._mount_fds:
            os.close(fd)
        self._mount_fds = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def available(path: str = "/") -> tuple[bool, str]:
    """(usable here, why not): creates a group and marks the mount holding `path`, which is
    what FanotifyWatcher.start does (a mount mark needs CAP_SYS_ADMIN in the initial user
    namespace, so creating the group alone proves too little)."""
    try:
        fan = Fanotify()
    except OSError as exc:
        return False, why(exc)
    try:
        fan.mark_mount(_existing_ancestor(path))
    except OSError as exc:
        return False, why(exc)
    finally:
        fan.close()
    return True, ""


def why(exc: OSError) -> str:
    if exc.errno == errno.EPERM:
        return "fanotify needs CAP_SYS_ADMIN (run the agent privileged or as root)"
    return str(exc.strerror or exc)


class FanotifyWatcher:
    """Reads fanotify events for files below `roots`, on its own thread, and hands them to
    `on_event` (FanEvent). An overflow calls `on_overflow()`. Every file below a root is
    passed on, not only checkpoint names: the temporary file of an atomic save is renamed
    into place, and its writer is the checkpoint's.

    Events of `exclude_pids` (default: this agent: its verifier reads checkpoints) and of
    files outside the roots are dropped and counted.
    """

    def __init__(self, roots: Iterable[str],
                 on_event: Callable[[FanEvent], None], on_overflow: Callable[[], None],
                 exclude_pids: Iterable[int] | None = None):
        self._roots = sorted({os.path.realpath(r).rstrip(os.sep) or os.sep for r in roots})
        self._prefixes = tuple(r if r == os.sep else r + os.sep for r in self._roots)
        self._on_event = on_event
        self._on_overflow = on_overflow
        self._exclude = set(exclude_pids) if exclude_pids is not None else {os.getpid()}
        self._fan: Fanotify | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._last_mono = 0.0
        self._drained_at = 0.0         # when the last read that emptied the queue began
        self._idle = True              # whether the previous read emptied the queue
        self._stats = {"events": 0, "relevant": 0, "unrelated": 0, "overflows": 0,
                       "unnamed": 0, "mounts": 0}

    def start(self) -> None:
        """Creates the group and marks the mounts; raises OSError when it cannot."""
        fan = Fanotify()
        try:
            marked = set()
            for root in self._roots:
                anchor = _existing_ancestor(root)
                mount = _mount_point(anchor)
                if mount in marked:
                    continue
                fan.mark_mount(anchor)
                marked.add(mount)
        except OSError:
            fan.close()
            raise
        self._stats["mounts"] = len(marked)
        self._fan = fan
        self._drained_at = time.monotonic()       # nothing is queued before this
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="ckptwatch-fanotify",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._fan is not None:
            self._fan.close()
            self._fan = None

    def stats(self) -> dict:
        return dict(self._stats)

    def relevant(self, path: str) -> bool:
        return path.startswith(self._prefixes)

    def _run(self) -> None:
        fan = self._fan
        while True:
            try:
                ready, _, _ = select.select([fan.fd, self._wake_r], [], [])
            except InterruptedError:
                continue
            if self._wake_r in ready:
                return
            now, now_wall = time.monotonic(), time.time()
            since = self._since(now)
            try:
                batch = fan.read()
                self._drained(fan.drained, now)
                self._handle(batch, since, now_wall - (now - since))
            except Exception:                 # never let one odd event end observation
                log.exception("fanotify event handling failed")

    def _since(self, now: float) -> float:
        """A time no event of the read starting at `now` can predate. Every event was queued
        after the last read that emptied the queue began. If that read was the previous one,
        the thread then sat idle in select until the first new event woke it, so the events
        are also at most WAKE_SLACK older than `now`: an idle hour must not stretch a merged
        write over that hour. In a burst (the previous read left events queued) only the
        first bound holds."""
        if self._idle:
            return max(self._drained_at, now - WAKE_SLACK)
        return self._drained_at

    def _drained(self, drained: bool, read_began: float) -> None:
        self._idle = drained
        if drained:
            self._drained_at = read_began

    def _handle(self, events, since: float = 0.0, since_wall: float = 0.0) -> None:
        for mask, pid, path in events:
            # When read, made strictly increasing in queue order: one read(2) returns many
            # events, and the queue's order is what tells whether two writes overlapped.
            mono = self._last_mono = max(time.monotonic(), self._last_mono + 1e-6)
            wall = time.time()
            self._stats["events"] += 1
            if mask & FAN_Q_OVERFLOW:
                self._stats["overflows"] += 1
                log.warning("fanotify queue overflow: events were lost; rescanning")
                self._on_overflow()
                continue
            if path is None:
                self._stats["unnamed"] += 1
                continue
            if pid in self._exclude or not self.relevant(path):
                self._stats["unrelated"] += 1
                continue
            self._stats["relevant"] += 1
            self._on_event(FanEvent(mask, pid, path, mono, wall, since, since_wall))


def _nearest(path: str, accept: Callable[[str], bool]) -> str:
    """`path` or its closest ancestor that `accept`s (the filesystem root at worst)."""
    while not accept(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _existing_ancestor(path: str) -> str:
    return _nearest(path, os.path.exists)


def _mount_point(path: str) -> str:
    return _nearest(os.path.realpath(path), os.path.ismount)
