"""What the detector holds per write and per path, shared by pairing, grouping and remote
anchoring. Mutable bookkeeping (an Entry becomes a Write, monitor.detect.model, when asked).
"""
from __future__ import annotations

from bisect import insort

from monitor.detect.model import SOURCE_FS, SOURCE_HOOK, SOURCE_JOB, Write, Writer

INF = float("inf")
# Every source that saw a write, as the frozenset all entries of one source share (see
# Entry.seen_by).
SEEN_BY = {source: frozenset((source,)) for source in (SOURCE_HOOK, SOURCE_FS, SOURCE_JOB)}


class Entry:
    """One write being tracked (mutable until it ends; as_write() is its value)."""

    __slots__ = ("writer", "path", "seq", "start_wall", "start_mono", "end_wall", "end_mono",
                 "bytes", "outcome", "site", "func", "order", "seen_at", "done_at",
                 "dropped", "source", "seen_by", "reported", "reporter", "stop", "proc",
                 "writer_kind")

    def __init__(self, writer: Writer, path: str, seq: int, start_wall: float,
                 start_mono: float, site, func, order: int, seen_at: float,
                 source: str = SOURCE_HOOK):
        self.source = source            # who reported this write: "hook", "fs" or "job"
        self.reporter = None            # source "job": the local pid that reported it
        self.writer_kind = None         # the event's `writer`, bounded (model.writer_kind_of)
        # Every source that saw it (see Detector.mark_source): a frozenset shared by all the
        # entries of one source until another source sees one (a set per write cost 216
        # bytes each, and the collector's time).
        self.seen_by = SEEN_BY.get(source) or frozenset((source,))
        self.writer = writer
        self.proc = writer.key          # (node, pid), asked for each time the path is grouped
        self.path = path
        self.seq = seq
        self.start_wall = start_wall
        self.start_mono = start_mono
        self.end_wall = None
        self.end_mono = None
        # End of the interval for overlap purposes (+inf while in flight): an attribute, not
        # a property, because grouping reads it several times per write.
        self.stop = INF
        self.bytes = None
        self.outcome = None
        self.site = site
        self.func = func
        self.order = order
        self.seen_at = seen_at
        self.done_at = None
        self.dropped = False
        self.reported = False           # named in a collision already (while in flight)

    @property
    def key(self) -> tuple:
        return (self.writer.node, self.writer.pid, self.seq)

    def finish(self, end_wall: float, end_mono: float, nbytes, outcome: str, now: float) -> Write:
        self.end_wall, self.end_mono = end_wall, end_mono
        self.stop = max(end_mono, self.start_mono)
        self.bytes, self.outcome = nbytes, outcome
        self.done_at = max(end_mono, now)
        return self.as_write()

    def as_write(self) -> Write:
        """The write as known now: once ended, its final value (nothing it names changes
        after finish(), so every call gives an equal Write); in flight, with end, bytes and
        outcome None, for an early report. Built when asked, not kept: the exporters are
        done with a finished write at once, and one held per tracked write was most of what
        a write held cost in memory."""
        if self.end_mono is None:
            return Write.of(self.writer, self.path, self.seq, self.start_wall,
                            self.start_mono, None, None, None, None, self.site, self.func,
                            self.source, None, self.writer_kind)
        return Write.of(self.writer, self.path, self.seq, self.start_wall, self.start_mono,
                        self.end_wall, self.end_mono, self.bytes, self.outcome, self.site,
                        self.func, self.source, self.reporter, self.writer_kind)


def sort_key(entry: Entry) -> tuple:
    """The order of a path's entries: start time, then arrival."""
    return (entry.start_mono, entry.order)


class PathState:
    """One path's writes (finished and in flight) and the marks of its reported collisions."""

    __slots__ = ("path", "entries", "barriers", "due", "open", "nan_start")

    def __init__(self, path: str):
        self.path = path
        self.entries: list[Entry] = []      # sorted by (start_mono, order)
        self.barriers: list = []            # grouping.Barrier: reported collisions
        self.due = None                     # the earliest due time pushed on the heap
        self.open = 0                       # entries still in flight
        self.nan_start = False              # an entry with a NaN start was ever added (insert)

    def insert(self, entry: Entry) -> None:
        """Add an entry in (start_mono, order) order, as insort does. A new entry has the
        highest order and, events arriving about in time order, usually the latest start: it
        then goes last without a search. A NaN start (a hook may send one) compares false
        with everything and leaves the list in insort's own order, not a sorted one, so once
        one was added the path always takes insort's way."""
        entries = self.entries
        start = entry.start_mono
        if start != start:
            self.nan_start = True
        elif not entries or (entries[-1].start_mono <= start and not self.nan_start):
            entries.append(entry)
            return
        insort(entries, entry, key=sort_key)
