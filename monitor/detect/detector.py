"""Write-collision detection: start/end events -> writes -> collisions. Pure logic.

No threads, sockets or clocks of its own: the agent's core loop owns one Detector, feeds it
validated events (observe), calls tick() a few times a second and flush() at shutdown. Each
call returns the values that became final, in order: a Write when a write finished (exactly
once per write) and a Collision when a collision became final (exactly once).

Definitions (design.md, "Definitions"):

- A write is one writer's (node, pid) interval [start_mono, end_mono] on one path. Start and
  end events are paired by (node, pid, seq). An end without a seen start stands alone (it
  carries start_wall / start_mono). A start that never ends is closed with outcome "lost" at
  the last time known for its process, when pid_alive says the process is gone (two checks in
  a row, so an end event still queued in the agent is not pre-empted) or after stale_after.
- Two writes overlap when one starts while the other is in flight: a.start <= b.start < a.end
  for one of the two orders (an in-flight write has end = +inf, so it overlaps every later
  start; two writes starting at the same instant overlap unless both take no time).
  Overlap is decided on the monotonic times carried by the events, never on arrival order,
  because each process's sender delivers asynchronously.
- Concurrent collision: a maximal group of transitively overlapping writes on one path made by
  two or more different writers. It is final when every write in it has ended and `settle`
  seconds passed since the latest end, so a late-arriving start can still join it.
- Redundant write: on one path, writes of the same job run (Writer.run_key, not None) made one
  after another, each starting within `window` seconds of the previous one's end, by two or
  more different writers, with no concurrent collision in between. One maximal chain is one
  collision, final once the chain is closed: broken, or `window` + `settle` elapsed after its
  last end (the extra `settle` lets a next start still in transit extend it).

Times: due times are compared with `clock()`; an ended write counts as done at
max(end_mono, clock at which its end was observed). The event's mono and the agent's
time.monotonic are the same node-wide CLOCK_MONOTONIC, and taking the later of the two keeps
`settle` a real grace period even when an end event itself arrives late.

Memory: a finished write is forgotten once nothing pending needs it -- `settle` after its end
when it cannot take part in a redundant chain (no job run, or the same process saving again),
otherwise when its chain closes; a reported concurrent collision leaves only a small marker
that breaks chains for `max(window, settle)`. At most max_paths paths are tracked (the least
recently touched one is finalized and evicted), at most MAX_PATH_WRITES writes per path (a
storm of overlapping writes sheds its oldest finished writes as a collision), at most
MAX_CHAIN_WRITES writes per redundant chain.

Cost: observe() inserts a start into its path's list and, for an end, only schedules the path:
nothing can become final before `settle` passes, so tick() regroups a path (O(writes held on
it)) at most once per due time, popped from a heap, instead of once per event. tick() also
scans the in-flight writes, at most once per SCAN_INTERVAL.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import operator
import time
from bisect import insort
from collections import OrderedDict
from typing import Callable

from monitor.detect.model import (KIND_CONCURRENT, KIND_REDUNDANT, SCOPE_JOB, SCOPE_NODE,
                                  SOURCE_FS, SOURCE_HOOK, SOURCE_JOB, Collision, Write,
                                  Writer, writer_key)

OUTCOME_LOST = "lost"
# How often tick() looks at in-flight writes for dead processes and stale starts.
SCAN_INTERVAL = 1.0
# A redundant chain that keeps growing (two processes alternating forever) would never close:
# report it once it holds this many writes and start a new chain.
MAX_CHAIN_WRITES = 256
# A path that keeps more writes than this (a storm of overlapping writes that never all end)
# sheds its oldest finished writes, reporting them, so memory and per-event work stay bounded.
MAX_PATH_WRITES = 1024
# Keys of writes closed as "lost": their real end, if it still arrives, must not count twice.
_LOST_KEYS_CAP = 65536
# Writes finished lately, by key and start time: a hook sends again what the agent had not
# acknowledged when a connection ended (ckptwatch/emitter.py), so a start or end seen before
# can arrive again within seconds; it must not make a second write. The start time tells a
# repeat from a new process that got a recycled pid. ~150 bytes each.
_DONE_KEYS_CAP = 16384
# Open (started, not ended) writes held at once: per writer, per path, in all. A real process
# has one or a few saves in flight; beyond a cap a start is refused and counted
# (refused_starts), and its end, if it comes, still reports the write standing alone. The caps
# bound the memory and the work a process can cause by starting writes it never ends.
MAX_OPEN_PER_WRITER = 64
MAX_OPEN_PER_PATH = 256
MAX_OPEN_TOTAL = 16384
REFUSE_REASONS = ("writer_open_limit", "path_open_limit", "open_limit")
# How long, after `settle`, a write still in flight may hold back the report of a concurrent
# collision it belongs to (docs/decisions.md, "In-flight writes do not hide collisions").
DEFAULT_MAX_HOLD = 3.0
_INF = float("inf")
# Shedding keeps MAX_PATH_WRITES // 2 writes, which must leave room for every open one.
assert MAX_OPEN_PER_PATH < MAX_PATH_WRITES // 2
# Job scope (observe_remote): remote writes held per path and in all, and how many remote
# write keys are remembered so a write reported again (by every local rank that wrote the
# path, or by later polls) counts once.
MAX_REMOTE_PER_PATH = 64
MAX_REMOTE_HELD = 8192
_REMOTE_SEEN_CAP = 65536
REMOTE_REJECT_REASONS = ("unanchored", "path_full", "held_full")


class _Entry:
    """One write being tracked (mutable until it ends; as_write() is its value)."""

    __slots__ = ("writer", "path", "seq", "start_wall", "start_mono", "end_wall", "end_mono",
                 "bytes", "outcome", "site", "func", "order", "seen_at", "done_at",
                 "dropped", "source", "seen_by", "reported", "reporter", "stop", "proc")

    def __init__(self, writer: Writer, path: str, seq: int, start_wall: float,
                 start_mono: float, site, func, order: int, seen_at: float,
                 source: str = SOURCE_HOOK):
        self.source = source            # who reported this write: "hook", "fs" or "job"
        self.reporter = None            # source "job": the local pid that reported it
        # Every source that saw it (see Detector.mark_source): a frozenset shared by all the
        # entries of one source until another source sees one (a set per write cost 216
        # bytes each, and the collector's time).
        self.seen_by = _SEEN_BY.get(source) or frozenset((source,))
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
        self.stop = _INF
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
                            self.source, None)
        return Write.of(self.writer, self.path, self.seq, self.start_wall, self.start_mono,
                        self.end_wall, self.end_mono, self.bytes, self.outcome, self.site,
                        self.func, self.source, self.reporter)


_SEEN_BY = {source: frozenset((source,)) for source in (SOURCE_HOOK, SOURCE_FS, SOURCE_JOB)}
_MAX_CACHED_WRITERS = 4096     # a job has a few writers; a flood of distinct identities only
                               # rebuilds Writers (65,536 held ~12 MB: the soak, issue 8)


def _sort_key(entry: _Entry) -> tuple:
    return (entry.start_mono, entry.order)


def _sweep_key(entry: _Entry) -> tuple:
    # Longest first among equal starts, so a sweep on "start < stop so far" sees exactly the
    # symmetric overlap relation.
    return (entry.start_mono, -entry.stop, entry.order)


class _Group:
    """A maximal set of transitively overlapping writes on one path."""

    __slots__ = ("entries", "start", "stop", "writers", "in_flight", "done_at", "news",
                 "news_open", "news_done")

    def __init__(self, entry: _Entry):
        self.entries = [entry]
        self.start = entry.start_mono
        self.stop = entry.stop
        self.writers = {entry.proc}
        done_at = entry.done_at
        self.in_flight = entry.end_mono is None
        self.done_at = done_at if done_at is not None else -_INF
        # Writes not yet named in a collision: whether there are any, the latest arrival of
        # one still in flight, the earliest end of one finished (see Detector._regroup).
        # _note_news(entry) on an empty group, spelled out: one group is built per write each
        # time its path is regrouped. max/min as there, so a NaN time gives the same values.
        if entry.reported:
            self.news, self.news_open, self.news_done = False, -_INF, _INF
        elif done_at is None:
            self.news, self.news_open, self.news_done = True, max(-_INF, entry.seen_at), _INF
        else:
            self.news, self.news_open, self.news_done = True, -_INF, min(_INF, done_at)

    def add(self, entry: _Entry) -> None:
        self.entries.append(entry)
        self.stop = max(self.stop, entry.stop)
        self.writers.add(entry.proc)
        if entry.end_mono is None:
            self.in_flight = True
        else:
            self.done_at = max(self.done_at, entry.done_at)
        self._note_news(entry)

    def _note_news(self, entry: _Entry) -> None:
        if entry.reported:
            return
        self.news = True
        if entry.done_at is None:
            self.news_open = max(self.news_open, entry.seen_at)
        else:
            self.news_done = min(self.news_done, entry.done_at)

    def held_until(self, settle: float, hold: float) -> float:
        """When a group with writes in flight is reported anyway (hold = settle + max_hold):
        once its finished writes have settled and each new write in flight had `hold` to
        end, and in any case `hold` after its earliest unreported end, so writes that keep
        starting cannot postpone it forever. +inf when it has nothing new to report."""
        if not self.news:
            return _INF
        return min(max(self.done_at + settle, self.news_open + hold), self.news_done + hold)

    @property
    def concurrent(self) -> bool:
        return len(self.writers) >= 2

    @property
    def runs(self) -> set:
        return {e.writer.run_key for e in self.entries} - {None}


def group_writes(entries: list, in_start_order: bool = False) -> list:
    """Split writes into maximal overlap groups (a sort, nearly free here, and one sweep).

    in_start_order: the entries are sorted by (start_mono, order) and no start is NaN (a
    path's list: _PathState.insert). Without two equal starts that already is the sweep's
    order, and the sort, a Python key call per entry each time a path is regrouped, is
    skipped."""
    ordered = None
    if in_start_order:
        starts = [entry.start_mono for entry in entries]
        if not any(map(operator.eq, starts, starts[1:])):      # no two equal starts
            ordered = entries
    if ordered is None:
        ordered = sorted(entries, key=_sweep_key)
    groups: list[_Group] = []
    current = None
    for entry in ordered:
        if current is not None and entry.start_mono < current.stop:
            current.add(entry)
        else:
            current = _Group(entry)
            groups.append(current)
    return groups


class _Barrier:
    """Where a reported concurrent collision was: it still breaks redundant chains."""

    __slots__ = ("start", "runs", "expire_at")

    def __init__(self, start: float, runs: set, expire_at: float):
        self.start, self.runs, self.expire_at = start, runs, expire_at


class _Chain:
    """Solo groups of one job run on one path, each within the window of the previous."""

    __slots__ = ("groups", "writers", "closed", "provisional", "size")

    def __init__(self, group: _Group):
        self.groups = [group]
        self.writers = set(group.writers)
        self.closed = False
        # Broken by a group that is still in flight: that write may yet end before the
        # group's other writes started, so the break is not final.
        self.provisional = False
        self.size = len(group.entries)

    def add(self, group: _Group) -> None:
        self.groups.append(group)
        self.writers |= group.writers
        self.size += len(group.entries)

    @property
    def last(self) -> _Group:
        return self.groups[-1]


class _PathState:
    __slots__ = ("path", "entries", "barriers", "due", "open", "nan_start")

    def __init__(self, path: str):
        self.path = path
        self.entries: list[_Entry] = []     # sorted by (start_mono, order)
        self.barriers: list[_Barrier] = []
        self.due = None                     # the earliest due time pushed on the heap
        self.open = 0                       # entries still in flight
        self.nan_start = False              # an entry with a NaN start was ever added (insert)

    def insert(self, entry: _Entry) -> None:
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
        insort(entries, entry, key=_sort_key)


class _Proc:
    """A process with writes in flight: their keys, and the latest time it was heard from
    (the "last time known" its writes end at if they are closed as lost)."""

    __slots__ = ("keys", "last_mono", "last_wall")

    def __init__(self):
        self.keys: set = set()
        self.last_mono = -_INF
        self.last_wall = None


def collision_id(path: str, first_start_wall: float) -> str:
    """Stable short id of a collision: the same path and first start give the same id."""
    digest = hashlib.sha1(f"{path}\0{first_start_wall!r}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def job_collision_id(run_key, path: str, writes) -> str:
    """Id of a job-scope collision: the job run, the path and the set of writes (node, pid,
    seq). Every agent that sees the same collision derives the same id from what it knows of
    it, so `ckptwatch report` over several nodes' journals counts it once."""
    keys = sorted((w.writer.node, w.writer.pid, w.seq) for w in writes)
    text = f"{run_key!r}\0{path}\0{keys!r}"
    return "j" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:15]


