"""The journal as the report commands see it: the records of one or several agents' journals
(exporters/journal.py) read back into collisions, writes, hazards, findings and bad verdicts,
deduplicated across journals and bounded whatever the journal holds. Both views read it:
`ckptwatch report` (monitor/cli/report.py: table and JSON) and its HTML timeline
(monitor/cli/timeline.py).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from exporters.journal import ReadStats, read_records
from monitor.detect.model import FINDING_HAZARD, Collision, Write


# What `summarize` keeps of a journal for the timeline, newest kept when there is more: the
# journal is input from every user on the node (up to 6 x 64 MiB), and `report` must not take
# memory in proportion to it. What is dropped is counted and the page says so.
MAX_WRITES_KEPT = 100_000
MAX_RECORDS_KEPT = 10_000          # per list: findings, verdicts, other records
MAX_JOBS_KEPT = 1_000
# Wall times outside this range are not from a real clock (0, negative, NaN, year 5138...).
MIN_WALL, MAX_WALL = 1.0, 1e11
MAX_DURATION = 1e7                  # seconds (four months): longer is not a save

FINDING_TYPES = ("size_fluctuation", "torn_read")
BAD_VERDICTS = ("corrupt", "unverifiable")


@dataclass
class JournalSummary:
    """What a journal holds: its collisions (oldest first), how many writes it recorded and,
    for the timeline, the writes themselves, findings, bad verdicts and records of types this
    version does not know (each list bounded, newest kept; `dropped` counts the rest)."""

    collisions: list = field(default_factory=list)
    hazards: list = field(default_factory=list)      # hazard records, deduplicated
    writes: int = 0
    malformed: int = 0          # lines or records that could not be read
    files: int = 0
    journals: list = field(default_factory=list)
    kept_writes: dict = field(default_factory=dict)     # identity -> Write, oldest first
    findings: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    verdicts: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    others: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    jobs: set = field(default_factory=set)
    dropped: int = 0            # writes and records read but not kept (the caps above)
    first_wall: float | None = None
    last_wall: float | None = None

    def _seen_wall(self, wall) -> None:
        if not _is_wall(wall):
            return
        self.first_wall = wall if self.first_wall is None else min(self.first_wall, wall)
        self.last_wall = wall if self.last_wall is None else max(self.last_wall, wall)

    def _keep_write(self, w: Write) -> None:
        key = write_identity(w)
        if key in self.kept_writes:
            return
        self.kept_writes[key] = w
        if len(self.kept_writes) > MAX_WRITES_KEPT:
            self.kept_writes.pop(next(iter(self.kept_writes)))
            self.dropped += 1
        if w.writer.job is not None and len(self.jobs) < MAX_JOBS_KEPT:
            self.jobs.add(str(w.writer.job))
        self._seen_wall(w.start_wall)
        self._seen_wall(w.end_wall)

    def _keep(self, bounded: deque, record: dict) -> None:
        if len(bounded) == bounded.maxlen:
            self.dropped += 1
        bounded.append(record)


def write_identity(w: Write) -> tuple:
    """One save, whether read from its "write" record or from a collision's writers."""
    return (w.writer.node, w.writer.pid, w.path, w.seq, w.start_wall)


def _is_wall(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and MIN_WALL <= value <= MAX_WALL)


