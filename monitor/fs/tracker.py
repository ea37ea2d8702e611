"""From filesystem events to writes: which process wrote which checkpoint, when.

WriteTracker (pure, no threads) turns monitor.fs.watch FsEvents plus procscan attributions (who
holds the file open right after the event) into write intervals per (path, pid), emitted as
hook-shaped "start"/"end" event dicts with "source": "fs", and into Findings: size_fluctuation
(a file shrinking under two writers), torn_read (a reader while another process writes). Two
processes writing one path at once is not a finding here: the detector builds that collision
from the start/end intervals, whichever source saw them. attribute() and rescan() are the glue
the agent's attribution thread runs per event and after lost events.
"""
from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from ckptwatch.events import SCHEMA_VERSION
from monitor.detect.model import (FINDING_SIZE_FLUCTUATION, FINDING_TORN_READ, OUTCOME_LOST,
                                  Finding)
from monitor.fs.fanotify import FAN_CLOSE_NOWRITE, FAN_CLOSE_WRITE, FAN_MODIFY, FAN_OPEN
from monitor.fs.watch import (CLOSED_NOWRITE, CLOSED_WRITE, CREATED, DELETED, MODIFIED, MOVED,
                             OPENED, OVERFLOW, ROOT_LOST, SOURCE_FS, FsEvent, _size)


# fs writes get seq numbers far above any hook's per-process counter, so the detector's
# (node, pid, seq) pairing never mixes an fs interval with a hook interval of the same pid.
FS_SEQ_BASE = 1 << 48
OUTCOME_DELETED = "deleted"


@dataclass
class _Open:
    proc: object           # procscan.Holder
    seq: int
    start_mono: float
    start_wall: float
    path: str


@dataclass
class _PathState:
    writers: dict = field(default_factory=dict)    # pid -> _Open
    readers: dict = field(default_factory=dict)    # pid -> procscan.Holder


