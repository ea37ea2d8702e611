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
from monitor.cli import journalrecords
from monitor.detect.model import FINDING_HAZARD, Collision, Write


# What `summarize` keeps of a journal, newest kept when there is more: the journal is input
# from every user on the node (up to 6 x 64 MiB by default, any size if configured so), and
# `report` must not take memory in proportion to it. Counts stay exact (up to MAX_SEEN, see
# below); what is read but not kept is counted in `dropped` and the report says so.
MAX_WRITES_KEPT = 100_000           # writes kept for the timeline (html only)
MAX_RECORDS_KEPT = 10_000           # per list: collisions, hazards, findings, other records
MAX_VERDICT_PATHS = 10_000          # files whose latest verdict is kept
# Weight kept per list (collisions, hazards, findings), by journalrecords.sized's count of the
# kept strings and values: a record may hold up to ~1 MiB of them, and 10,000 such records
# must not take 10 GiB. Measured: docs/report.md.
MAX_KEPT_BYTES = 64 << 20
MAX_JOBS_KEPT = 1_000
MAX_COLLISION_WRITERS = 10_000      # about what one journal line (MAX_LINE_BYTES) holds
# Identities remembered to show a collision or hazard several journals (or exporters) hold
# once: a duplicate further apart than this many distinct ones is counted twice.
MAX_SEEN = 100_000
# Wall times outside this range are not from a real clock (0, negative, NaN, year 5138...).
MIN_WALL, MAX_WALL = 1.0, 1e11
MAX_DURATION = 1e7                  # seconds (four months): longer is not a save

FINDING_TYPES = ("size_fluctuation", "torn_read")
# Verdicts that say a file is bad; of them, these make `report` exit 1 (a checkpoint that will
# not load): corrupt, and incomplete (a checkpoint set whose save never finished).
BAD_VERDICTS = ("corrupt", "unverifiable", "incomplete")
UNUSABLE_VERDICTS = ("corrupt", "incomplete")
OK = "ok"


@dataclass
class PathVerdict:
    """The newest verdict journaled for one file and, when it is ok, the bad verdict it
    superseded (a later save of the same path was verified whole)."""

    latest: dict
    superseded: dict | None = None
    weight: int = 0

    def record(self) -> dict:
        """The latest verdict's record, with "supersedes": the bad one it replaced."""
        rec = dict(self.latest)
        if self.superseded is not None:
            rec["supersedes"] = {k: self.superseded.get(k) for k in
                                 ("result", "cause", "reason", "wall", "collision_id")}
        return rec


class _Bounded(list):
    """A list that keeps its newest items: at most `cap` of them weighing at most `max_bytes`
    (a weight per item, journalrecords.sized). Trimmed in batches: amortised O(1)."""

    def __init__(self, cap: int, max_bytes: int = MAX_KEPT_BYTES):
        super().__init__()
        self.cap, self.max_bytes = cap, max_bytes
        self.weights: list = []
        self.bytes = 0
        self.dropped = 0

    def add(self, item, weight: int = 0) -> None:
        self.append(item)
        self.weights.append(weight)
        self.bytes += weight
        if len(self) >= 2 * self.cap or self.bytes > 2 * self.max_bytes:
            self.trim()

    def trim(self) -> None:
        drop = max(0, len(self) - self.cap)
        removed = sum(self.weights[:drop])
        while drop < len(self) and self.bytes - removed > self.max_bytes:
            removed += self.weights[drop]
            drop += 1
        if drop:
            del self[:drop]
            del self.weights[:drop]
            self.bytes -= removed
            self.dropped += drop

    def order(self, key) -> None:
        """Sort by key, the weights with their items."""
        pairs = sorted(zip(self, self.weights), key=lambda pair: key(pair[0]))
        self[:] = [item for item, _ in pairs]
        self.weights = [weight for _, weight in pairs]


class _Seen:
    """Bounded memory of identities (their hashes), oldest forgotten first."""

    def __init__(self, cap: int = MAX_SEEN):
        self._keys: OrderedDict = OrderedDict()
        self._cap = cap

    def first_time(self, key) -> bool:
        h = hash(key)
        if h in self._keys:
            return False
        self._keys[h] = None
        if len(self._keys) > self._cap:
            self._keys.popitem(last=False)
        return True


