"""Write-collision detection: start/end events -> writes -> collisions. Pure logic.

No threads, sockets or clocks of its own: the agent's core loop owns one Detector, feeds it
validated events (observe, observe_remote), calls tick() a few times a second and flush() at
shutdown. Each call returns the values that became final, in order: a Write when a write
finished (exactly once per write) and a Collision when a collision became final (exactly once).

The Detector holds the path table and the due times and hands each event to the part whose
rules it concerns:
- monitor.detect.pairing (OpenWrites): starts paired with ends, writes in flight and their
  caps, lost writes, repeats;
- monitor.detect.grouping (Grouping): a path's writes grouped into concurrent collisions and
  redundant chains, when each is final, the collision ids;
- monitor.detect.remote (RemoteWrites): other nodes' writes, anchored on a local write.

Times: due times are compared with `clock()`; an ended write counts as done at
max(end_mono, clock at which its end was observed). The event's mono and the agent's
time.monotonic are the same node-wide CLOCK_MONOTONIC, and taking the later of the two keeps
`settle` a real grace period even when an end event itself arrives late.

Memory: at most max_paths paths are tracked (the least recently touched one is finalized and
evicted); per path and per write, see grouping and pairing.

Cost: observe() inserts a start into its path's list and, for an end, only schedules the path:
nothing can become final before `settle` passes, so tick() regroups a path (O(writes held on
it)) at most once per due time, popped from a heap, instead of once per event. tick() also
scans the in-flight writes, at most once per SCAN_INTERVAL.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from typing import Callable

from monitor.detect import grouping
from monitor.detect.grouping import DEFAULT_MAX_HOLD, Grouping
from monitor.detect.model import SOURCE_HOOK, SOURCE_JOB, writer_kind_of
from monitor.detect.pairing import MAX_OPEN_PER_PATH, SCAN_INTERVAL, OpenWrites
from monitor.detect.remote import RemoteWrites, remote_entry
from monitor.detect.tracked import INF, Entry, PathState

# Shedding keeps MAX_PATH_WRITES // 2 writes, which must leave room for every open one.
assert MAX_OPEN_PER_PATH < grouping.MAX_PATH_WRITES // 2


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
        self._settle = float(settle)
        # A concurrent group with a writer of a distributed job waits this long (at least)
        # before it is final: other nodes' writes of it arrive through the writers' job scope
        # (store round trips, polls), later than local ends.
        self._job_settle = max(float(job_settle), self._settle)
        self._max_paths = int(max_paths)
        self._clock = clock
        self._paths: OrderedDict[str, PathState] = OrderedDict()   # least recent first
        self._open = OpenWrites(self._paths, float(stale_after), pid_alive)
        self._grouping = Grouping(float(window), self._settle, self._job_settle,
                                  self._max_hold, wall_clock)
        self._remote = RemoteWrites()
        self._next_scan = -INF
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
        """Writes started and not yet ended (bounded by pairing.MAX_OPEN_TOTAL)."""
        return len(self._open)

    def is_open(self, node: str, pid: int, seq: int) -> bool:
        """Is that write in flight here (its start seen, its end not yet)?"""
        return (node, pid, seq) in self._open

    def local_writers(self, path: str) -> list:
        """The Writers of this node whose writes of `path` are held here now (a write is held
        while it can still join a collision: through a redundant chain, up to a window after
        its end for a writer of a job run)."""
        state = self._paths.get(path)
        if state is None:
            return []
        return [e.writer for e in state.entries if e.source != SOURCE_JOB]

    @property
    def refused_starts(self) -> dict:
        """Starts refused at an open-write cap, by reason (REFUSE_REASONS)."""
        return dict(self._open.refused)

    @property
    def repeated(self) -> int:
        """Starts and ends ignored as repeats of a finished write."""
        return self._open.repeated

    @property
    def remote_rejected(self) -> dict:
        """Remote events refused, by reason (REMOTE_REJECT_REASONS)."""
        return self._remote.rejected

    def active_writes(self) -> dict:
        """In-flight writes per job label ("" for an unknown job)."""
        return dict(self._open.active)

    def observe(self, event: dict) -> list:
        """Ingest one validated event; return the Writes and Collisions it made final."""
        kind = event.get("type")
        if kind not in ("start", "end"):
            return []
        now = self._clock()
        out: list = []
        key = (event["node"], event["pid"], event["seq"])
        self._open.heard_from(key[:2], event)
        if kind == "start":
            self._start(key, event, now, out)
        else:
            self._end(key, event, now, out)
        return out

    def observe_remote(self, event: dict) -> list:
        """A validated "remote" event: another node's write of a path, reported by the local
        process (event node, pid) whose own write `seq` of that path this agent tracks
        (bounded and deduplicated: monitor.detect.remote). Returns the Collisions it made
        final (normally none: the path is regrouped at its due time)."""
        path = event["path"]
        state = self._paths.get(path)
        held = self._remote.admitted - self._grouping.remote_dropped
        if not self._remote.admit(event, state, held):
            return []
        now = self._clock()
        entry = remote_entry(event, self._open.writer(event["writer"]), next(self._order),
                             now)
        state.insert(entry)
        self._paths.move_to_end(path)
        self._schedule(state, entry.done_at + self._job_settle)
        return []

    def hung_up(self, node: str, pid: int, mono: float, wall: float) -> None:
        """The connection of process (node, pid) was closed by the process's side at `mono` /
        `wall` (the agent's clocks when it read the end of the stream). The kernel closes a
        process's sockets when it dies, so a process killed while it writes was alive until
        about then: the latest time known for its writes in flight, and where they end if
        they are closed as lost. Without it a killed writer's write ended where its last event
        was -- its own start -- and every save that began and ended inside the real interval
        was called a redundant write instead of a collision (tests/support/groundtruth)."""
        self._open.heard_from((node, pid), {"mono": mono, "wall": wall})

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
        dirty: dict[str, PathState] = {}
        if now >= self._next_scan:
            self._next_scan = now + SCAN_INTERVAL
            for entry in self._open.scan(now, out):
                dirty[entry.path] = self._paths[entry.path]
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

    def _start(self, key: tuple, event: dict, now: float, out: list) -> None:
        if not self._open.admit_start(key, event):
            return
        state = self._state_for(event["path"], now, out)
        entry = Entry(self._open.writer(event), event["path"], event["seq"], event["wall"],
                      event["mono"], event.get("site"), event.get("func"), next(self._order),
                      max(event["mono"], now), event.get("source", SOURCE_HOOK))
        if "writer" in event:
            entry.writer_kind = writer_kind_of(event)
        state.insert(entry)
        if grouping.overfull(state):
            self._update(state, now, out)
        self._open.opened(key, entry, state)
        # No regrouping here: a start only adds an in-flight write, which delays finality;
        # the next end recomputes the path, or at the latest the time this write may hold
        # back a collision it is part of (max_hold).
        self._schedule(state, entry.seen_at + self._settle + self._max_hold)

    def _end(self, key: tuple, event: dict, now: float, out: list) -> None:
        if not self._open.admit_end(key, event):
            return
        entry = self._open.get(key)
        if entry is None:
            # The start was not sent (a short save), dropped, or seen before an eviction:
            # the end stands alone.
            state = self._state_for(event["path"], now, out)
            entry = Entry(self._open.writer(event), event["path"], event["seq"],
                          event["start_wall"], event["start_mono"], event.get("site"),
                          event.get("func"), next(self._order), now,
                          event.get("source", SOURCE_HOOK))
            if "writer" in event:
                entry.writer_kind = writer_kind_of(event)
            state.insert(entry)
        else:
            self._open.closed(entry)
            state = self._paths[entry.path]
            self._paths.move_to_end(entry.path)
            if entry.site is None:
                entry.site, entry.func = event.get("site"), event.get("func")
        out.append(entry.finish(event["wall"], event["mono"], event.get("bytes"),
                                event["outcome"], now))
        if self._settle > 0 and not grouping.overfull(state):
            # Nothing this end completes can be final before `settle` has passed, so the
            # path is regrouped then, once for all the ends of that interval.
            self._schedule(state, entry.done_at + self._settle)
        else:
            self._update(state, now, out)

    # ------------------------------------------------------------------ paths

    def _state_for(self, path: str, now: float, out: list) -> PathState:
        state = self._paths.get(path)
        if state is not None:
            self._paths.move_to_end(path)
            return state
        while len(self._paths) >= self._max_paths:
            _, oldest = self._paths.popitem(last=False)
            self._finalize_path(oldest, now, out)
            self._evicted += 1
        state = PathState(path)
        self._paths[path] = state
        return state

    def _finalize_path(self, state: PathState, now: float, out: list) -> None:
        """Report everything a path holds now (eviction, flush); the caller drops it."""
        for entry in list(state.entries):
            if entry.end_mono is None:
                out.append(self._open.close_lost(entry, now))
        self._grouping.regroup(state, now, True, out)

    def _update(self, state: PathState, now: float, out: list) -> None:
        due = self._grouping.regroup(state, now, False, out)
        if grouping.overfull(state):
            self._grouping.shed(state, out)
        if not state.entries and not state.barriers:
            self._paths.pop(state.path, None)
            return
        self._schedule(state, due)

    def _schedule(self, state: PathState, due: float) -> None:
        """Make tick() regroup the path at `due` (keeping an earlier time already set)."""
        if due < INF and (state.due is None or due < state.due):
            state.due = due
            heapq.heappush(self._due_heap, (due, next(self._order), state.path))
