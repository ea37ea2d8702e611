"""Agent-side values: writers, writes, collisions and findings. Pure and immutable; imports
only the standard library and the training side's stdlib-only contract (ckptwatch.events,
ckptwatch.jobrun), so the exporters can take these types and nothing else of monitor.

The detector, the filesystem tracker and the size history produce these, the exporters
(metrics, journal, log) and `ckptwatch report` consume them. Journal records are built here
(to_record) and read back here (from_record) so the two can never drift apart. Field names
follow ckptwatch/events.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Mapping

from ckptwatch.events import WRITER_FIELDS, WRITER_KINDS, WRITER_OTHER
from ckptwatch.jobrun import job_run

KIND_CONCURRENT = "concurrent"
KIND_REDUNDANT = "redundant"
SCOPE_NODE = "node"
SCOPE_JOB = "job"           # the collision includes writes of other nodes, learnt via the store
_WRITER_KINDS = frozenset(WRITER_KINDS)
SOURCE_HOOK = "hook"
SOURCE_FS = "fs"
SOURCE_JOB = "job"          # a write of another node, reported by a local hook's job scope
# Finding kinds: the journal record's "type" and what the metrics count.
FINDING_SIZE_FLUCTUATION = "size_fluctuation"
FINDING_TORN_READ = "torn_read"
FINDING_VERIFICATION = "verification"
FINDING_HAZARD = "hazard"   # details["hazard"]: local_rank_guard | shared_storage_multi_writer
OUTCOME_LOST = "lost"       # a Write's outcome when its end never came
# Why the detector refused a start (monitor.detect.pairing) or a remote write
# (monitor.detect.remote): the values of the metrics' `reason` labels.
REFUSE_REASONS = ("writer_open_limit", "path_open_limit", "open_limit")
REMOTE_REJECT_REASONS = ("unanchored", "path_full", "held_full", "local_writer")


@dataclass(frozen=True)
class Writer:
    """One process, identified by (node, pid), with what it told us about itself."""

    node: str
    pid: int
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    job: str | None = None
    master: str | None = None
    restart: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.pid)

    @property
    def run_key(self) -> tuple | None:
        """The job run this writer belongs to (ckptwatch.jobrun.job_run); None when nothing
        names it."""
        return job_run(self.job, self.master, self.restart)

    @property
    def job_label(self) -> str:
        """Value of the `training_job` metric label: the job id, or "" when unknown."""
        return self.job or ""

    @property
    def label(self) -> str:
        """Short human name: rank3@node-a, or pid1234@node-a without a rank."""
        who = f"rank{self.rank}" if self.rank is not None else f"pid{self.pid}"
        return f"{who}@{self.node}"

    @classmethod
    def from_event(cls, event: Mapping) -> "Writer":
        """The writer named by a hook event, an fs event or a journal record (the same
        field names: ckptwatch/events.py)."""
        return cls(*writer_key(event))

    def to_record(self) -> dict:
        """The writer's fields in the shape of a hook event (and of the journal's records)."""
        return {name: getattr(self, name) for name in WRITER_FIELDS}


# The contract's writer fields are Writer's, in its constructor's order: a Writer is built
# from them (writer_key) and written back by them (to_record).
assert tuple(Writer.__dataclass_fields__) == WRITER_FIELDS, Writer.__dataclass_fields__

_writer_values = itemgetter(*WRITER_FIELDS)


def writer_key(event: Mapping) -> tuple:
    """The values naming the event's writer, in WRITER_FIELDS order (None for a field it
    lacks). The detector builds one per event: a hook's events carry every field, and one
    itemgetter call takes 0.6x the time of ten dict.get calls."""
    try:
        return _writer_values(event)
    except KeyError:
        return tuple(map(event.get, WRITER_FIELDS))


@dataclass(frozen=True)
class Write:
    """One writer's interval on one path. end_* are None while the write is in flight."""

    writer: Writer
    path: str
    seq: int
    start_wall: float
    start_mono: float
    end_wall: float | None = None
    end_mono: float | None = None
    bytes: int | None = None
    outcome: str | None = None        # "ok", an exception type name, or OUTCOME_LOST
    site: str | None = None
    func: str | None = None
    source: str = SOURCE_HOOK
    # For a remote write (source "job"): the pid of the local process whose job scope reported
    # it. What it says about the remote writer is that process's word, not the kernel's.
    reporter: int | None = None
    # The library that wrote (ckptwatch.events.WRITER_KINDS, or WRITER_OTHER for a value this
    # agent does not know). None: not said -- a hook write then went through torch.save (the
    # torch.save hook omits the field), a filesystem write is any writer's.
    writer_kind: str | None = None

    @classmethod
    def of(cls, writer: Writer, path: str, seq: int, start_wall: float, start_mono: float,
           end_wall: float | None, end_mono: float | None, bytes: int | None,  # noqa: A002
           outcome: str | None, site: str | None, func: str | None, source: str,
           reporter: int | None, writer_kind: str | None = None) -> "Write":
        """Write(...) with every field given, in order: the same value, built ~3x faster.
        The detector builds one per finished save, and a frozen dataclass's __init__ stores
        each of its 13 fields through object.__setattr__; this stores the instance's
        dictionary, as that __init__ leaves it, in one step (tests/unit/test_detector.py holds the
        two to the same fields and values)."""
        write = object.__new__(cls)
        object.__setattr__(write, "__dict__", {
            "writer": writer, "path": path, "seq": seq, "start_wall": start_wall,
            "start_mono": start_mono, "end_wall": end_wall, "end_mono": end_mono,
            "bytes": bytes, "outcome": outcome, "site": site, "func": func, "source": source,
            "reporter": reporter, "writer_kind": writer_kind})
        return write

    @property
    def finished(self) -> bool:
        return self.end_mono is not None

    @property
    def duration(self) -> float | None:
        return None if self.end_mono is None else max(0.0, self.end_mono - self.start_mono)

    def to_record(self) -> dict:
        """The journal's "write" record and the per-writer entry of a collision record."""
        rec = self.writer.to_record()
        rec.update(self.own_record())
        return rec

    def own_record(self) -> dict:
        """The write's own fields of its record (all but its writer's), in record order. The
        journal encodes a writer's fields once and these once per finished save."""
        end = self.end_mono
        rec = {"path": self.path, "seq": self.seq, "start_wall": self.start_wall,
               "end_wall": self.end_wall,
               "duration": None if end is None else max(0.0, end - self.start_mono),
               "bytes": self.bytes, "outcome": self.outcome, "site": self.site,
               "func": self.func, "source": self.source}
        if self.reporter is not None:
            rec["reported_by"] = self.reporter
        if self.writer_kind is not None:
            rec["writer"] = self.writer_kind
        return rec

    @classmethod
    def from_record(cls, rec: dict) -> "Write":
        writer = Writer.from_event(rec)
        duration = rec.get("duration")
        start_wall = rec["start_wall"]
        end_wall = rec.get("end_wall")
        # Journal records carry wall times only; monotonic values are rebuilt from them so
        # intervals stay comparable within one record.
        return cls(writer=writer, path=rec["path"], seq=rec.get("seq", 0),
                   start_wall=start_wall, start_mono=start_wall, end_wall=end_wall,
                   end_mono=(start_wall + duration) if duration is not None else end_wall,
                   bytes=rec.get("bytes"), outcome=rec.get("outcome"), site=rec.get("site"),
                   func=rec.get("func"), source=rec.get("source", SOURCE_HOOK),
                   reporter=rec.get("reported_by"), writer_kind=writer_kind_of(rec))