@dataclass
class JournalSummary:
    """What a journal holds: its collisions (oldest first), hazards, findings (size
    fluctuations, torn reads), the latest verdict per file, how many writes it recorded and,
    for the timeline, the writes themselves and records of types this version does not know.
    Every list is bounded (newest kept); `counts` are exact; `dropped` counts what was read
    but not kept."""

    collisions: list = field(default_factory=lambda: _Bounded(MAX_RECORDS_KEPT, MAX_KEPT_BYTES))
    hazards: list = field(default_factory=lambda: _Bounded(MAX_RECORDS_KEPT, MAX_KEPT_BYTES))
    findings: list = field(default_factory=lambda: _Bounded(MAX_RECORDS_KEPT, MAX_KEPT_BYTES))
    writes: int = 0
    malformed: int = 0          # lines or records that could not be read
    files: int = 0
    journals: list = field(default_factory=list)
    kept_writes: OrderedDict = field(default_factory=OrderedDict)   # identity -> Write
    verdicts_by_path: OrderedDict = field(default_factory=OrderedDict)  # path -> PathVerdict
    others: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    jobs: set = field(default_factory=set)
    counts: dict = field(default_factory=lambda: dict.fromkeys(
        ("collisions", "concurrent", "redundant", "hazards", "size_fluctuations",
         "torn_reads", "verifications"), 0))
    dropped: int = 0            # writes and records read but not kept (the caps above)
    first_wall: float | None = None
    last_wall: float | None = None
    seen: _Seen = field(default_factory=_Seen, repr=False)
    verdict_bytes: int = 0

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
            self.kept_writes.popitem(last=False)        # O(1), unlike pop(next(iter(d)))
            self.dropped += 1
        if w.writer.job is not None and len(self.jobs) < MAX_JOBS_KEPT:
            self.jobs.add(str(w.writer.job))
        self._seen_wall(w.start_wall)
        self._seen_wall(w.end_wall)

    def _keep(self, bounded: deque, record: dict) -> None:
        if len(bounded) == bounded.maxlen:
            self.dropped += 1
        bounded.append(record)

    def _verdict(self, record: dict, weight: int = 0) -> None:
        path = record["path"]
        entry = self.verdicts_by_path.pop(path, None)
        if entry is None:
            entry = PathVerdict(record)
        else:
            self.verdict_bytes -= entry.weight
            previous = entry.latest
            if record.get("result") == OK and previous.get("result") in BAD_VERDICTS:
                entry.superseded = previous
            elif record.get("result") != OK:
                entry.superseded = None
            entry.latest = record
        entry.weight = weight + (len(entry.superseded) * 32 if entry.superseded else 0)
        self.verdict_bytes += entry.weight
        self.verdicts_by_path[path] = entry          # newest last
        while len(self.verdicts_by_path) > MAX_VERDICT_PATHS or (
                self.verdict_bytes > MAX_KEPT_BYTES and len(self.verdicts_by_path) > 1):
            _, oldest = self.verdicts_by_path.popitem(last=False)
            self.verdict_bytes -= oldest.weight
            self.dropped += 1

    def finish(self) -> None:
        """Trim the bounded lists and order the collisions (oldest first)."""
        for bounded in (self.collisions, self.hazards, self.findings):
            bounded.trim()
        self.collisions.order(lambda c: c.first.start_wall)

    @property
    def verdicts(self) -> list:
        """Each file's latest verdict record (with what it superseded), oldest first."""
        return [entry.record() for entry in self.verdicts_by_path.values()]

    @property
    def unusable(self) -> list:
        """Verdict records of files whose latest verdict is corrupt or incomplete."""
        return [entry.latest for entry in self.verdicts_by_path.values()
                if entry.latest.get("result") in UNUSABLE_VERDICTS]

    @property
    def total_dropped(self) -> int:
        return self.dropped + sum(b.dropped for b in (self.collisions, self.hazards,
                                                      self.findings))

    @property
    def unsafe(self) -> bool:
        """A collision, a hazard or an unusable checkpoint: `report` exits 1."""
        return bool(self.counts["collisions"] or self.counts["hazards"] or self.unusable)


def write_identity(w: Write) -> tuple:
    """One save, whether read from its "write" record or from a collision's writers."""
    return (w.writer.node, w.writer.pid, w.path, w.seq, w.start_wall)


def _is_wall(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and MIN_WALL <= value <= MAX_WALL)