def _optional_int(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def checked_write(rec: dict) -> Write:
    """Write.from_record, refusing what would break arithmetic or layout downstream (a string
    for a time, NaN, a negative duration): raises ValueError."""
    w = Write.from_record(rec)
    duration = rec.get("duration")
    if not isinstance(w.path, str) or not isinstance(w.writer.node, str):
        raise ValueError("path and node must be strings")
    if not _is_wall(w.start_wall):
        raise ValueError("start_wall is not a wall time")
    if w.end_wall is not None and not _is_wall(w.end_wall):
        raise ValueError("end_wall is not a wall time")
    if duration is not None and not (isinstance(duration, (int, float))
                                     and 0 <= duration <= MAX_DURATION):
        raise ValueError("duration out of range")
    if w.end_wall is not None and not 0 <= w.end_wall - w.start_wall <= MAX_DURATION:
        raise ValueError("end_wall before start_wall")
    if not all(_optional_int(v) for v in (w.writer.pid, w.writer.rank, w.seq, w.bytes)):
        raise ValueError("pid, rank, seq and bytes must be integers")
    if w.writer.pid is None:
        raise ValueError("pid missing")
    return w


def summarize(journal_path, summary: JournalSummary | None = None, details: bool = True,
              seen: set | None = None) -> JournalSummary:
    """Read a journal (rotated files too), or a list of journals (several nodes') merged into
    one summary: a collision several agents recorded (same id) and a hazard several reported
    are kept once. details=False keeps only the collisions, hazards and counts (the table and
    JSON need no more; keeping 100,000 writes costs ~100 MB). Raises OSError if one exists but
    cannot be read."""
    if not isinstance(journal_path, str):
        summary, seen = JournalSummary(), set()
        for path in journal_path:
            summarize(path, summary, details, seen)
        summary.collisions.sort(key=lambda c: c.first.start_wall)
        return summary
    stats = ReadStats()
    summary = summary if summary is not None else JournalSummary()
    summary.journals.append(journal_path)
    if seen is None:
        seen = {(c.id, c.kind, c.scope) for c in summary.collisions if c.id}
    for record in read_records(journal_path, stats):
        kind = record.get("type")
        if kind == "write":
            if record.get("source") == "job":
                continue          # another node's write: counted in that node's journal
            summary.writes += 1
            if not details:
                continue
            try:
                summary._keep_write(checked_write(record))
            except (KeyError, TypeError, ValueError, AttributeError):
                summary.malformed += 1
        elif kind == FINDING_HAZARD:
            key = ("hazard", repr(record.get("job"))[:200], record.get("path"),
                   repr(record.get("hazard"))[:200])      # hashable whatever the journal holds
            if not isinstance(record.get("path"), str):
                summary.malformed += 1
            elif key not in seen:
                seen.add(key)
                summary.hazards.append(record)
        elif kind == "collision":
            try:
                collision = Collision.from_record(record)
                writes = tuple(checked_write(w) for w in record["writers"])
                if not writes or not isinstance(collision.path, str):
                    raise ValueError("a collision without writers")
            except (KeyError, TypeError, ValueError, AttributeError):
                summary.malformed += 1
                continue
            # The same collision journaled twice (e.g. by two exporters) is shown once.
            key = (collision.id, collision.kind, collision.scope)
            if collision.id and key in seen:
                continue
            seen.add(key)
            summary.collisions.append(collision)
            for w in writes if details else ():
                summary._keep_write(w)
        elif kind == "verification":
            # Kept without details too: the table tells what the agent found in the file a
            # collision wrote (monitor/cli/report.py).
            if not isinstance(record.get("path", ""), str):
                summary.malformed += 1
            elif record.get("result") in BAD_VERDICTS:
                summary._keep(summary.verdicts, record)
        elif not details:
            continue
        elif not isinstance(record.get("path", ""), str):
            summary.malformed += 1
        elif kind in FINDING_TYPES:
            summary._keep(summary.findings, record)
        else:
            summary._keep(summary.others, record)
    summary.malformed += stats.malformed
    summary.files += stats.files
    return summary


def load(journal_path: str) -> list:
    """The collisions recorded in a journal, oldest first."""
    return summarize(journal_path).collisions


# --- one file's history, for `ckptwatch diagnose` -------------------------------------------

MAX_HISTORY = 1_000                 # records kept per kind for one path (newest kept)
MAX_SEEN = 10_000                   # identities remembered to drop a record several journals hold


@dataclass
class PathHistory:
    """Everything the journals say about one file (or the files under one directory): its
    collisions (deduplicated across journals, as summarize does), its writes and the verdicts
    the agent journaled (corrupt or unverifiable only: an ok verdict is not journaled)."""

    collisions: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)
    paths: set = field(default_factory=set)          # the journal paths that matched
    malformed: int = 0
    dropped: int = 0


def path_matcher(name: str):
    """A test for journal paths (absolute) that are `name`: the same path, a file below it
    (a checkpoint directory), or, for a relative name from a log, a path ending in it."""
    name = name.rstrip("/") or "/"
    if name.startswith("/"):
        below = name + "/"
        return lambda p: p == name or p.startswith(below)
    tail, inside = "/" + name.lstrip("./"), "/" + name.lstrip("./") + "/"
    return lambda p: p.endswith(tail) or inside in p


def path_history(journal_paths, name: str) -> PathHistory:
    """The records of `name` in the journals (each a journal file whose rotated files are read
    too). Raises OSError if one exists but cannot be read."""
    matches = path_matcher(name)
    history = PathHistory()
    seen: OrderedDict = OrderedDict()        # bounded: the newest identities

    def first_time(key) -> bool:
        if key in seen:
            return False
        seen[key] = None
        if len(seen) > MAX_SEEN:
            seen.popitem(last=False)
        return True

    def keep(items: list, item) -> None:
        items.append(item)
        if len(items) > MAX_HISTORY:
            items.pop(0)
            history.dropped += 1

    for journal in journal_paths:
        stats = ReadStats()
        for record in read_records(journal, stats):
            path = record.get("path")
            if not isinstance(path, str) or not matches(path):
                continue
            kind = record.get("type")
            try:
                if kind == "collision":
                    collision = Collision.from_record(record)
                    for w in record["writers"]:
                        checked_write(w)
                    key = ("collision", collision.id, collision.kind, collision.scope)
                    if collision.id and not first_time(key):
                        continue
                    keep(history.collisions, collision)
                elif kind == "write" and record.get("source") != "job":
                    write = checked_write(record)
                    if not first_time(write_identity(write)):
                        continue
                    keep(history.writes, write)
                elif kind == "verification":
                    keep(history.verdicts, record)
                else:
                    continue
            except (KeyError, TypeError, ValueError, AttributeError):
                history.malformed += 1
                continue
            history.paths.add(path)
        history.malformed += stats.malformed
    history.collisions.sort(key=lambda c: c.first.start_wall)
    history.writes.sort(key=lambda w: w.start_wall)
    return history