class WriteTracker:
    """Pure: FsEvents + attributions -> write intervals and fs findings (see module doc).

    observe(ev, holders) takes the event and, when the caller attributed it, `holders`: every
    process holding ev's path open right after the event (procscan.ProcScanner.holders_of),
    or None when not attributed. It returns a list of:

    - "start" / "end" events in the shape of ckptwatch/events.py (validate() accepts them), one
      interval per (path, pid) from the first attribution that shows the pid holding the path
      for writing to the first one that does not (or the file's deletion), plus
      "source": "fs". Times are those of the FsEvents, i.e. of the agent seeing them.
    - Finding size_fluctuation: the file shrank while two or more pids held it open for writing. A
      shrink with at most one writer (a save truncating its own file as it starts) is
      normal: it is only counted, in counts["truncations"]. The last size of every path
      seen is kept (bounded by max_paths) so the first open of a new save compares
      against the previous file.
    - Finding torn_read: a pid opened the path read-only while another pid was writing it.

    Findings carry source "fs", node, path, wall, job (the metric label), writers (identity
    dicts with mode, seq and start times) and details "v", "mono" (+ size_before/size_after,
    or reader).
    """

    def __init__(self, node: str = "", max_paths: int = 10000, exact_writers: bool = False):
        self._node = node
        self._max_paths = max_paths
        # exact_writers: writers are told by the kernel (fanotify, via write_started /
        # write_ended); /proc scans then only track readers, except in a rescan.
        self.exact_writers = exact_writers
        self._paths: dict[str, _PathState] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()
        # path -> (writer, end mono) of its last finished write: who wrote a file that is
        # then renamed into place (an atomic save) is who wrote the destination.
        self._last_writes: OrderedDict[str, tuple] = OrderedDict()
        self._pending_renames: OrderedDict[str, FsEvent] = OrderedDict()   # src -> MOVED
        self._seq = itertools.count(FS_SEQ_BASE)
        self.counts = {FINDING_SIZE_FLUCTUATION: 0, FINDING_TORN_READ: 0, "starts": 0,
                       "ends": 0, "truncations": 0, "renames": 0}

    def needs_attribution(self, ev: FsEvent) -> bool:
        """Whether the caller should attribute `ev` (a procscan) before observe()."""
        if self.exact_writers:
            # The kernel names writers and readers alike (ExactAttribution): a scan would
            # only repeat it, at a few ms of /proc reads per open (issue 22).
            return False
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

    def open_writes(self, path: str) -> dict:
        """pid -> the write in flight on `path` (a copy): what a reader opening it now reads
        under."""
        state = self._paths.get(path)
        return dict(state.writers) if state else {}

    def torn_read(self, path: str, reader, writes, mono: float, wall: float) -> Finding:
        """Finding torn_read: `reader` (a procscan.Holder) read `path` while `writes` (the
        in-flight writes open_writes() gave, of other pids) were writing it."""
        return self._finding(FINDING_TORN_READ, path, writes, FsEvent(CLOSED_NOWRITE, path,
                                                                      None, mono, wall),
                             reader=dict(self._identity(reader), mode=reader.mode))

    def write_started(self, path: str, proc, mono: float, wall: float) -> list:
        """`proc` (a procscan.Holder) began writing `path` at mono/wall: known exactly
        (fanotify), not inferred from a scan. A start event."""
        out: list = []
        state = self._paths.get(path)
        if state is not None and proc.pid in state.writers:
            return out
        ev = FsEvent(OPENED, path, None, mono, wall)
        if state is None:
            state = self._new_state(path, ev, out)
        opened = _Open(proc, next(self._seq), mono, wall, path)
        state.writers[proc.pid] = opened
        out.append(self._write_event("start", opened))
        self.counts["starts"] += 1
        return out

    def write_ended(self, path: str, pid: int, mono: float, wall: float,
                    size: int | None) -> list:
        """`pid` closed `path` after writing it (fanotify's CLOSE_WRITE)."""
        out: list = []
        state = self._paths.get(path)
        if state is None or pid not in state.writers:
            return out
        self._end(path, state, pid, FsEvent(CLOSED_WRITE, path, size, mono, wall), "ok", out)
        if not state.writers and not state.readers:
            del self._paths[path]
        return out

    def note_write(self, path: str, proc, end_mono: float) -> list:
        """A finished write of a file that is not tracked as a checkpoint (a temporary file
        of an atomic save): remembered only so its rename into place can be attributed.
        Returns that attribution when the rename was seen first (fanotify and inotify are
        two queues: the rename can overtake the close that precedes it)."""
        self._last_writes[path] = (proc, end_mono)
        self._last_writes.move_to_end(path)
        if len(self._last_writes) > self._max_paths:
            self._last_writes.popitem(last=False)
        out: list = []
        moved = self._pending_renames.pop(path, None)
        if moved is not None:
            self._renamed_into_place(moved, out)
        return out

    def observe(self, ev: FsEvent, holders: list | None = None,
                reconcile_writers: bool | None = None) -> list:
        """reconcile_writers: whether `holders` also decide who writes (default: unless
        writers are exact; a rescan after lost events passes True)."""
        if reconcile_writers is None:
            reconcile_writers = not self.exact_writers
        out: list = []
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
            else:
                self._renamed_into_place(ev, out)
        if ev.kind == OVERFLOW:
            return out
        path = ev.target
        state = self._paths.get(path)
        if holders is not None:
            state = self._reconcile(path, state, holders, ev, out, reconcile_writers)
        elif ev.kind == CLOSED_WRITE and state is not None and len(state.writers) == 1 and \
                not self.exact_writers:
            # Unattributed close with one known writer: it is the one that closed.
            (pid,) = state.writers
            self._end(path, state, pid, ev, "ok", out)
        if ev.size is not None:
            before = self._sizes.get(path)
            if before is not None and ev.size < before:
                if state is not None and len(state.writers) >= 2:
                    out.append(self._finding(FINDING_SIZE_FLUCTUATION, path,
                                             state.writers.values(), ev,
                                             size_before=before, size_after=ev.size))
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

    def _reconcile(self, path, state, holders, ev, out, reconcile_writers=True):
        writers_now: dict = {}
        if reconcile_writers:
            for p in holders:
                if p.writing:
                    writers_now.setdefault(p.pid, p)
        elif state is not None:
            writers_now = {pid: o.proc for pid, o in state.writers.items()}
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
        for pid, proc in sorted(writers_now.items()):
            if pid in state.writers:
                continue
            opened = _Open(proc, next(self._seq), ev.mono, ev.wall, path)
            state.writers[pid] = opened
            out.append(self._write_event("start", opened))
            self.counts["starts"] += 1
        for pid, proc in sorted(readers_now.items()):
            if pid in state.readers:
                continue
            state.readers[pid] = proc
            if any(w != pid for w in state.writers):
                out.append(self._finding(FINDING_TORN_READ, path, state.writers.values(), ev,
                                         reader=dict(self._identity(proc), mode=proc.mode)))
        return state

    def _renamed_into_place(self, ev: FsEvent, out: list) -> None:
        """A finished file renamed onto ev.dest: an atomic save by its last writer. It is
        reported as that writer's write of the destination, taking no time at the rename:
        two atomic saves can never overlap (so never a concurrent collision, the file is
        whole), but saves of one path by several processes of a job still chain into a
        redundant-write collision, as they should: the last rename silently wins."""
        last = self._last_writes.pop(ev.path, None)
        if last is None:
            # Its writer's close may still be on the way: wait for it, briefly.
            while self._pending_renames and \
                    next(iter(self._pending_renames.values())).mono < ev.mono - RENAME_WAIT:
                self._pending_renames.popitem(last=False)
            if len(self._pending_renames) < self._max_paths:
                self._pending_renames[ev.path] = ev
            return
        proc, _ = last
        opened = _Open(proc, next(self._seq), ev.mono, ev.wall, ev.dest)
        out.append(self._write_event("start", opened))
        end = self._write_event("end", opened, ev.mono, ev.wall)
        end.update(start_wall=ev.wall, start_mono=ev.mono, bytes=ev.size, outcome="ok",
                   renamed_from=ev.path)
        out.append(end)
        self.counts["starts"] += 1
        self.counts["ends"] += 1
        self.counts["renames"] += 1
        self._last_writes[ev.dest] = (proc, ev.mono)   # a later rename of it: same writer

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
        if outcome == "ok":
            out += self.note_write(path, opened.proc, ev.mono)
        size = ev.size if ev.size is not None and ev.target == opened.path else None
        end = self._write_event("end", opened, ev.mono, ev.wall)
        end.update(start_wall=opened.start_wall, start_mono=opened.start_mono, bytes=size,
                   outcome=outcome)
        out.append(end)
        self.counts["ends"] += 1

    def _identity(self, proc) -> dict:
        ident = proc.writer.to_record()
        ident["node"] = ident["node"] or self._node
        return ident

    def _write_event(self, kind, opened: _Open, mono=None, wall=None) -> dict:
        event = {"v": SCHEMA_VERSION, "type": kind}
        event.update(self._identity(opened.proc))
        event.update(seq=opened.seq, path=opened.path, site=None, func=None,
                     wall=opened.start_wall if wall is None else wall,
                     mono=opened.start_mono if mono is None else mono, source=SOURCE_FS)
        return event

    def _finding(self, kind, path, writes, ev, **details) -> Finding:
        self.counts[kind] += 1
        writers = []
        for opened in sorted(writes, key=lambda o: (o.start_mono, o.seq)):
            w = self._identity(opened.proc)
            w.update(mode=opened.proc.mode, seq=opened.seq, start_mono=opened.start_mono,
                     start_wall=opened.start_wall)
            writers.append(w)
        jobs = sorted({w["job"] or "" for w in writers})
        job = jobs[0] if len(jobs) == 1 else ",".join(j or "?" for j in jobs)
        return Finding(kind, path, job, ev.wall, self._node, SOURCE_FS, tuple(writers),
                       {"v": SCHEMA_VERSION, "mono": ev.mono, **details})