def _optional_int(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _optional_str(value) -> bool:
    return value is None or isinstance(value, str)


def checked_write(rec: dict) -> Write:
    """Write.from_record, refusing what would break arithmetic or layout downstream (a string
    for a time, NaN, a negative duration, a list for a call site): raises ValueError."""
    if not isinstance(rec, dict):
        raise ValueError("a write is an object")
    w = Write.from_record(rec)
    duration = rec.get("duration")
    if not isinstance(w.path, str) or not isinstance(w.writer.node, str):
        raise ValueError("path and node must be strings")
    if not _is_wall(w.start_wall):
        raise ValueError("start_wall is not a wall time")
    if w.end_wall is not None and not _is_wall(w.end_wall):
        raise ValueError("end_wall is not a wall time")
    if duration is not None and (isinstance(duration, bool) or not (
            isinstance(duration, (int, float)) and 0 <= duration <= MAX_DURATION)):
        raise ValueError("duration out of range")
    if w.end_wall is not None and not 0 <= w.end_wall - w.start_wall <= MAX_DURATION:
        raise ValueError("end_wall before start_wall")
    writer = w.writer
    if not all(_optional_int(v) for v in (writer.pid, writer.rank, writer.local_rank,
                                          writer.world_size, writer.local_world_size,
                                          writer.node_rank, writer.restart, w.seq, w.bytes,
                                          w.reporter)):
        raise ValueError("pid, rank, seq and bytes must be integers")
    if not all(_optional_str(v) for v in (writer.job, writer.master, w.outcome, w.site,
                                          w.func, w.source)):
        raise ValueError("job, outcome, call site and source must be strings")
    if writer.pid is None:
        raise ValueError("pid missing")
    if not all(abs(v) < journalrecords.MAX_INT for v in (writer.pid, writer.rank, w.seq,
                                                           w.bytes) if v is not None):
        raise ValueError("an integer out of range")
    return w


def checked_collision(record: dict) -> Collision:
    """Collision.from_record with every writer checked (checked_write) and its own fields of
    the types the renderers expect: raises ValueError."""
    writers = record.get("writers")
    if not isinstance(writers, list) or not writers:
        raise ValueError("a collision without writers")
    if len(writers) > MAX_COLLISION_WRITERS:
        raise ValueError("more writers than a journal line holds")
    for key in ("path", "kind"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{key} must be a string")
    for key in ("scope", "id"):
        if not _optional_str(record.get(key)):
            raise ValueError(f"{key} must be a string")
    sources = record.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ValueError("sources must be strings")
    detected = record.get("detected_wall", 0.0)
    if isinstance(detected, bool) or not isinstance(detected, (int, float)):
        raise ValueError("detected_wall must be a number")
    writes = tuple(checked_write(w) for w in writers)
    collision = Collision.from_record(record)
    return collision.__class__(path=collision.path, kind=collision.kind, writes=writes,
                               scope=collision.scope or "node", sources=collision.sources,
                               detected_wall=collision.detected_wall if _is_wall(
                                   collision.detected_wall) else 0.0,
                               id=collision.id or "")


def collision_weight(c: Collision) -> int:
    """About the bytes a kept collision holds (its strings and ~200 bytes of values per
    write), for the kept lists' weight bound."""
    return len(c.path) + sum(200 + len(w.path) + len(w.site or "") + len(w.func or "")
                             + len(w.writer.node) + len(w.writer.job or "")
                             for w in c.writes)


def summarize(journal_path, summary: JournalSummary | None = None, details: bool = True,
              seen=None) -> JournalSummary:
    """Read a journal (rotated files too), or a list of journals (several nodes') merged into
    one summary: a collision several agents recorded (same id) and a hazard several reported
    are kept once. details=False keeps no writes nor records of unknown types (the table and
    JSON need no more; keeping 100,000 writes costs ~100 MB). Raises OSError if one exists but
    cannot be read (exporters.journal.NotAJournal: not a regular file)."""
    if not isinstance(journal_path, str):
        summary = JournalSummary()
        for path in journal_path:
            _read(path, summary, details)
        summary.finish()
        return summary
    summary = summary if summary is not None else JournalSummary()
    _read(journal_path, summary, details)
    summary.finish()
    return summary


def _read(journal_path: str, summary: JournalSummary, details: bool) -> None:
    stats = ReadStats()
    summary.journals.append(journal_path)
    counts = summary.counts
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
        elif kind == "collision":
            try:
                collision = checked_collision(record)
            except (KeyError, TypeError, ValueError, AttributeError):
                summary.malformed += 1
                continue
            # The same collision journaled twice (by two agents of a job) is shown once.
            if collision.id and not summary.seen.first_time(
                    ("collision", collision.id, collision.kind, collision.scope)):
                continue
            counts["collisions"] += 1
            if collision.kind in ("concurrent", "redundant"):
                counts[collision.kind] += 1
            summary.collisions.add(collision, collision_weight(collision))
            for w in collision.writes if details else ():
                summary._keep_write(w)
        elif kind in (FINDING_HAZARD, "verification") or kind in FINDING_TYPES:
            rec, weight = journalrecords.sized(record)
            if rec is None:
                summary.malformed += 1
            elif kind == FINDING_HAZARD:
                key = ("hazard", rec.get("job"), rec["path"], rec.get("hazard"))
                if summary.seen.first_time(key):
                    counts["hazards"] += 1
                    summary.hazards.add(rec, weight)
            elif kind == "verification":
                counts["verifications"] += 1
                summary._verdict(rec, weight)
            else:
                counts[kind + "s"] += 1
                summary.findings.add(rec, weight)
        elif details:
            rec = journalrecords.finding(record) if "path" in record else \
                journalrecords.flat(record)
            if rec is None:
                summary.malformed += 1
            else:
                summary._keep(summary.others, rec)
    summary.malformed += stats.malformed
    summary.files += stats.files


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
                    collision = checked_collision(record)
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
                    keep(history.verdicts, journalrecords.finding(record))
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
