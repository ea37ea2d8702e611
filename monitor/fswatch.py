"""Filesystem observation of checkpoint directories (watchdog), and fs-side write tracking.

Three layers, as in watchdog itself:

- FsEventHandler translates watchdog events into small immutable FsEvent values (no threads,
  no state beyond the patterns and the root list).
- Watcher owns the observers: inotify where it works, polling where asked or where inotify
  runs out of watches, per root. A maintenance thread re-arms roots that were deleted and
  recreated, performs fallbacks, reports inotify queue overflows (followed by a rescan) and,
  under polling, turns "size and mtime stable across two polls" into a synthetic
  closed_write (polling cannot see close(2)).
- WriteTracker (pure, no threads) turns FsEvents plus procscan attributions into write
  intervals per (path, pid), emitted as hook-shaped "start"/"end" event dicts with
  "source": "fs", and into findings: fs_collision, size_fluctuation, torn_read.

Written against watchdog 7.1 (inotify reports FileOpenedEvent / FileClosedEvent /
FileClosedNoWriteEvent; a kernel IN_Q_OVERFLOW reaches InotifyFD.handle_event and then every
watch group's on_queue_overflow, which rebuilds recursive watches but tells no handler). Two
small subclasses hook those points; see _InotifyFD and _WatchGroup.

inotify sees only changes made through this node's kernel: on NFS / Lustre / GPFS other nodes'
writes are invisible to it, so use mode="polling" there (see docs/fswatch.md).
"""
from __future__ import annotations

import errno
import fnmatch
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from watchdog.events import FileSystemEventHandler
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from monitor.events import SCHEMA_VERSION

try:   # Linux only
    from watchdog.observers.inotify import InotifyEmitter, InotifyObserver, InotifyWatchGroup
    from watchdog.observers.inotify_c import InotifyFD
except (ImportError, OSError):   # pragma: no cover - not Linux
    InotifyEmitter = InotifyObserver = InotifyWatchGroup = InotifyFD = None

log = logging.getLogger("ckptwatch.fswatch")

DEFAULT_PATTERNS = ("*.pt", "*.pth", "*.bin", "*.ckpt", "*.safetensors", "*.distcp")
MODES = ("auto", "inotify", "polling")
# Paths named by hook events that count as checkpoints whatever their names (bounded).
MAX_NAMED = 10000
SOURCE_FS = "fs"

# FsEvent kinds.
OPENED = "opened"
MODIFIED = "modified"
CLOSED_WRITE = "closed_write"
CLOSED_NOWRITE = "closed_nowrite"
CREATED = "created"
MOVED = "moved"
DELETED = "deleted"
OVERFLOW = "overflow"
ROOT_LOST = "root_lost"
KINDS = (OPENED, MODIFIED, CLOSED_WRITE, CLOSED_NOWRITE, CREATED, MOVED, DELETED, OVERFLOW,
         ROOT_LOST)

# watchdog event_type -> our kind (file events only).
_KIND_BY_TYPE = {"opened": OPENED, "modified": MODIFIED, "closed": CLOSED_WRITE,
                 "closed_no_write": CLOSED_NOWRITE, "created": CREATED, "moved": MOVED,
                 "deleted": DELETED}

# Root states (Watcher.stats()["roots"][root]["state"]).
WATCHING = "watching"
LOST = "lost"          # was watched, then deleted (or its watch died); re-armed when it returns
MISSING = "missing"    # did not exist when the watcher started


@dataclass(frozen=True)
class FsEvent:
    """One filesystem observation.

    kind: one of KINDS. path: absolute path (for "moved" the source; dest is the target; for
    "overflow" / "root_lost" the watched root). size: st_size right after the event was
    dispatched (None for deletions or when stat failed) -- "after", not "at": the file may
    have changed in between. mono / wall: time.monotonic() / time.time() at dispatch.
    """

    kind: str
    path: str
    size: int | None
    mono: float
    wall: float
    dest: str | None = None

    @property
    def target(self) -> str:
        """The path the file has after the event (dest for moves)."""
        return self.dest or self.path


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