# How long a rename whose source's writer is not known yet waits for that writer's close.
RENAME_WAIT = 2.0


# inotify's IN_OPEN is queued before open(2) installs the fd: if a scan right after an
# "opened" event finds nobody new, look once more after this long.
OPEN_RETRY_DELAY = 0.005


def attribute(ev: FsEvent, tracker: WriteTracker, scanner,
              sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> list:
    """The glue the agent runs per FsEvent: procscan when the tracker needs it, then track.

    scanner: a procscan.ProcScanner. For opens and closes a result from a scan begun before
    the event is not reused (one begun after it is: it saw what the event left); for writes
    the scanner's per-path rate limit applies, or a scan begun after the write. Runs on the
    caller's thread and may sleep OPEN_RETRY_DELAY once per open: only when the open is
    younger than that, since the fd of an open older than that is surely in /proc.
    """
    holders = None
    if tracker.needs_attribution(ev):
        if ev.kind == OPENED:
            settled = ev.mono + OPEN_RETRY_DELAY
            late = clock() >= settled
            holders = scanner.holders_of(ev.target, changed_after=settled if late else ev.mono)
            if not late and {p.pid for p in holders} <= tracker.holding(ev.target):
                sleep(OPEN_RETRY_DELAY)
                holders = scanner.holders_of(ev.target, changed_after=float("inf"))
        elif ev.kind in (CLOSED_WRITE, CLOSED_NOWRITE):
            holders = scanner.holders_of(ev.target, changed_after=ev.mono)
        else:
            holders = scanner.holders_of(ev.target, since=ev.mono)
        # Size as of after the scan: a writer the scan no longer finds has finished, and its
        # end event carries this size (the event's own stat may predate its last writes).
        ev = replace(ev, size=_size(ev.target))
    return tracker.observe(ev, holders)


class ExactAttribution:
    """fanotify events (monitor.fs.fanotify.FanEvent: the pid is in the event) -> the
    tracker's write intervals, with no /proc scan and no race against short writes.

    A write starts at the pid's open of the path as the kernel reported it, else at its
    first modification; it ends at its CLOSE_WRITE. When the kernel merged the open with the
    writes (the agent read the queue after the save had begun writing), all we know is that
    the open came after the previous read: the start is taken as that time (ev.since). Two
    such writes of one path by different processes in one read therefore overlap: reported
    as concurrent even when they might have followed each other by microseconds (either way
    two processes wrote one path, unguarded). An open followed by CLOSE_NOWRITE was a read
    and is forgotten. Files that `matches` rejects (temporary files) only have their last
    writer noted, so a rename into place is attributed (WriteTracker.note_write).
    `describe(pid, mode)` gives the writer's identity (procscan.ProcScanner.describe).

    Readers are the kernel's too: an open that ends in CLOSE_NOWRITE was a read, and if
    another process was writing the file at its open or began to before its close, it is a
    torn read, reported at that close (only then is it known that the opener never wrote).
    So with fanotify no event of a watched file needs a /proc scan (WriteTracker
    .needs_attribution); only a rescan after lost events reads /proc.
    """

    def __init__(self, tracker: WriteTracker, describe: Callable,
                 matches: Callable[[str], bool] = lambda path: True,
                 max_pending: int = 10000):
        self.tracker = tracker
        self._describe = describe
        self._matches = matches
        self._max_pending = max_pending
        self._pending: OrderedDict = OrderedDict()      # (pid, path) -> (mono, wall) of open
        # path -> {reader pid -> {writer pid -> _Open}}: opens not (yet) known to write, and
        # the other processes' writes in flight during them; at most max_pending opens.
        self._reads: OrderedDict = OrderedDict()
        self._n_reads = 0

    def observe(self, ev) -> list:
        out: list = []
        if not self._matches(ev.path):
            # Not a checkpoint name (a temporary file of an atomic save): only who finished
            # writing it matters, for when it is renamed into place.
            if ev.mask & FAN_CLOSE_WRITE:
                out += self.tracker.note_write(ev.path, self._describe(ev.pid, "w"), ev.mono)
            return out
        key = (ev.pid, ev.path)
        if ev.mask & FAN_OPEN:
            self._pending[key] = (ev.mono, ev.wall)
            self._pending.move_to_end(key)
            if len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
            self._read_opened(ev.pid, ev.path)
        if ev.mask & (FAN_MODIFY | FAN_CLOSE_WRITE):
            self._read_forget(ev.pid, ev.path)          # it writes: not a reader
            if ev.pid not in self.tracker.writing(ev.path):
                if ev.mask & FAN_OPEN:                      # merged: opened after ev.since
                    self._pending.pop(key, None)
                    mono, wall = ev.since, ev.since_wall
                else:
                    mono, wall = self._pending.pop(key, (ev.mono, ev.wall))
                started = self.tracker.write_started(ev.path, self._describe(ev.pid, "w"),
                                                     mono, wall)
                if started:
                    self._reads_see_writer(ev.pid, ev.path)
                out += started
        if ev.mask & FAN_CLOSE_WRITE:
            self._pending.pop(key, None)
            out += self.tracker.write_ended(ev.path, ev.pid, ev.mono, ev.wall, _size(ev.path))
        elif ev.mask & FAN_CLOSE_NOWRITE:
            self._pending.pop(key, None)
            out += self._read_closed(ev)
        return out

    # ------------------------------------------------------------------ readers

    def _read_opened(self, pid: int, path: str) -> None:
        readers = self._reads.get(path)
        if readers is None:
            readers = self._reads[path] = {}
        elif pid in readers:
            return
        readers[pid] = {w: o for w, o in self.tracker.open_writes(path).items() if w != pid}
        self._n_reads += 1
        while self._n_reads > self._max_pending:     # forget the oldest path's opens
            _, dropped = self._reads.popitem(last=False)
            self._n_reads -= len(dropped)

    def _read_forget(self, pid: int, path: str) -> dict | None:
        readers = self._reads.get(path)
        if readers is None or pid not in readers:
            return None
        writes = readers.pop(pid)
        self._n_reads -= 1
        if not readers:
            del self._reads[path]
        return writes

    def _reads_see_writer(self, pid: int, path: str) -> None:
        """`pid` began writing `path`: every other open of it in progress reads under it."""
        opened = self.tracker.open_writes(path).get(pid)
        for reader, writes in self._reads.get(path, {}).items():
            if reader != pid and opened is not None:
                writes[pid] = opened

    def _read_closed(self, ev) -> list:
        """A read of ev.path by ev.pid ended: a torn read if another process wrote the file
        meanwhile (an open merged into this event: whoever writes it now)."""
        writes = self._read_forget(ev.pid, ev.path) or {}
        for pid, opened in self.tracker.open_writes(ev.path).items():
            if pid != ev.pid:
                writes.setdefault(pid, opened)
        if not writes:
            return []
        return [self.tracker.torn_read(ev.path, self._describe(ev.pid, "r"),
                                       list(writes.values()), ev.mono, ev.wall)]


def rescan(root: str, tracker: WriteTracker, scanner, matches: Callable[[str], bool],
           clock: Callable[[], float] = time.monotonic,
           wall_clock: Callable[[], float] = time.time) -> list:
    """Re-attribute everything below `root` after events may have been lost (Watcher's
    on_rescan): one pass over the candidate processes' open files, then every path that is
    held open now or was tracked is reconciled, as if it had just been modified: writers the
    tracker missed start, writers whose close was lost end."""
    held = scanner.holders_under(root, matches)
    out: list = []
    for path in sorted(set(held) | set(tracker.paths_under(root))):
        ev = FsEvent(MODIFIED, path, _size(path), clock(), wall_clock())
        # Lost events may include a writer's close even when writers are exact: here the
        # scan decides who writes.
        out.extend(tracker.observe(ev, held.get(path, []), reconcile_writers=True))
    return out
