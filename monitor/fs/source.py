"""The agent's filesystem source: watcher -> attribution thread -> the core loop.

The watcher's callbacks run on watchdog's threads and must be quick, and attribution (which
process has the file open, read from /proc) costs milliseconds and may wait a moment for a
fresh fd to appear. So: the watcher only queues FsEvents; one attribution thread turns them
into start/end events, Findings (monitor.fs.tracker.attribute) and FileNotices, and hands them
to the core loop as batches through `deliver`. The core loop owns the detector; nothing here
touches it.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

from monitor.fs import fanotify
from monitor.fs import tracker as fstracker
from monitor.fs import watch as fswatch
from monitor.fs import procscan
from monitor.fs.options import ATTRIBUTIONS

log = logging.getLogger("ckptwatch.fs")

# With /proc attribution, the attribution thread re-classifies the node's processes when it
# has had nothing to do for this long and the scanner's refresh is due (ProcScanner.refresh).
IDLE_REFRESH = 1.0
MAX_QUEUED = 100_000        # FsEvents waiting for attribution; beyond: dropped and counted
MAX_KNOWN = 10_000          # paths whose version last due for verification is remembered
FILE_CLOSED = "file_closed" # delivered for every finished write: verify the file
FILE_CHANGED = "file_changed"  # delivered once per write in progress: not yet


@dataclass(frozen=True)
class FileNotice:
    """A checkpoint file finished changing (FILE_CLOSED) or began to (FILE_CHANGED), whoever
    wrote it: what the verification schedule needs, attributed or not."""

    kind: str
    path: str




class FsSource:
    """attribution: how writers are named. "fanotify": the kernel names the pid of every
    open, write and close (monitor.fs.fanotify; needs CAP_SYS_ADMIN); "proc": a /proc scan
    right after each inotify event (misses writes shorter than the scan); "auto": fanotify
    where it works, else proc (logged). Readers (torn reads) always come from /proc."""

    def __init__(self, roots, patterns, mode: str, poll_interval: float, node: str,
                 deliver, attribution: str = "auto"):
        if attribution not in ATTRIBUTIONS:
            raise ValueError(f"attribution must be one of {', '.join(ATTRIBUTIONS)}")
        self._deliver = deliver
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        self._roots = list(roots)
        self._asked = attribution
        self._described: OrderedDict = OrderedDict()     # pids whose identity was read
        self.scanner = procscan.ProcScanner(node=node)
        self.watcher = fswatch.Watcher(roots, patterns, mode, poll_interval,
                                       on_event=self._enqueue,
                                       on_rescan=lambda root: self._enqueue(("rescan", root)))
        self.fan: fanotify.FanotifyWatcher | None = None
        self.attribution = "proc"
        if attribution != "proc":
            # Decided in start(): fanotify unless the kernel or our privileges refuse it.
            self.fan = fanotify.FanotifyWatcher(roots, on_event=self._fan_event,
                                                on_overflow=self._rescan_all)
            self.attribution = "fanotify"
        self.tracker = fstracker.WriteTracker(node=node,
                                              exact_writers=self.fan is not None)
        self.exact = fstracker.ExactAttribution(self.tracker, self.scanner.describe,
                                                self.watcher.matches)
        self._thread: threading.Thread | None = None
        self.dropped_total = 0
        self.errors_total = 0
        self._changing: set = set()   # paths modified since their last close (thread-local use)
        # path -> the version (device, inode, size, mtime) last made due for verification
        # (thread-local use, bounded): a read of a version nobody here wrote is verified once.
        self._known: OrderedDict = OrderedDict()

    def start(self) -> None:
        if self.fan is not None:
            try:
                self.fan.start()
            except OSError as exc:
                if self._asked == "fanotify":
                    raise OSError(exc.errno, f"--watch.attribution fanotify: "
                                             f"{fanotify.why(exc)}") from None
                log.info("writers are attributed from /proc (fanotify: %s); writes shorter "
                         "than a scan stay anonymous", fanotify.why(exc))
                self.fan, self.attribution = None, "proc"
                self.tracker.exact_writers = False
        self.watcher.start()
        self._thread = threading.Thread(target=self._run, name="ckptwatch-fs-attribution",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.watcher.stop()
        if self.fan is not None:
            self.fan.stop()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def add_path(self, path: str) -> None:
        """A hook event named this path: watch it whatever its name."""
        self.watcher.add_path(path)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        watched = self.watcher.stats()
        scans = self.scanner.stats()
        return {"events_lost": watched["events_lost"], "fallbacks": watched["fallbacks"],
                "inotify_unavailable": watched["inotify_unavailable"],
                "roots": watched["roots"], "attributions": scans["scans"],
                "attribution_seconds": scans["total_seconds"],
                "attribution_errors": scans["errors"],
                "attribution_denied": scans["denied"], "dropped": self.dropped_total,
                "errors": self.errors_total, "attribution_method": self.attribution,
                "fanotify": self.fan.stats() if self.fan is not None else {}}

    def _finished(self, path: str) -> FileNotice:
        """A write of `path` finished here: due for verification, this version known."""
        self._unknown(path)
        return FileNotice(FILE_CLOSED, path)

    def _unknown(self, path: str) -> bool:
        """Is the file at `path` a version not made due for verification before? (Then it is
        remembered as made due.) False when it cannot be looked at."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if self._known.get(path) == version:
            return False
        self._known[path] = version
        self._known.move_to_end(path)
        if len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)
        return True

    def _fan_event(self, ev) -> None:
        # On the fanotify reader's thread, as soon as the event is read: a writer's identity
        # comes from its environment in /proc, so read it now, before a short-lived process
        # can exit while the event waits in the queue (cached per process by the scanner).
        if ev.pid not in self._described:
            self.scanner.describe(ev.pid, "w")
            self._described[ev.pid] = True
            if len(self._described) > 4096:
                self._described.popitem(last=False)
        self._enqueue(ev)

    def _rescan_all(self) -> None:
        for root in self._roots:
            self._enqueue(("rescan", root))

    def _enqueue(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped_total += 1

    def _run(self) -> None:
        proc = self.fan is None
        if proc:
            # Classify the node's processes before the first event, not during its scan.
            self.scanner.refresh(force=True)
        while True:
            try:
                item = self._queue.get(timeout=IDLE_REFRESH if proc else None)
            except queue.Empty:
                try:
                    self.scanner.refresh()     # when due, while nothing waits
                except Exception:
                    self.errors_total += 1
                    log.exception("process list refresh failed")
                continue
            if item is None:
                return
            try:
                if isinstance(item, fanotify.FanEvent):
                    out = self.exact.observe(item)
                elif isinstance(item, tuple) and item[0] == "rescan":
                    out = fstracker.rescan(item[1], self.tracker, self.scanner,
                                         self.watcher.matches)
                else:
                    out = fstracker.attribute(item, self.tracker, self.scanner)
                    if item.kind == fswatch.CLOSED_WRITE:
                        # Whoever wrote it (attributed or not: under polling a short write
                        # is over before any scan), a finished file is due for verification.
                        self._changing.discard(item.path)
                        out = out + [self._finished(item.path)]
                    elif item.kind == fswatch.MOVED and item.dest:
                        # An atomic save (write elsewhere, rename into place) finishes with
                        # the rename.
                        out = out + [self._finished(item.dest)]
                    elif item.kind == fswatch.CREATED and item.size:
                        # Created with content at once: renamed in from outside the watched
                        # tree (Lightning/fsspec move a temp file in; inotify reports that as
                        # a create). A fresh open(O_CREAT) is 0 bytes and waits for its close.
                        out = out + [self._finished(item.path)]
                    elif (item.kind == fswatch.CLOSED_NOWRITE
                          and item.path not in self._changing and self._unknown(item.path)):
                        # Read here, written where no watcher of ours saw it: on a network
                        # file system, by another node (inotify sees only this node's
                        # writes). Verified once per version, when a process here reads it
                        # (the verifier's own read is of the version it made due).
                        out = out + [FileNotice(FILE_CLOSED, item.path)]
                    elif item.kind == fswatch.MODIFIED and item.path not in self._changing:
                        # Being written again: no verification until the next close (once
                        # per write, not per write(2)).
                        if len(self._changing) < MAX_QUEUED:
                            self._changing.add(item.path)
                        out = out + [FileNotice(FILE_CHANGED, item.path)]
                if out:
                    self._deliver(out)
            except Exception:       # one odd file must not end filesystem observation
                self.errors_total += 1
                log.exception("filesystem event handling failed for %r", item)