class FsEventHandler(FileSystemEventHandler):
    """Translates watchdog file events into FsEvents for `sink`; ignores everything else.

    A moved file counts when either name matches (an atomic save renames `x.pt.tmp` to
    `x.pt`). A DirDeletedEvent for a watched root calls `on_root_deleted(root)`.
    """

    def __init__(self, sink: Callable[[FsEvent], None], patterns: Iterable[str] = DEFAULT_PATTERNS,
                 roots: Iterable[str] = (), on_root_deleted: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        super().__init__()
        self._sink = sink
        self._patterns = tuple(patterns)
        self._named: set[str] = set()    # exact paths that count whatever their name
        self._roots = frozenset(os.path.abspath(r) for r in roots)
        self._on_root_deleted = on_root_deleted
        self._clock = clock
        self._wall_clock = wall_clock

    def add_path(self, path: str) -> bool:
        """Count `path` as a checkpoint whatever its name; False once MAX_NAMED are held."""
        if path in self._named:
            return True
        if len(self._named) >= MAX_NAMED:
            return False
        self._named.add(path)
        return True

    def matches(self, path: str) -> bool:
        if path in self._named:
            return True
        name = os.path.basename(path)
        return any(fnmatch.fnmatchcase(name, p) for p in self._patterns)

    def dispatch(self, event) -> None:
        try:
            self._dispatch(event)
        except Exception:   # an exception here would end watchdog's dispatcher thread
            log.exception("cannot translate %r", event)

    def _dispatch(self, event) -> None:
        src = os.fsdecode(event.src_path)
        if event.is_directory:
            if event.event_type == "deleted" and src in self._roots and self._on_root_deleted:
                self._on_root_deleted(src)
            return
        kind = _KIND_BY_TYPE.get(event.event_type)
        if kind is None:
            return
        dest = os.fsdecode(event.dest_path) if event.dest_path else None
        if not (self.matches(src) or (dest is not None and self.matches(dest))):
            return
        size = None if kind == DELETED else _size(dest or src)
        self._sink(FsEvent(kind, src, size, self._clock(), self._wall_clock(), dest))


# ---------------------------------------------------------------------- inotify hooks

if InotifyFD is not None:

    class _InotifyFD(InotifyFD):
        """Reports each kernel queue overflow once (watchdog only tells the watch groups)."""

        def __init__(self, on_overflow: Callable[[], None]):
            super().__init__()
            self._on_overflow = on_overflow

        def handle_event(self, event) -> None:
            if event.is_queue_overflow:
                self._on_overflow()
            super().handle_event(event)

    @dataclass(eq=False)
    class _WatchGroup(InotifyWatchGroup):
        """watchdog's watch group, but a watch that fails with ENOSPC below the root is
        reported (watchdog skips it silently, leaving that subtree unwatched)."""

        on_limit: Callable[[str, OSError], None] | None = None

        def _add_callback(self, path: bytes) -> None:   # mirrors watchdog 7.1's version
            try:
                wd = self._inotify_fd.add_callback(path, self.event_mask, self._callback,
                                                   self._id)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EMFILE) and self.on_limit is not None:
                    self.on_limit(os.fsdecode(self.path), exc)
                if path == self.path:
                    raise
                return
            self._active_callbacks_by_path[path] = wd
            self._active_callbacks_by_watch[wd] = path

    class _InotifyEmitter(InotifyEmitter):
        def __init__(self, event_queue, watch, *, timeout, event_filter=None, inotify_fd=None,
                     on_limit=None):
            super().__init__(event_queue, watch, timeout=timeout, event_filter=event_filter,
                             inotify_fd=inotify_fd)
            self._on_limit = on_limit

        def on_thread_start(self) -> None:   # mirrors watchdog 7.1, with our watch group
            self._inotify = _WatchGroup(
                self._inotify_fd, os.fsencode(self.watch.path),
                is_recursive=self.watch.is_recursive,
                event_mask=self.get_event_mask_from_filter(),
                follow_symlink=self.watch.follow_symlink, on_limit=self._on_limit)

    class _InotifyObserver(InotifyObserver):
        """InotifyObserver with our FD and emitter (its own inotify instance, as upstream)."""

        fd_class = _InotifyFD   # a seam for tests (a FD whose add_callback fails)

        def __init__(self, on_overflow, on_limit, timeout: float = 1.0):
            self._inotify_fd = self.fd_class(on_overflow)
            self._inotify_fd.start()
            BaseObserver.__init__(self, _InotifyEmitter, timeout=timeout,
                                  inotify_fd=self._inotify_fd, on_limit=on_limit)