def writer_kind_of(event: dict, key: str = "writer") -> str | None:
    """An event's or record's `writer` (a remote event's `writer_kind`: its `writer` is the
    writer's identity), bounded to the known kinds: None if absent or not a string, a known
    kind as itself, any other string as WRITER_OTHER (a sender may say anything; it never
    becomes a label, a record or a line of text as sent)."""
    kind = event.get(key)
    if kind is None or type(kind) is not str:
        return None
    return kind if kind in _WRITER_KINDS else WRITER_OTHER


@dataclass(frozen=True)
class Collision:
    """One maximal group of writes on one path (see design.md, Definitions)."""

    path: str
    kind: str                              # KIND_CONCURRENT | KIND_REDUNDANT
    writes: tuple[Write, ...]              # in start order
    scope: str = SCOPE_NODE
    sources: tuple[str, ...] = (SOURCE_HOOK,)
    detected_wall: float = 0.0
    id: str = field(default="")            # stable id: path + first start, for linking

    @property
    def first(self) -> Write:
        return min(self.writes, key=lambda w: w.start_mono)

    @property
    def last(self) -> Write:
        """The writer that finished last: its bytes are what is on disk."""
        return max(self.writes, key=lambda w: (w.end_mono if w.end_mono is not None
                                               else float("inf")))

    @property
    def writers(self) -> tuple[Writer, ...]:
        seen: dict = {}
        for w in self.writes:
            seen.setdefault(w.writer.key, w.writer)
        return tuple(seen.values())

    @property
    def job_label(self) -> str:
        jobs = sorted({w.writer.job_label for w in self.writes})
        return jobs[0] if len(jobs) == 1 else ",".join(j or "?" for j in jobs)

    @property
    def overlap_seconds(self) -> float:
        """How long two or more of the writes were in flight at the same time (a write still
        in flight when the collision was reported counts until the latest time it names)."""
        points = []
        latest = max(max(w.start_mono, w.end_mono if w.end_mono is not None else w.start_mono)
                     for w in self.writes)
        for w in self.writes:
            end = w.end_mono if w.end_mono is not None else latest
            points.append((w.start_mono, 1))
            points.append((end, -1))
        points.sort(key=lambda p: (p[0], p[1]))
        total, depth, since = 0.0, 0, 0.0
        for t, delta in points:
            if depth >= 2:
                total += t - since
            depth += delta
            since = t
        return total

    def to_record(self) -> dict:
        first, last = self.first, self.last
        return {"type": "collision", "id": self.id, "path": self.path, "kind": self.kind,
                "scope": self.scope, "sources": list(self.sources), "job": self.job_label,
                "detected_wall": self.detected_wall, "overlap_seconds": self.overlap_seconds,
                "writers": [w.to_record() for w in self.writes],
                "first": {"node": first.writer.node, "pid": first.writer.pid,
                          "rank": first.writer.rank, "site": first.site},
                "last": {"node": last.writer.node, "pid": last.writer.pid,
                         "rank": last.writer.rank, "site": last.site}}

    @classmethod
    def from_record(cls, rec: dict) -> "Collision":
        writes = tuple(Write.from_record(w) for w in rec["writers"])
        return cls(path=rec["path"], kind=rec["kind"], writes=writes,
                   scope=rec.get("scope", SCOPE_NODE),
                   sources=tuple(rec.get("sources", [SOURCE_HOOK])),
                   detected_wall=rec.get("detected_wall", 0.0), id=rec.get("id", ""))


