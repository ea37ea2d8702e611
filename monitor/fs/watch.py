"""Filesystem observation of checkpoint directories (watchdog).

Two layers here, as in watchdog itself (the third, turning events into writes, is
monitor.fs.tracker):

- FsEventHandler translates watchdog events into small immutable FsEvent values (no threads,
  no state beyond the patterns and the root list).
- Watcher owns the observers: inotify where it works, polling where asked or where inotify
  runs out of watches, per root. A maintenance thread re-arms roots that were deleted and
  recreated, performs fallbacks, reports inotify queue overflows (followed by a rescan) and,
  under polling, turns "size and mtime stable across two polls" into a synthetic
  closed_write (polling cannot see close(2)).
- monitor.fs.tracker.WriteTracker (pure) turns FsEvents plus procscan attributions into
  write intervals and findings.

Written against watchdog 7.1 (inotify reports FileOpenedEvent / FileClosedEvent /
FileClosedNoWriteEvent; a kernel IN_Q_OVERFLOW reaches InotifyFD.handle_event and then every
watch group's on_queue_overflow, which rebuilds recursive watches but tells no handler). Two
small subclasses hook those points; see _InotifyFD and _InotifyObserver.

inotify sees only changes made through this node's kernel: on NFS / Lustre / GPFS other nodes'
writes are invisible to it, so use mode="polling" there (see docs/fswatch.md).
"""
from __future__ import annotations

import errno
import fnmatch
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from watchdog.events import FileSystemEventHandler
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from monitor.fs.options import CHECKPOINT_PATTERNS as DEFAULT_PATTERNS
from monitor.fs.options import WATCH_MODES as MODES


# The inotify backend subclasses watchdog 7.x internals (pinned <8 in pyproject). On Linux a
# failed import is a broken install, not a platform limit: it is kept and reported loudly (an
# ERROR line when a Watcher starts, ckptwatch_fs_inotify_unavailable = 1), never swallowed, since
# polling every root instead costs CPU and misses short saves.
INOTIFY_IMPORT_ERROR: str | None = None
try:
    from watchdog.observers.inotify import InotifyEmitter, InotifyObserver
    from watchdog.observers.inotify_c import InotifyFD
except (ImportError, OSError) as _exc:
    InotifyEmitter = InotifyObserver = InotifyFD = None
    INOTIFY_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

log = logging.getLogger("ckptwatch.fswatch")

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
# The agent may not read it (no read permission and no CAP_DAC_READ_SEARCH): watchdog skips an
# inotify watch refused with EACCES without a word, which left such a root reported as
# watching while no event ever came. Tried again like a missing root.
UNREADABLE = "unreadable"


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
        """Reports each kernel queue overflow once (watchdog only tells the watch groups), and
        each watch refused for lack of room (ENOSPC: max_user_watches; EMFILE), which
        watchdog skips below the root with a log line at most, leaving that subtree unwatched.

        Only InotifyFD's own add_callback/handle_event are overridden, not the watch group's
        internals: watchdog 7.1.1 replaced the group's path tables (which 7.1.0's mirror wrote
        to) with a tree behind read-only properties, and a copied method then lost every
        watch below the root without an error (tests/unit/test_fswatch.py)."""

        def __init__(self, on_overflow: Callable[[], None],
                     on_limit: Callable[[bytes, OSError], None] | None = None):
            super().__init__()
            self._on_overflow = on_overflow
            self._on_limit = on_limit

        def handle_event(self, event) -> None:
            if event.is_queue_overflow:
                self._on_overflow()
            super().handle_event(event)

        def add_callback(self, path, mask, callback, id_):
            try:
                return super().add_callback(path, mask, callback, id_)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EMFILE) and self._on_limit is not None:
                    self._on_limit(path, exc)
                raise

    class _InotifyObserver(InotifyObserver):
        """InotifyObserver with our FD (its own inotify instance, as upstream). on_limit(path,
        exc) gets the path whose watch was refused (the Watcher finds its root: the emitter is
        not yet among the observer's emitters while schedule() sets up its watches)."""

        fd_class = _InotifyFD   # a seam for tests (a FD whose add_callback fails)

        def __init__(self, on_overflow, on_limit, timeout: float = 1.0):
            self._inotify_fd = self.fd_class(
                on_overflow, lambda path, exc: on_limit(os.fsdecode(path), exc))
            self._inotify_fd.start()
            BaseObserver.__init__(self, InotifyEmitter, timeout=timeout,
                                  inotify_fd=self._inotify_fd)


def inotify_available() -> bool:
    return InotifyFD is not None


def inotify_broken() -> bool:
    """On Linux, inotify could not be imported: a broken install to report, not a platform."""
    return sys.platform.startswith("linux") and not inotify_available()


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
            raise ValueError("mode 'inotify' needs Linux inotify"
                             + (f" (import failed: {INOTIFY_IMPORT_ERROR})"
                                if INOTIFY_IMPORT_ERROR else ""))
        if mode == "auto" and inotify_broken():
            log.error("inotify is unavailable on Linux (%s): every root is polled instead; "
                      "reinstall watchdog>=7.1,<8", INOTIFY_IMPORT_ERROR)
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
            out["inotify_unavailable"] = int(inotify_broken())
            out["unsettled"] = len(self._unsettled)
        out["mode"] = self.mode
        out["roots"] = {r.path: {"mode": r.mode, "state": r.state, "fallback": r.fallback,
                                 "rearms": r.rearms, "losses": r.losses}
                        for r in list(self._roots.values())}
        return out

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
        try:
            os.close(os.open(root.path, os.O_RDONLY | os.O_DIRECTORY))
        except OSError as exc:
            if root.state != UNREADABLE:
                log.warning("cannot read a watched root (it needs read permission for the "
                            "agent's user, or CAP_DAC_READ_SEARCH): not watching it",
                            extra={"fields": {"path": root.path, "error": exc}})
                self._count("errors")
            self._set_root(root, state=UNREADABLE)
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
                log.warning("inotify cannot watch a root; polling it instead", extra={"fields": {
                    "path": root.path, "error": exc, "poll_interval": self.poll_interval}})
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
                log.warning("cannot watch a root", extra={"fields": {"path": root.path,
                                                                     "error": exc}})
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

    def _note_limit(self, path: str, exc: OSError) -> None:
        """A watch on `path` was refused for lack of room: its root moves to polling."""
        owners = [r for r in list(self._roots)
                  if path == r or path.startswith(r.rstrip(os.sep) + os.sep)]
        if not owners:
            return
        with self._lock:
            self._pending_fallbacks[max(owners, key=len)] = _fallback_reason(exc)
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
                log.warning("inotify watch limit reached; polling the root instead",
                            extra={"fields": {"path": path,
                                              "poll_interval": self.poll_interval}})
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
            log.warning("watched root is gone; watching it again when it returns",
                        extra={"fields": {"path": root.path}})
            self._disarm(root)
            self._set_root(root, state=LOST, losses=root.losses + 1)
            self._count("root_losses")
            self._emit(FsEvent(ROOT_LOST, root.path, None, self._clock(), self._wall_clock()))
        if root.state in (LOST, MISSING, UNREADABLE) and os.path.isdir(root.path):
            again = root.was_watched
            if self._arm(root):
                if again:
                    self._set_root(root, rearms=root.rearms + 1)
                    self._count("rearms")
                    log.info("watching a root again", extra={"fields": {"path": root.path}})
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