class Detector:
    """Turns start/end events into Writes and Collisions. See the module docstring."""

    def __init__(self, window: float = 60.0, settle: float = 1.0, stale_after: float = 3600.0,
                 max_paths: int = 10000, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 pid_alive: Callable[[str, int], bool] | None = None,
                 max_hold: float = DEFAULT_MAX_HOLD, job_settle: float = 3.0):
        if (window < 0 or settle < 0 or stale_after <= 0 or max_paths < 1 or max_hold < 0
                or job_settle < 0):
            raise ValueError("window, settle, max_hold and job_settle must be >= 0, "
                             "stale_after > 0, max_paths >= 1")
        self._max_hold = float(max_hold)
        self._window = float(window)
        self._settle = float(settle)
        # A concurrent group with a writer of a distributed job waits this long (at least)
        # before it is final: other nodes' writes of it arrive through the writers' job scope
        # (store round trips, polls), later than local ends.
        self._job_settle = max(float(job_settle), self._settle)
        self._remote_seen: OrderedDict[tuple, None] = OrderedDict()
        self._remote_held = 0
        self.remote_rejected = {reason: 0 for reason in REMOTE_REJECT_REASONS}
        # How long a reported collision still breaks redundant chains.
        self._linger = max(self._window, self._settle)
        self._stale_after = float(stale_after)
        self._max_paths = int(max_paths)
        self._clock = clock
        self._wall_clock = wall_clock
        self._pid_alive = pid_alive
        self._paths: OrderedDict[str, _PathState] = OrderedDict()   # least recent first
        self._open: dict[tuple, _Entry] = {}
        self._open_by_proc: dict[tuple, _Proc] = {}
        self._refused = {reason: 0 for reason in REFUSE_REASONS}
        self._writers: dict[tuple, Writer] = {}
        self._active: dict[str, int] = {}
        self._lost_keys: OrderedDict[tuple, None] = OrderedDict()
        self._done_keys: OrderedDict[tuple, None] = OrderedDict()
        self.repeated = 0       # starts and ends ignored as repeats of a finished write
        self._suspects: set = set()
        self._next_scan = -_INF
        self._due_heap: list = []
        self._order = itertools.count()
        self._evicted = 0

    # ------------------------------------------------------------------ public API

    @property
    def tracked_paths(self) -> int:
        """Paths with writes, in-flight writes or pending groups held in memory."""
        return len(self._paths)

    @property
    def evicted_paths_total(self) -> int:
        """Paths dropped (after finalizing what they held) to stay within max_paths."""
        return self._evicted

    @property
    def open_writes(self) -> int:
        """Writes started and not yet ended (bounded by MAX_OPEN_TOTAL)."""
        return len(self._open)

    def is_open(self, node: str, pid: int, seq: int) -> bool:
        """Is that write in flight here (its start seen, its end not yet)?"""
        return (node, pid, seq) in self._open

    @property
    def refused_starts(self) -> dict:
        """Starts refused at an open-write cap, by reason (REFUSE_REASONS)."""
        return dict(self._refused)

    def active_writes(self) -> dict:
        """In-flight writes per job label ("" for an unknown job)."""
        return dict(self._active)

    def observe(self, event: dict) -> list:
        """Ingest one validated event; return the Writes and Collisions it made final."""
        kind = event.get("type")
        if kind not in ("start", "end"):
            return []
        now = self._clock()
        out: list = []
        key = (event["node"], event["pid"], event["seq"])
        self._note_process_time(key[:2], event)
        if kind == "start":
            self._start(key, event, now, out)
        else:
            self._end(key, event, now, out)
        return out

    def observe_remote(self, event: dict) -> list:
        """A validated "remote" event: another node's write of a path, reported by the local
        process (event node, pid) whose own write `seq` of that path this agent tracks.

        Nothing in it can be checked, so what it can do is bounded: it is taken only while
        the reporter's own write of that path is held here (a sender can add writes only to
        paths it wrote itself, never create one), at most MAX_REMOTE_PER_PATH per path and
        MAX_REMOTE_HELD in all, each remote write once; it is never a Write of this node (no
        write metrics) and its collision says scope "job" and who reported it. Returns the
        Collisions it made final (normally none: the path is regrouped at its due time)."""
        path = event["path"]
        state = self._paths.get(path)
        anchor = (event["node"], event["pid"], event["seq"])
        if state is None or not any(e.key == anchor for e in state.entries):
            self.remote_rejected["unanchored"] += 1
            return []
        w = event["writer"]
        key = (w["node"], w["pid"], event["wseq"])
        if key in self._remote_seen or any(e.key == key for e in state.entries):
            return []
        if sum(1 for e in state.entries if e.source == SOURCE_JOB) >= MAX_REMOTE_PER_PATH:
            self.remote_rejected["path_full"] += 1
            return []
        if self._remote_held >= MAX_REMOTE_HELD:
            self.remote_rejected["held_full"] += 1
            return []
        self._remote_seen[key] = None
        if len(self._remote_seen) > _REMOTE_SEEN_CAP:
            self._remote_seen.popitem(last=False)
        now = self._clock()
        writer = self._writer({**w, "node": w["node"], "pid": w["pid"]})
        entry = _Entry(writer, path, event["wseq"], event["start_wall"], event["start_mono"],
                       event.get("site"), event.get("func"), next(self._order), now,
                       SOURCE_JOB)
        entry.reporter = event["pid"]
        entry.finish(event["end_wall"], event["end_mono"], event.get("bytes"),
                     event["outcome"], now)
        state.insert(entry)
        self._remote_held += 1
        self._paths.move_to_end(path)
        out: list = []
        self._schedule(state, entry.done_at + self._job_settle)
        return out

    def mark_source(self, path: str, key: tuple, source: str) -> bool:
        """Another source saw the write `key` = (node, pid, seq) on `path` too (the filesystem
        watcher saw a save the hook reported): its collision, if any, names both sources.
        False if that write is no longer tracked (already final)."""
        state = self._paths.get(path)
        if state is None:
            return False
        for entry in state.entries:
            if entry.key == key:
                entry.seen_by = entry.seen_by | {source}
                return True
        return False

    def tick(self) -> list:
        """Close dead or stale writes and finalize groups whose time has come."""
        now = self._clock()
        out: list = []
        dirty: dict[str, _PathState] = {}
        if now >= self._next_scan:
            self._next_scan = now + SCAN_INTERVAL
            self._scan_in_flight(now, out, dirty)
        while self._due_heap and self._due_heap[0][0] <= now:
            due, _, path = heapq.heappop(self._due_heap)
            state = self._paths.get(path)
            if state is not None and state.due == due:
                state.due = None
                dirty[path] = state
        for state in dirty.values():
            self._update(state, now, out)
        return out

    def flush(self) -> list:
        """Finalize everything (at shutdown): in-flight writes end as "lost"."""
        now = self._clock()
        out: list = []
        for state in list(self._paths.values()):
            self._finalize_path(state, now, out)
        self._paths.clear()
        self._due_heap.clear()
        return out

    # ------------------------------------------------------------------ events

    def _writer(self, event: dict) -> Writer:
        # One Writer per distinct identity: a process saves many times, and building a frozen
        # dataclass per event is a measurable share of the agent's per-event cost.
        key = writer_key(event)
        writer = self._writers.get(key)
        if writer is None:
            if len(self._writers) >= _MAX_CACHED_WRITERS:
                self._writers.clear()
            writer = self._writers[key] = Writer(*key)
        return writer

    def _note_process_time(self, proc: tuple, event: dict) -> None:
        # Any event of a process tells us it was alive then: the "last time known" for its
        # other in-flight writes if they are ever closed as lost.
        # O(1): one record per process, not one update per open write.
        record = self._open_by_proc.get(proc)
        if record is not None and event["mono"] > record.last_mono:
            record.last_mono, record.last_wall = event["mono"], event["wall"]

    def _start(self, key: tuple, event: dict, now: float, out: list) -> None:
        if key in self._open or key in self._lost_keys:
            return   # a duplicate start, or one whose write was already closed as lost
        if key + (event["mono"],) in self._done_keys:
            self.repeated += 1
            return
        reason = self._over_open_cap(key[:2], event["path"])
        if reason is not None:
            self._refused[reason] += 1
            return
        state = self._state_for(event["path"], now, out)
        entry = _Entry(self._writer(event), event["path"], event["seq"], event["wall"],
                       event["mono"], event.get("site"), event.get("func"), next(self._order),
                       max(event["mono"], now), event.get("source", SOURCE_HOOK))
        state.insert(entry)
        if len(state.entries) > MAX_PATH_WRITES:
            self._update(state, now, out)
        self._open[key] = entry
        record = self._open_by_proc.get(key[:2])
        if record is None:
            record = self._open_by_proc[key[:2]] = _Proc()
        record.keys.add(key)
        state.open += 1
        label = entry.writer.job_label
        self._active[label] = self._active.get(label, 0) + 1
        # No regrouping here: a start only adds an in-flight write, which delays finality;
        # the next end recomputes the path, or at the latest the time this write may hold
        # back a collision it is part of (max_hold).
        self._schedule(state, entry.seen_at + self._settle + self._max_hold)

    def _over_open_cap(self, proc: tuple, path: str) -> str | None:
        record = self._open_by_proc.get(proc)
        if record is not None and len(record.keys) >= MAX_OPEN_PER_WRITER:
            return "writer_open_limit"
        state = self._paths.get(path)
        if state is not None and state.open >= MAX_OPEN_PER_PATH:
            return "path_open_limit"
        if len(self._open) >= MAX_OPEN_TOTAL:
            return "open_limit"
        return None

    def _end(self, key: tuple, event: dict, now: float, out: list) -> None:
        if key in self._lost_keys:
            del self._lost_keys[key]   # already returned as lost: never count it twice
            return
        done = key + (event["start_mono"],)
        if done in self._done_keys:
            self.repeated += 1
            return
        self._done_keys[done] = None
        if len(self._done_keys) > _DONE_KEYS_CAP:
            self._done_keys.popitem(last=False)
        entry = self._open.get(key)
        if entry is None:
            # The start was not sent (a short save), dropped, or seen before an eviction:
            # the end stands alone.
            state = self._state_for(event["path"], now, out)
            entry = _Entry(self._writer(event), event["path"], event["seq"],
                           event["start_wall"], event["start_mono"], event.get("site"),
                           event.get("func"), next(self._order), now,
                           event.get("source", SOURCE_HOOK))
            state.insert(entry)
        else:
            self._forget_open(entry)
            state = self._paths[entry.path]
            self._paths.move_to_end(entry.path)
            if entry.site is None:
                entry.site, entry.func = event.get("site"), event.get("func")
        out.append(entry.finish(event["wall"], event["mono"], event.get("bytes"),
                                event["outcome"], now))
        if self._settle > 0 and len(state.entries) <= MAX_PATH_WRITES:
            # Nothing this end completes can be final before `settle` has passed, so the
            # path is regrouped then, once for all the ends of that interval.
            self._schedule(state, entry.done_at + self._settle)
        else:
            self._update(state, now, out)

    def _forget_open(self, entry: _Entry) -> None:
        key = entry.key
        del self._open[key]
        state = self._paths.get(entry.path)     # None while an evicted path is finalized
        if state is not None:
            state.open -= 1
        proc = key[:2]
        record = self._open_by_proc[proc]
        record.keys.discard(key)
        if not record.keys:
            del self._open_by_proc[proc]
            self._suspects.discard(proc)
        label = entry.writer.job_label
        count = self._active[label] - 1
        if count:
            self._active[label] = count
        else:
            del self._active[label]

    def _close_lost(self, entry: _Entry, now: float) -> Write:
        record = self._open_by_proc[entry.key[:2]]
        if record.last_mono > entry.start_mono:
            end_mono, end_wall = record.last_mono, record.last_wall
        else:
            end_mono, end_wall = entry.start_mono, entry.start_wall
        self._forget_open(entry)
        self._lost_keys[entry.key] = None
        if len(self._lost_keys) > _LOST_KEYS_CAP:
            self._lost_keys.popitem(last=False)
        return entry.finish(end_wall, end_mono, None, OUTCOME_LOST, now)

    def _scan_in_flight(self, now: float, out: list, dirty: dict) -> None:
        suspects = set()
        for proc in list(self._open_by_proc):
            dead = False
            if self._pid_alive is not None:
                try:
                    alive = self._pid_alive(proc[0], proc[1])
                except Exception:    # a broken liveness probe must not lose writes
                    alive = True
                if not alive:
                    # Dead on two scans in a row: its end event is not merely still queued.
                    dead = proc in self._suspects
                    suspects.add(proc)
            record = self._open_by_proc.get(proc)
            for key in list(record.keys if record is not None else ()):
                entry = self._open[key]
                if dead or now - entry.seen_at >= self._stale_after:
                    out.append(self._close_lost(entry, now))
                    dirty[entry.path] = self._paths[entry.path]
        self._suspects = suspects

    # ------------------------------------------------------------------ paths

    def _state_for(self, path: str, now: float, out: list) -> _PathState:
        state = self._paths.get(path)
        if state is not None:
            self._paths.move_to_end(path)
            return state
        while len(self._paths) >= self._max_paths:
            _, oldest = self._paths.popitem(last=False)
            self._finalize_path(oldest, now, out)
            self._evicted += 1
        state = _PathState(path)
        self._paths[path] = state
        return state

    def _finalize_path(self, state: _PathState, now: float, out: list) -> None:
        """Report everything a path holds now (eviction, flush); the caller drops it."""
        for entry in list(state.entries):
            if entry.end_mono is None:
                out.append(self._close_lost(entry, now))
        self._regroup(state, now, True, out)

    def _update(self, state: _PathState, now: float, out: list) -> None:
        due = self._regroup(state, now, False, out)
        if len(state.entries) > MAX_PATH_WRITES:
            self._shed(state, now, out)
        if not state.entries and not state.barriers:
            self._paths.pop(state.path, None)
            return
        self._schedule(state, due)

    def _schedule(self, state: _PathState, due: float) -> None:
        """Make tick() regroup the path at `due` (keeping an earlier time already set)."""
        if due < _INF and (state.due is None or due < state.due):
            state.due = due
            heapq.heappush(self._due_heap, (due, next(self._order), state.path))

    def _regroup(self, state: _PathState, now: float, force: bool, out: list) -> float:
        """Recompute a path's groups and chains, report what is final, return the next due.

        force=True reports every pending group and chain regardless of time.
        """
        settle, window, linger = self._settle, self._window, self._linger
        hold = settle + self._max_hold
        due = _INF
        groups = group_writes(state.entries, in_start_order=not state.nan_start)
        barriers = [] if force else state.barriers
        items = list(heapq.merge(groups, barriers, key=lambda item: item.start)) \
            if barriers else groups
        new_barriers: list[_Barrier] = []
        chains: dict[tuple, _Chain] = {}
        done_chains: list[_Chain] = []

        def break_chains(runs, provisional=False):
            for run in runs:
                chain = chains.pop(run, None)
                if chain is not None:
                    chain.closed = True
                    chain.provisional = provisional
                    done_chains.append(chain)

        for item in items:
            if isinstance(item, _Barrier):
                break_chains(item.runs)
                if now < item.expire_at:
                    new_barriers.append(item)
                    due = min(due, item.expire_at)
                continue
            group = item
            if group.concurrent:
                runs = group.runs
                break_chains(runs, provisional=group.in_flight)
                if group.in_flight:
                    # A write in flight holds the group back for at most `max_hold` after
                    # `settle`: then what is known is reported, naming the open writes as in
                    # flight, so a live but silent writer cannot hide a collision.
                    held_until = group.held_until(self._group_settle(group), hold)
                    if now >= held_until:
                        out.append(self._collision(KIND_CONCURRENT, state.path,
                                                   group.entries))
                        for entry in group.entries:
                            entry.reported = True
                        self._drop(e for e in group.entries if e.end_mono is not None)
                        if group.done_at > -_INF and now < group.done_at + linger:
                            new_barriers.append(_Barrier(group.start, runs,
                                                         group.done_at + linger))
                            due = min(due, group.done_at + linger)
                    else:
                        due = min(due, held_until)
                    continue
                group_settle = self._group_settle(group)
                if force or now >= group.done_at + group_settle:
                    if group.news:      # else all of it was reported while in flight
                        out.append(self._collision(KIND_CONCURRENT, state.path,
                                                   group.entries))
                    self._drop(group.entries)
                    expire_at = group.done_at + linger
                    if not force and now < expire_at:
                        new_barriers.append(_Barrier(group.start, runs, expire_at))
                        due = min(due, expire_at)
                else:
                    due = min(due, group.done_at + group_settle)
                continue
            run = group.entries[0].writer.run_key
            if run is None:
                if group.in_flight:
                    continue
                # Without a job run it can only still join a group through a late start.
                if force or now >= group.done_at + settle:
                    self._drop(group.entries)
                else:
                    due = min(due, group.done_at + settle)
                continue
            chain = chains.get(run)
            if (chain is not None and group.start - chain.last.stop <= window
                    and chain.size < MAX_CHAIN_WRITES):
                chain.add(group)
            else:
                break_chains((run,))
                chains[run] = _Chain(group)

        for chain in itertools.chain(done_chains, chains.values()):
            due = min(due, self._settle_chain(state.path, chain, now, force, out))
        state.barriers = new_barriers
        state.entries = [e for e in state.entries if not e.dropped]
        return due

    def _shed(self, state: _PathState, now: float, out: list) -> None:
        """Report and forget the oldest finished writes of an overfull path."""
        excess = len(state.entries) - MAX_PATH_WRITES // 2
        for group in group_writes(state.entries):
            if excess <= 0:
                break
            finished = [e for e in group.entries if e.end_mono is not None][:excess]
            if len({e.writer.key for e in finished}) >= 2:
                out.append(self._collision(KIND_CONCURRENT, state.path, finished))
            self._drop(finished)
            excess -= len(finished)
        state.entries = [e for e in state.entries if not e.dropped]

    def _settle_chain(self, path: str, chain: _Chain, now: float, force: bool,
                      out: list) -> float:
        """Report or forget a chain when it is closed; return when to look at it again."""
        if len(chain.writers) == 1 and not force:
            # The same process saving again and again is normal: forget its old saves so a
            # long run does not grow without bound; the latest one can still start a chain.
            for group in chain.groups[:-1]:
                if now >= group.done_at + self._settle:
                    self._drop(group.entries)
        last = chain.last
        if (last.in_flight or chain.provisional) and not force:
            return _INF
        settled_at = max(g.done_at for g in chain.groups) + self._settle
        # Open until `window` after the last end, plus `settle` for a next start in transit.
        closed_at = settled_at if chain.closed else last.done_at + self._window + self._settle
        ready_at = max(settled_at, closed_at)
        if force or now >= ready_at:
            if len(chain.writers) >= 2:
                entries = [e for g in chain.groups for e in g.entries]
                out.append(self._collision(KIND_REDUNDANT, path, entries))
            for group in chain.groups:
                self._drop(group.entries)
            return _INF
        return ready_at

    def _group_settle(self, group: _Group) -> float:
        """settle, or job_settle when a writer belongs to a job that spans several nodes (its
        other nodes' writes may still be on their way through job scope)."""
        for entry in group.entries:
            w = entry.writer
            # A job whose ranks all run on this node (local world = world) has no other node
            # to hear from: it keeps the short settle.
            if (w.master is not None and (w.world_size or 0) > 1
                    and (w.local_world_size is None or w.local_world_size < w.world_size)):
                return self._job_settle
        return self._settle

    def _drop(self, entries) -> None:
        for entry in entries:
            if not entry.dropped and entry.source == SOURCE_JOB:
                self._remote_held -= 1
            entry.dropped = True

    def _collision(self, kind: str, path: str, entries: list) -> Collision:
        # Entries come in start order; one still in flight is named as known so far.
        writes = tuple(e.as_write() for e in entries)
        sources = tuple(sorted(set().union(*(e.seen_by for e in entries))))
        if any(e.source == SOURCE_JOB for e in entries):
            runs = {e.writer.run_key for e in entries}
            return Collision(path=path, kind=kind, writes=writes, scope=SCOPE_JOB,
                             sources=sources, detected_wall=self._wall_clock(),
                             id=job_collision_id(sorted(map(repr, runs)), path, writes))
        return Collision(path=path, kind=kind, writes=writes, scope=SCOPE_NODE,
                         sources=sources, detected_wall=self._wall_clock(),
                         id=collision_id(path, writes[0].start_wall))