@dataclass(frozen=True)
class Finding:
    """Something wrong with a checkpoint that is not a collision: a size fluctuation, a torn
    read, a verification verdict. The journal's record is {"type": kind, ...}.

    `writers` are the processes involved, as record-shaped dicts (identity fields plus what
    the producer knew of each write); `details` holds the kind's own fields (size_before,
    reader, result, ...), in record order. Both are carried into the record unchanged, so a
    finding journals exactly as the dicts it replaced did.
    """

    kind: str                               # FINDING_*
    path: str
    job: str = ""                           # the metric label ("a,b" for several jobs)
    wall: float | None = None
    node: str | None = None
    source: str | None = None               # SOURCE_HOOK | SOURCE_FS; None for a verdict
    writers: tuple[Mapping[str, Any], ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str, default=None):
        """A kind-specific field (details), e.g. f.get("size_before")."""
        return self.details.get(name, default)

    def to_record(self) -> dict:
        rec: dict = {"type": self.kind, "path": self.path}
        if self.node is not None:
            rec["node"] = self.node
        if self.source is not None:
            rec["source"] = self.source
        rec["job"] = self.job
        rec["wall"] = self.wall
        if self.writers:
            rec["writers"] = [dict(w) for w in self.writers]
        rec.update(self.details)
        return rec

    @classmethod
    def from_record(cls, rec: Mapping) -> "Finding":
        details = {k: v for k, v in rec.items()
                   if k not in ("type", "path", "job", "wall", "node", "source", "writers",
                                "ts")}
        return cls(kind=rec["type"], path=rec["path"], job=rec.get("job") or "",
                   wall=rec.get("wall"), node=rec.get("node"), source=rec.get("source"),
                   writers=tuple(rec.get("writers") or ()), details=details)
