"""Pairing starts with ends: the writes in flight, their caps, lost writes and repeats.

- A write is one writer's (node, pid) interval on one path. Start and end events are paired by
  (node, pid, seq). An end without a seen start stands alone (it carries start_wall /
  start_mono). A start that never ends is closed with outcome "lost" at the last time known for
  its process, when pid_alive says the process is gone (two checks in a row, so an end event
  still queued in the agent is not pre-empted) or after stale_after.
- A hook sends again what the agent had not acknowledged when a connection ended
  (ckptwatch/emitter.py): a start or end seen before is a repeat, never a second write.
- At most MAX_OPEN_PER_WRITER, MAX_OPEN_PER_PATH and MAX_OPEN_TOTAL writes in flight: a start
  beyond a cap is refused and counted (REFUSE_REASONS), and its end, if it comes, still reports
  the write standing alone. The caps bound the memory and the work a process can cause by
  starting writes it never ends.

OpenWrites keeps this bookkeeping; the Detector (monitor.detect.detector) asks it what to do
with each event and tells it what it did.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping

from monitor.detect.model import OUTCOME_LOST, REFUSE_REASONS, Write, Writer, writer_key
from monitor.detect.tracked import INF, Entry, PathState

# How often the in-flight writes are looked at for dead processes and stale starts.
SCAN_INTERVAL = 1.0
# Keys of writes closed as "lost": their real end, if it still arrives, must not count twice.
_LOST_KEYS_CAP = 65536
# Writes finished lately, by key and start time: a start or end seen before can arrive again
# within seconds (a resend); the start time tells a repeat from a new process that got a
# recycled pid. ~150 bytes each.
_DONE_KEYS_CAP = 16384
# Open (started, not ended) writes held at once: per writer, per path, in all. A real process
# has one or a few saves in flight.
MAX_OPEN_PER_WRITER = 64
MAX_OPEN_PER_PATH = 256
MAX_OPEN_TOTAL = 16384
_MAX_CACHED_WRITERS = 4096     # a job has a few writers; a flood of distinct identities only
                               # rebuilds Writers (65,536 held ~12 MB: the soak, issue 8)


class _Proc:
    """A process with writes in flight: their keys, and the latest time it was heard from
    (the "last time known" its writes end at if they are closed as lost)."""

    __slots__ = ("keys", "last_mono", "last_wall")

    def __init__(self):
        self.keys: set = set()
        self.last_mono = -INF
        self.last_wall = None


class OpenWrites:
    """The writes in flight, by key (node, pid, seq), and what was seen of finished ones.

    `paths` is the detector's path table, read to keep each PathState's count of open
    entries (a path evicted while it is finalized is no longer in it)."""

    def __init__(self, paths: Mapping[str, PathState], stale_after: float,
                 pid_alive: Callable[[str, int], bool] | None):
        self._paths = paths
        self._stale_after = stale_after
        self._pid_alive = pid_alive
        self._open: dict[tuple, Entry] = {}
        self._open_by_proc: dict[tuple, _Proc] = {}
        self.refused = {reason: 0 for reason in REFUSE_REASONS}
        self._writers: dict[tuple, Writer] = {}
        self.active: dict[str, int] = {}     # in-flight writes per job label
        self._lost_keys: OrderedDict[tuple, None] = OrderedDict()
        self._done_keys: OrderedDict[tuple, None] = OrderedDict()
        self.repeated = 0       # starts and ends ignored as repeats of a finished write
        self._suspects: set = set()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, key: tuple) -> bool:
        return key in self._open

    def get(self, key: tuple) -> Entry | None:
        return self._open.get(key)

    def writer(self, event: dict) -> Writer:
        """The event's Writer. One per distinct identity: a process saves many times, and
        building a frozen dataclass per event is a measurable share of the agent's per-event
        cost."""
        key = writer_key(event)
        writer = self._writers.get(key)
        if writer is None:
            if len(self._writers) >= _MAX_CACHED_WRITERS:
                self._writers.clear()
            writer = self._writers[key] = Writer(*key)
        return writer

    def heard_from(self, proc: tuple, event: dict) -> None:
        """Any event of a process tells us it was alive then: the "last time known" for its
        other in-flight writes if they are ever closed as lost. O(1): one record per process,
        not one update per open write."""
        record = self._open_by_proc.get(proc)
        if record is not None and event["mono"] > record.last_mono:
            record.last_mono, record.last_wall = event["mono"], event["wall"]

    def admit_start(self, key: tuple, event: dict) -> bool:
        """Is this start a new write to track? False for a duplicate, a repeat (counted) and a
        start beyond a cap (counted by reason)."""
        if key in self._open or key in self._lost_keys:
            return False   # a duplicate start, or one whose write was already closed as lost
        if key + (event["mono"],) in self._done_keys:
            self.repeated += 1
            return False
        reason = self._over_open_cap(key[:2], event["path"])
        if reason is not None:
            self.refused[reason] += 1
            return False
        return True

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

    def opened(self, key: tuple, entry: Entry, state: PathState) -> None:
        """The start `key` is tracked as `entry` on `state`."""
        self._open[key] = entry
        record = self._open_by_proc.get(key[:2])
        if record is None:
            record = self._open_by_proc[key[:2]] = _Proc()
        record.keys.add(key)
        state.open += 1
        label = entry.writer.job_label
        self.active[label] = self.active.get(label, 0) + 1

    def admit_end(self, key: tuple, event: dict) -> bool:
        """Does this end finish a write? False for the real end of a write already closed as
        lost and for a repeat (counted)."""
        if key in self._lost_keys:
            del self._lost_keys[key]   # already returned as lost: never count it twice
            return False
        done = key + (event["start_mono"],)
        if done in self._done_keys:
            self.repeated += 1
            return False
        self._done_keys[done] = None
        if len(self._done_keys) > _DONE_KEYS_CAP:
            self._done_keys.popitem(last=False)
        return True

    def closed(self, entry: Entry) -> None:
        """The open write `entry` ended (or is closed as lost): forget it as in flight."""
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
        count = self.active[label] - 1
        if count:
            self.active[label] = count
        else:
            del self.active[label]

    def close_lost(self, entry: Entry, now: float) -> Write:
        """End an open write that will never end: at the last time its process was heard from."""
        record = self._open_by_proc[entry.key[:2]]
        if record.last_mono > entry.start_mono:
            end_mono, end_wall = record.last_mono, record.last_wall
        else:
            end_mono, end_wall = entry.start_mono, entry.start_wall
        self.closed(entry)
        self._lost_keys[entry.key] = None
        if len(self._lost_keys) > _LOST_KEYS_CAP:
            self._lost_keys.popitem(last=False)
        return entry.finish(end_wall, end_mono, None, OUTCOME_LOST, now)

    def scan(self, now: float, out: list) -> list[Entry]:
        """Close the writes of dead processes and stale starts as lost (their Writes to out);
        return the entries closed."""
        closed = []
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
                    out.append(self.close_lost(entry, now))
                    closed.append(entry)
        self._suspects = suspects
        return closed