def inotify_available() -> bool:
    return InotifyFD is not None


# ---------------------------------------------------------------------- Watcher

@dataclass
class _Root:
    path: str
    mode: str | None = None           # "inotify" | "polling" while watched
    state: str = MISSING
    watch: object = None
    observer: object = None
    ident: tuple | None = None        # (st_dev, st_ino) of the directory we watch
    fallback: str | None = None       # why this root is polled although inotify was wanted
    rearms: int = 0
    losses: int = 0
    was_watched: bool = False


class Watcher:
    """Watches checkpoint directories recursively and calls on_event(FsEvent).

    roots: directories (need not exist yet: a missing root is armed when it appears).
    mode: "auto" (inotify on Linux, else polling), "inotify", or "polling".
    on_event(ev) is called from watcher threads (observer dispatchers and the maintenance
    thread): it must be thread-safe and quick; the agent puts events on its own queue.
    on_rescan(root) is called (maintenance thread) when events under `root` may have been
    missed: after an inotify queue overflow and after a lost root is watched again. The
    consumer should re-stat the checkpoints under `root` and re-attribute open ones.
    """

    def __init__(self, roots: Iterable[str], patterns: Iterable[str] = DEFAULT_PATTERNS,
                 mode: str = "auto", poll_interval: float = 1.0,
                 on_event: Callable[[FsEvent], None] | None = None,
                 on_rescan: Callable[[str], None] | None = None,
                 rearm_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if mode == "inotify" and not inotify_available():
            raise ValueError("mode 'inotify' needs Linux inotify")
        if poll_interval <= 0 or rearm_interval <= 0:
            raise ValueError("poll_interval and rearm_interval must be > 0")
        self.mode = mode
        self.poll_interval = float(poll_interval)
        self.rearm_interval = float(rearm_interval)
        # Real paths: procscan reports open files by their resolved paths, and inotify would
        # watch a symlinked root's link, not the directory.
        self._roots = {p: _Root(p) for p in dict.fromkeys(os.path.realpath(r) for r in roots)}
        self._on_event = on_event or (lambda ev: None)
        self._on_rescan = on_rescan or (lambda root: None)
        self._clock = clock
        self._wall_clock = wall_clock
        self._handler = FsEventHandler(self._emit, patterns, self._roots, self._root_deleted,
                                       clock, wall_clock)
        # _lock guards counters, pending work and the unsettled map. It is never held while
        # calling into an observer: watchdog dispatches with its own lock held, and our sink
        # takes this one.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._inotify: BaseObserver | None = None
        self._polling: BaseObserver | None = None
        self._pending_overflows = 0
        self._next_overflow_rescan = -float("inf")
        self._pending_fallbacks: dict[str, str] = {}
        self._unsettled: dict[str, tuple] = {}    # path -> (size, mtime_ns, since mono)
        self._counts = {"events": 0, "events_lost": 0, "overflows": 0, "rescans": 0,
                        "fallbacks": 0, "root_losses": 0, "rearms": 0, "errors": 0,
                        "synthetic_closes": 0}
        self._started = False

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        """Arm every existing root and start the maintenance thread."""
        if self._started:
            return
        self._started = True
        try:
            for root in self._roots.values():
                self._arm(root)
            self._thread = threading.Thread(target=self._run, name="ckptwatch-fswatch",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.stop()   # no observer thread outlives a failed start
            raise

    def stop(self) -> None:
        """Stop every thread this watcher started (idempotent)."""
        if not self._started or self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        for observer in (self._inotify, self._polling):
            if observer is not None:
                observer.stop()
                observer.join()

    def matches(self, path: str) -> bool:
        """Whether `path` counts as a checkpoint (patterns, or named by add_path)."""
        return self._handler.matches(path)

    def add_path(self, path: str) -> bool:
        """Watch `path` as a checkpoint although no pattern matches it (the agent calls this
        for each path a hook event names). Thread-safe; False when the bound is reached."""
        return self._handler.add_path(os.path.abspath(path))

    def stats(self) -> dict:
        """Counters plus per-root health: {"roots": {root: {"mode", "state", "fallback",
        "rearms", "losses"}}, "events", "events_lost", "overflows", "rescans", "fallbacks",
        "root_losses", "rearms", "errors", "synthetic_closes", "unsettled"}.

        events_lost counts inotify queue overflows: the kernel does not say how many events
        one overflow dropped.
        """
        with self._lock:
            out = dict(self._counts)
            out["unsettled"] = len(self._unsettled)
        out["mode"] = self.mode
        out["roots"] = {r.path: {"mode": r.mode, "state": r.state, "fallback": r.fallback,
                                 "rearms": r.rearms, "losses": r.losses}
                        for r in list(self._roots.values())}
        return out

    def health(self) -> dict:
        """{"ok": every root watched, "roots": {root: state}}."""
        roots = {r.path: r.state for r in list(self._roots.values())}
        return {"ok": all(s == WATCHING for s in roots.values()), "roots": roots}

    # ------------------------------------------------------------------ observers

    def _make_inotify_observer(self) -> BaseObserver:
        """The inotify observer (a seam: tests substitute one that fails to schedule)."""
        return _InotifyObserver(self._note_overflow, self._note_limit)

    def _make_polling_observer(self) -> BaseObserver:
        return PollingObserver(timeout=self.poll_interval)

    def _observer(self, mode: str) -> BaseObserver:
        if mode == "inotify":
            if self._inotify is None:
                self._inotify = self._make_inotify_observer()
                self._inotify.start()
            return self._inotify
        if self._polling is None:
            self._polling = self._make_polling_observer()
            self._polling.start()
        return self._polling

    def _arm(self, root: _Root) -> bool:
        """Schedule `root` on the observer for its mode; False if it does not exist."""
        try:
            st = os.stat(root.path)
        except OSError:
            self._set_root(root, state=MISSING if not root.was_watched else LOST)
            return False
        want = "polling" if (self.mode == "polling" or root.fallback
                             or not inotify_available()) else "inotify"
        if want == "inotify":
            try:
                watch = self._observer("inotify").schedule(self._handler, root.path,
                                                           recursive=True)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    self._set_root(root, state=LOST if root.was_watched else MISSING)
                    return False
                reason = _fallback_reason(exc)
                log.warning("inotify cannot watch %s (%s); polling it every %.1fs instead",
                            root.path, exc, self.poll_interval)
                self._count("fallbacks")
                self._set_root(root, fallback=reason)
                want = "polling"
            else:
                self._set_root(root, mode="inotify", watch=watch, observer=self._inotify)
        if want == "polling":
            try:
                watch = self._observer("polling").schedule(self._handler, root.path,
                                                           recursive=True)
            except OSError as exc:
                log.warning("cannot watch %s: %s", root.path, exc)
                self._count("errors")
                self._set_root(root, state=LOST if root.was_watched else MISSING)
                return False
            self._set_root(root, mode="polling", watch=watch, observer=self._polling)
        self._set_root(root, state=WATCHING, ident=(st.st_dev, st.st_ino))
        root.was_watched = True
        return True

    def _disarm(self, root: _Root) -> None:
        observer, watch = root.observer, root.watch
        self._set_root(root, mode=None, watch=None, observer=None)
        if observer is not None and watch is not None:
            try:
                observer.unschedule(watch)
            except (KeyError, RuntimeError):
                pass   # already gone with its emitter

    def _watch_alive(self, root: _Root) -> bool:
        for emitter in list(root.observer.emitters):
            if emitter.watch == root.watch:
                return emitter.is_alive()
        return False

    def _set_root(self, root: _Root, **changes) -> None:
        with self._lock:
            for name, value in changes.items():
                setattr(root, name, value)

    # ------------------------------------------------------------------ callbacks

    def _emit(self, ev: FsEvent) -> None:
        with self._lock:
            self._counts["events"] += 1
            if (ev.kind in (CREATED, MODIFIED, MOVED) and self._polled(ev.target)
                    and ev.size is not None):
                self._unsettled[ev.target] = (ev.size, _mtime_ns(ev.target), ev.mono)
            elif ev.kind in (DELETED, MOVED):
                self._unsettled.pop(ev.path, None)
        try:
            self._on_event(ev)
        except Exception:
            self._count("errors")
            log.exception("on_event failed for %s", ev)

    def _polled(self, path: str) -> bool:
        # Called with _lock held; root fields are only written under it.
        for root in self._roots.values():
            if root.mode == "polling" and (path + os.sep).startswith(root.path + os.sep):
                return True
        return False

    def _root_deleted(self, root: str) -> None:
        self._wake.set()

    def _note_overflow(self) -> None:
        # InotifyFD thread: count now, do the work (events, rescans) on the maintenance thread.
        with self._lock:
            self._counts["events_lost"] += 1
            self._counts["overflows"] += 1
            self._pending_overflows += 1
        self._wake.set()

    def _note_limit(self, root: str, exc: OSError) -> None:
        with self._lock:
            self._pending_fallbacks[root] = _fallback_reason(exc)
        self._wake.set()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # ------------------------------------------------------------------ maintenance

    def _run(self) -> None:
        while not self._stopping.is_set():
            polled = any(r.mode == "polling" for r in list(self._roots.values()))
            interval = min(self.rearm_interval, self.poll_interval) if polled \
                else self.rearm_interval
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self._maintain()
            except Exception:   # never let the maintenance thread die
                self._count("errors")
                log.exception("fswatch maintenance failed")

    def _maintain(self) -> None:
        now = self._clock()
        with self._lock:
            # Overflows come in storms: one rescan per rearm_interval covers all of them.
            overflows = self._pending_overflows if now >= self._next_overflow_rescan else 0
            self._pending_overflows -= overflows
            fallbacks, self._pending_fallbacks = self._pending_fallbacks, {}
        if overflows:
            self._next_overflow_rescan = now + self.rearm_interval
            log.warning("inotify queue overflowed %d time(s): events were lost, rescanning",
                        overflows)
            for root in list(self._roots.values()):
                if root.mode == "inotify" and root.state == WATCHING:
                    self._emit(FsEvent(OVERFLOW, root.path, None, self._clock(),
                                       self._wall_clock()))
                    self._rescan(root)
        for path, reason in fallbacks.items():
            root = self._roots.get(path)
            if root is not None and root.mode == "inotify":
                log.warning("inotify watch limit reached under %s; polling it every %.1fs",
                            path, self.poll_interval)
                self._count("fallbacks")
                self._disarm(root)
                self._set_root(root, fallback=reason)
                if self._arm(root):
                    self._rescan(root)
        for root in list(self._roots.values()):
            self._check_root(root)
        self._settle_polled()

    def _check_root(self, root: _Root) -> None:
        if root.state == WATCHING:
            try:
                st = os.stat(root.path)
                same = (st.st_dev, st.st_ino) == root.ident
            except OSError:
                same = False
            if same and self._watch_alive(root):
                return
            log.warning("watched root %s is gone; watching it again when it returns", root.path)
            self._disarm(root)
            self._set_root(root, state=LOST, losses=root.losses + 1)
            self._count("root_losses")
            self._emit(FsEvent(ROOT_LOST, root.path, None, self._clock(), self._wall_clock()))
        if root.state in (LOST, MISSING) and os.path.isdir(root.path):
            again = root.was_watched
            if self._arm(root):
                if again:
                    self._set_root(root, rearms=root.rearms + 1)
                    self._count("rearms")
                    log.info("watching %s again", root.path)
                self._rescan(root)

    def _rescan(self, root: _Root) -> None:
        self._count("rescans")
        try:
            self._on_rescan(root.path)
        except Exception:
            self._count("errors")
            log.exception("on_rescan failed for %s", root.path)

    def _settle_polled(self) -> None:
        """Polling cannot see close(2): a file whose size and mtime did not change across
        two polls is taken as finished and reported as a synthetic closed_write."""
        now = self._clock()
        with self._lock:
            items = list(self._unsettled.items())
        for path, (size, mtime, since) in items:
            if now - since < self.poll_interval:
                continue
            try:
                st = os.stat(path)
            except OSError:
                with self._lock:
                    self._unsettled.pop(path, None)
                continue
            with self._lock:
                if self._unsettled.get(path) != (size, mtime, since):
                    continue   # a newer event replaced it meanwhile
                if (st.st_size, st.st_mtime_ns) != (size, mtime):
                    self._unsettled[path] = (st.st_size, st.st_mtime_ns, now)
                    continue
                del self._unsettled[path]
                self._counts["synthetic_closes"] += 1
            self._emit(FsEvent(CLOSED_WRITE, path, st.st_size, now, self._wall_clock()))


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _fallback_reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "watch_limit"
    if exc.errno == errno.EMFILE:
        return "instance_limit"
    return "error"


# ---------------------------------------------------------------------- WriteTracker

# Finding types (not wire events: the agent consumes them directly).
FS_COLLISION = "fs_collision"
SIZE_FLUCTUATION = "size_fluctuation"
TORN_READ = "torn_read"
# fs writes get seq numbers far above any hook's per-process counter, so the detector's
# (node, pid, seq) pairing never mixes an fs interval with a hook interval of the same pid.
FS_SEQ_BASE = 1 << 48
OUTCOME_DELETED = "deleted"
OUTCOME_LOST = "lost"


@dataclass
class _Open:
    proc: object           # procscan.ProcWriter
    seq: int
    start_mono: float
    start_wall: float
    path: str


@dataclass
class _PathState:
    writers: dict = field(default_factory=dict)    # pid -> _Open
    readers: dict = field(default_factory=dict)    # pid -> ProcWriter


class WriteTracker:
    """Pure: FsEvents + attributions -> write intervals and fs findings (see module doc).

    observe(ev, holders) takes the event and, when the caller attributed it, `holders`: every
    process holding ev's path open right after the event (procscan.ProcScanner.holders_of),
    or None when not attributed. It returns a list of dicts:

    - "start" / "end" events in the shape of monitor/events.py (validate() accepts them), one
      interval per (path, pid) from the first attribution that shows the pid holding the path
      for writing to the first one that does not (or the file's deletion), plus
      "source": "fs". Times are those of the FsEvents, i.e. of the agent seeing them.
    - fs_collision: a pid starts writing a path another pid is writing; lists all writers.
    - size_fluctuation: the file shrank while two or more pids held it open for writing. A
      shrink with at most one writer (a save truncating its own file as it starts) is
      normal: it is only counted, in counts["truncations"]. The last size of every path
      seen is kept (bounded by max_paths) so the first open of a new save compares
      against the previous file.
    - torn_read: a pid opened the path read-only while another pid was writing it.

    Findings carry "v", "type", "source": "fs", "node", "path", "wall", "mono", "job" (the
    metric label) and "writers" (identity dicts with mode, seq and start times).
    """

    def __init__(self, node: str = "", max_paths: int = 10000):
        self._node = node
        self._max_paths = max_paths
        self._paths: dict[str, _PathState] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._seq = itertools.count(FS_SEQ_BASE)
        self.counts = {FS_COLLISION: 0, SIZE_FLUCTUATION: 0, TORN_READ: 0, "starts": 0,
                       "ends": 0, "truncations": 0}

    def needs_attribution(self, ev: FsEvent) -> bool:
        """Whether the caller should attribute `ev` (a procscan) before observe()."""
        if ev.kind in (OPENED, CLOSED_WRITE, CLOSED_NOWRITE):
            return True
        # Also on every write: inotify reports an open from inside open(2), before the new fd
        # is visible in /proc, so the scan for the open itself can miss the opener. The
        # scanner's per-path rate limit keeps a stream of writes to a few scans.
        return ev.kind in (CREATED, MODIFIED)

    def holding(self, path: str) -> set:
        """Pids currently tracked as writing or reading `path`."""
        state = self._paths.get(path)
        return set(state.writers) | set(state.readers) if state else set()

    def paths_under(self, root: str) -> list[str]:
        """Paths below `root` with a tracked writer or reader."""
        prefix = root.rstrip(os.sep) + os.sep
        return [p for p in self._paths if p.startswith(prefix)]

    def writing(self, path: str) -> list[int]:
        """Pids currently tracked as writing `path`."""
        state = self._paths.get(path)
        return sorted(state.writers) if state else []

    def observe(self, ev: FsEvent, holders: list | None = None) -> list[dict]:
        out: list[dict] = []
        if ev.kind == ROOT_LOST:
            prefix = ev.path.rstrip(os.sep) + os.sep
            for path in [p for p in self._paths if p.startswith(prefix)]:
                self._end_all(path, ev, OUTCOME_DELETED, out)
            for path in [p for p in self._sizes if p.startswith(prefix)]:
                del self._sizes[path]
            return out
        if ev.kind == DELETED:
            self._end_all(ev.path, ev, OUTCOME_DELETED, out)
            self._sizes.pop(ev.path, None)
            return out
        if ev.kind == MOVED and ev.dest:
            self._sizes.pop(ev.path, None)
            state = self._paths.pop(ev.path, None)
            if state is not None:
                self._end_all(ev.dest, ev, OUTCOME_DELETED, out)   # replaced by the rename
                self._paths[ev.dest] = state
        if ev.kind == OVERFLOW:
            return out
        path = ev.target
        state = self._paths.get(path)
        if holders is not None:
            state = self._reconcile(path, state, holders, ev, out)
        elif ev.kind == CLOSED_WRITE and state is not None and len(state.writers) == 1:
            # Unattributed close with one known writer: it is the one that closed.
            (pid,) = state.writers
            self._end(path, state, pid, ev, "ok", out)
        if ev.size is not None:
            before = self._sizes.get(path)
            if before is not None and ev.size < before:
                if state is not None and len(state.writers) >= 2:
                    finding = self._finding(SIZE_FLUCTUATION, path, state, ev)
                    finding.update(size_before=before, size_after=ev.size)
                    out.append(finding)
                else:
                    self.counts["truncations"] += 1
            self._sizes[path] = ev.size
            self._sizes.move_to_end(path)
            if len(self._sizes) > self._max_paths:
                self._sizes.popitem(last=False)
        if state is not None and not state.writers and not state.readers:
            del self._paths[path]
        return out

    # ------------------------------------------------------------------ internals

    def _reconcile(self, path, state, holders, ev, out):
        writers_now: dict = {}
        for p in holders:
            if p.writing:
                writers_now.setdefault(p.pid, p)
        readers_now: dict = {}
        for p in holders:
            if not p.writing and p.pid not in writers_now:
                readers_now.setdefault(p.pid, p)
        if state is None:
            if not writers_now and not readers_now:
                return None
            state = self._new_state(path, ev, out)
        for pid in [pid for pid in state.writers if pid not in writers_now]:
            self._end(path, state, pid, ev, "ok", out)
        for pid in [pid for pid in state.readers if pid not in readers_now]:
            del state.readers[pid]
        joined = False
        for pid, proc in sorted(writers_now.items()):
            if pid in state.writers:
                continue
            opened = _Open(proc, next(self._seq), ev.mono, ev.wall, path)
            state.writers[pid] = opened
            out.append(self._write_event("start", opened))
            self.counts["starts"] += 1
            joined = joined or len(state.writers) >= 2
        if joined:
            out.append(self._finding(FS_COLLISION, path, state, ev))
        for pid, proc in sorted(readers_now.items()):
            if pid in state.readers:
                continue
            state.readers[pid] = proc
            if any(w != pid for w in state.writers):
                finding = self._finding(TORN_READ, path, state, ev)
                finding["reader"] = dict(proc.identity(), node=proc.node or self._node,
                                         mode=proc.mode)
                out.append(finding)
        return state

    def _new_state(self, path, ev, out) -> _PathState:
        if len(self._paths) >= self._max_paths:
            # Bounded memory: the least recently created path is given up, its writes lost.
            oldest = next(iter(self._paths))
            self._end_all(oldest, ev, OUTCOME_LOST, out)
            self._paths.pop(oldest, None)
        state = self._paths[path] = _PathState()
        return state

    def _end_all(self, path, ev, outcome, out) -> None:
        state = self._paths.get(path)
        if state is None:
            return
        for pid in list(state.writers):
            self._end(path, state, pid, ev, outcome, out)
        del self._paths[path]

    def _end(self, path, state, pid, ev, outcome, out) -> None:
        opened = state.writers.pop(pid)
        size = ev.size if ev.size is not None and ev.target == opened.path else None
        end = self._write_event("end", opened, ev.mono, ev.wall)
        end.update(start_wall=opened.start_wall, start_mono=opened.start_mono, bytes=size,
                   outcome=outcome)
        out.append(end)
        self.counts["ends"] += 1

    def _identity(self, proc) -> dict:
        ident = proc.identity()
        ident["node"] = proc.node or self._node
        return ident

    def _write_event(self, kind, opened: _Open, mono=None, wall=None) -> dict:
        event = {"v": SCHEMA_VERSION, "type": kind}
        event.update(self._identity(opened.proc))
        event.update(seq=opened.seq, path=opened.path, site=None, func=None,
                     wall=opened.start_wall if wall is None else wall,
                     mono=opened.start_mono if mono is None else mono, source=SOURCE_FS)
        return event

    def _finding(self, kind, path, state, ev) -> dict:
        self.counts[kind] += 1
        writers = []
        for opened in sorted(state.writers.values(), key=lambda o: (o.start_mono, o.seq)):
            w = self._identity(opened.proc)
            w.update(mode=opened.proc.mode, seq=opened.seq, start_mono=opened.start_mono,
                     start_wall=opened.start_wall)
            writers.append(w)
        jobs = sorted({w["job"] or "" for w in writers})
        return {"v": SCHEMA_VERSION, "type": kind, "source": SOURCE_FS, "node": self._node,
                "path": path, "wall": ev.wall, "mono": ev.mono,
                "job": jobs[0] if len(jobs) == 1 else ",".join(j or "?" for j in jobs),
                "writers": writers}


# inotify's IN_OPEN is queued before open(2) installs the fd: if a scan right after an
# "opened" event finds nobody new, look once more after this long.
OPEN_RETRY_DELAY = 0.005


def attribute(ev: FsEvent, tracker: WriteTracker, scanner,
              sleep: Callable[[float], None] = time.sleep) -> list[dict]:
    """The glue the agent runs per FsEvent: procscan when the tracker needs it, then track.

    scanner: a procscan.ProcScanner. For opens and closes a result cached from before the
    event is not reused; for writes the scanner's per-path rate limit applies. Runs on the
    caller's thread and may sleep OPEN_RETRY_DELAY once per open.
    """
    holders = None
    if tracker.needs_attribution(ev):
        exact = ev.kind in (OPENED, CLOSED_WRITE, CLOSED_NOWRITE)
        holders = scanner.holders_of(ev.target, changed_after=ev.mono if exact else None)
        if ev.kind == OPENED and {p.pid for p in holders} <= tracker.holding(ev.target):
            sleep(OPEN_RETRY_DELAY)
            holders = scanner.holders_of(ev.target, changed_after=float("inf"))
        # Size as of after the scan: a writer the scan no longer finds has finished, and its
        # end event carries this size (the event's own stat may predate its last writes).
        ev = replace(ev, size=_size(ev.target))
    return tracker.observe(ev, holders)


def rescan(root: str, tracker: WriteTracker, scanner, matches: Callable[[str], bool],
           clock: Callable[[], float] = time.monotonic,
           wall_clock: Callable[[], float] = time.time) -> list[dict]:
    """Re-attribute everything below `root` after events may have been lost (Watcher's
    on_rescan): one pass over the candidate processes' open files, then every path that is
    held open now or was tracked is reconciled, as if it had just been modified: writers the
    tracker missed start, writers whose close was lost end."""
    held = scanner.holders_under(root, matches)
    out: list[dict] = []
    for path in sorted(set(held) | set(tracker.paths_under(root))):
        ev = FsEvent(MODIFIED, path, _size(path), clock(), wall_clock())
        out.extend(tracker.observe(ev, held.get(path, [])))
    return out
