"""Grouping a path's writes into collisions: overlap groups, redundant chains, when each is final.

Definitions (design.md, "Definitions"):

- Two writes overlap when one starts while the other is in flight: a.start <= b.start < a.end
  for one of the two orders (an in-flight write has end = +inf, so it overlaps every later
  start; two writes starting at the same instant overlap unless both take no time).
  Overlap is decided on the monotonic times carried by the events, never on arrival order,
  because each process's sender delivers asynchronously.
- Concurrent collision: a maximal group of transitively overlapping writes on one path made by
  two or more different writers. It is final when every write in it has ended and `settle`
  seconds passed since the latest end, so a late-arriving start can still join it (`job_settle`
  instead when a writer belongs to a job that spans nodes: its other nodes' writes come later,
  through job scope). A write in flight holds it back for at most `max_hold` after that.
- Redundant write: on one path, writes of the same job run (Writer.run_key, not None) made one
  after another, each starting within `window` seconds of the previous one's end, by two or
  more different writers, with no concurrent collision in between. One maximal chain is one
  collision, final once the chain is closed: broken, or `window` + `settle` elapsed after its
  last end (the extra `settle` lets a next start still in transit extend it).

Memory: a finished write is dropped once nothing pending needs it -- `settle` after its end
when it cannot take part in a redundant chain (no job run, or the same process saving again),
otherwise when its chain closes; a reported concurrent collision leaves only a Barrier that
breaks chains for `max(window, settle)`. At most MAX_PATH_WRITES writes per path (a storm of
overlapping writes sheds its oldest finished writes as a collision), at most MAX_CHAIN_WRITES
writes per redundant chain.

Ids: job_collision_id for a collision holding other nodes' writes or a writer of a job with
ranks on other nodes (the same on every agent that sees it: another node's agent may hear of
a collision of this node's writers through job scope), collision_id for the rest.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import operator
from typing import Callable

from monitor.detect.model import KIND_CONCURRENT, KIND_REDUNDANT, SCOPE_JOB, SCOPE_NODE, \
    SOURCE_JOB, Collision
from monitor.detect.placement import place_remote_entries
from monitor.detect.tracked import INF, Entry, PathState

# A redundant chain that keeps growing (two processes alternating forever) would never close:
# report it once it holds this many writes and start a new chain.
MAX_CHAIN_WRITES = 256
# A path that keeps more writes than this (a storm of overlapping writes that never all end)
# sheds its oldest finished writes, reporting them, so memory and per-event work stay bounded.
MAX_PATH_WRITES = 1024
# How long, after `settle`, a write still in flight may hold back the report of a concurrent
# collision it belongs to (docs/decisions.md, "In-flight writes do not hide collisions").
DEFAULT_MAX_HOLD = 3.0


def overfull(state: PathState) -> bool:
    """Does the path hold more writes than MAX_PATH_WRITES (so it must be regrouped now)?"""
    return len(state.entries) > MAX_PATH_WRITES


def _sweep_key(entry: Entry) -> tuple:
    # Longest first among equal starts, so a sweep on "start < stop so far" sees exactly the
    # symmetric overlap relation.
    return (entry.start_mono, -entry.stop, entry.order)


class Group:
    """A maximal set of transitively overlapping writes on one path."""

    __slots__ = ("entries", "start", "stop", "writers", "in_flight", "done_at", "news",
                 "news_open", "news_done")

    def __init__(self, entry: Entry):
        self.entries = [entry]
        self.start = entry.start_mono
        self.stop = entry.stop
        self.writers = {entry.proc}
        done_at = entry.done_at
        self.in_flight = entry.end_mono is None
        self.done_at = done_at if done_at is not None else -INF
        # Writes not yet named in a collision: whether there are any, the latest arrival of
        # one still in flight, the earliest end of one finished (see Grouping.regroup).
        # _note_news(entry) on an empty group, spelled out: one group is built per write each
        # time its path is regrouped. max/min as there, so a NaN time gives the same values.
        if entry.reported:
            self.news, self.news_open, self.news_done = False, -INF, INF
        elif done_at is None:
            self.news, self.news_open, self.news_done = True, max(-INF, entry.seen_at), INF
        else:
            self.news, self.news_open, self.news_done = True, -INF, min(INF, done_at)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.stop = max(self.stop, entry.stop)
        self.writers.add(entry.proc)
        if entry.end_mono is None:
            self.in_flight = True
        else:
            self.done_at = max(self.done_at, entry.done_at)
        self._note_news(entry)

    def _note_news(self, entry: Entry) -> None:
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
            return INF
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
    path's list: PathState.insert). Without two equal starts that already is the sweep's
    order, and the sort, a Python key call per entry each time a path is regrouped, is
    skipped."""
    ordered = None
    if in_start_order:
        starts = [entry.start_mono for entry in entries]
        if not any(map(operator.eq, starts, starts[1:])):      # no two equal starts
            ordered = entries
    if ordered is None:
        ordered = sorted(entries, key=_sweep_key)
    groups: list[Group] = []
    current = None
    for entry in ordered:
        if current is not None and entry.start_mono < current.stop:
            current.add(entry)
        else:
            current = Group(entry)
            groups.append(current)
    return groups


class Barrier:
    """Where a reported concurrent collision was: it still breaks redundant chains."""

    __slots__ = ("start", "runs", "expire_at")

    def __init__(self, start: float, runs: set, expire_at: float):
        self.start, self.runs, self.expire_at = start, runs, expire_at


class Chain:
    """Solo groups of one job run on one path, each within the window of the previous."""

    __slots__ = ("groups", "writers", "closed", "provisional", "size")

    def __init__(self, group: Group):
        self.groups = [group]
        self.writers = set(group.writers)
        self.closed = False
        # Broken by a group that is still in flight: that write may yet end before the
        # group's other writes started, so the break is not final.
        self.provisional = False
        self.size = len(group.entries)

    def add(self, group: Group) -> None:
        self.groups.append(group)
        self.writers |= group.writers
        self.size += len(group.entries)

    @property
    def last(self) -> Group:
        return self.groups[-1]


def collision_id(path: str, first_start_wall: float) -> str:
    """Stable short id of a collision: the same path and first start give the same id."""
    digest = hashlib.sha1(f"{path}\0{first_start_wall!r}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def job_collision_id(run_key, path: str, writes) -> str:
    """Id of a job-scope collision: the job run, the path and the earliest write in it (its
    start wall, node, pid, seq: the values the writer's hook took and its job scope logged, so
    every agent holds the same numbers). Every agent that sees the collision derives the same
    id, even one that learnt of fewer of its later writes, so `ckptwatch report` over several
    nodes' journals counts it once."""
    # To the microsecond, as the hook's events carry it: an agent holding the start from the
    # hook (text "%.6f") and one holding it from the store's log (full precision) agree.
    first = min((float(f"{w.start_wall:.6f}"), w.writer.node, w.writer.pid, w.seq)
                for w in writes)
    text = f"{run_key!r}\0{path}\0{first[0]:.6f}\0{first[1:]!r}"
    return "j" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:15]


def _spans_nodes(w) -> bool:
    """Does writer `w` belong to a distributed job with ranks on other nodes? (A job whose
    ranks all run on this node, local world = world, has no other node to hear from.)"""
    return (w.master is not None and (w.world_size or 0) > 1
            and (w.local_world_size is None or w.local_world_size < w.world_size))


class Grouping:
    """Regroups one path at a time and reports what became final (see the module doc).

    remote_dropped counts the other nodes' writes (source "job") dropped so far: what remote
    anchoring holds is what it took in minus these."""

    def __init__(self, window: float, settle: float, job_settle: float, max_hold: float,
                 wall_clock: Callable[[], float]):
        self._window = window
        self._settle = settle
        self._job_settle = job_settle
        self._max_hold = max_hold
        # How long a reported collision still breaks redundant chains.
        self._linger = max(window, settle)
        self._wall_clock = wall_clock
        self.remote_dropped = 0

    def regroup(self, state: PathState, now: float, force: bool, out: list) -> float:
        """Recompute a path's groups and chains, report what is final, return the next due.

        force=True reports every pending group and chain regardless of time.
        """
        if not force:
            due = self._regroup_solo(state, now)
            if due is not None:
                return due
        settle, window, linger = self._settle, self._window, self._linger
        hold = settle + self._max_hold
        due = INF
        place_remote_entries(state)      # other nodes' writes decided on the walls
        groups = group_writes(state.entries, in_start_order=not state.nan_start)
        barriers = [] if force else state.barriers
        items = list(heapq.merge(groups, barriers, key=lambda item: item.start)) \
            if barriers else groups
        new_barriers: list[Barrier] = []
        chains: dict[tuple, Chain] = {}
        done_chains: list[Chain] = []

        def break_chains(runs, provisional=False):
            for run in runs:
                chain = chains.pop(run, None)
                if chain is not None:
                    chain.closed = True
                    chain.provisional = provisional
                    done_chains.append(chain)

        for item in items:
            if isinstance(item, Barrier):
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
                        if group.done_at > -INF and now < group.done_at + linger:
                            new_barriers.append(Barrier(group.start, runs,
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
                        new_barriers.append(Barrier(group.start, runs, expire_at))
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
                chains[run] = Chain(group)

        for chain in itertools.chain(done_chains, chains.values()):
            due = min(due, self._settle_chain(state.path, chain, now, force, out))
        state.barriers = new_barriers
        state.entries = [e for e in state.entries if not e.dropped]
        return due

    def _regroup_solo(self, state: PathState, now: float) -> float | None:
        """regroup() for the common path: every write on it by one Writer, one after another
        (none overlapping, none from job scope), at most the last still in flight, no
        barrier. Nothing there can be reported (one writer), so this only forgets what
        regroup() would forget and returns the same next due, without building a Group per
        write and a Chain per run: a rank saving its own file again and again is regrouped
        once per save (issue 22). None when the path is not such a case."""
        entries = state.entries
        if state.barriers or state.nan_start or not entries:
            return None
        writer = entries[0].writer
        prev = None
        for entry in entries:
            if entry.writer is not writer or entry.source == SOURCE_JOB:
                return None
            if prev is not None and (prev.end_mono is None or entry.start_mono < prev.stop
                                     or entry.start_mono <= prev.start_mono):
                return None
            prev = entry
        settle, window = self._settle, self._window
        due = INF
        if writer.run_key is None:
            # Without a job run a write can only still join a group through a late start.
            for entry in entries:
                if entry.end_mono is None:
                    continue
                if now >= entry.done_at + settle:
                    entry.dropped = True
                else:
                    due = min(due, entry.done_at + settle)
        else:
            # One chain per stretch of saves each within `window` of the previous (and at
            # most MAX_CHAIN_WRITES): a one-writer chain is never reported; its old saves
            # are forgotten after `settle`, all of it once it is closed and settled.
            chain: list = []
            for entry in entries:
                if chain and (entry.start_mono - chain[-1].stop > window
                              or len(chain) >= MAX_CHAIN_WRITES):
                    due = min(due, self._settle_solo_chain(chain, True, now))
                    chain = []
                chain.append(entry)
            due = min(due, self._settle_solo_chain(chain, False, now))
        state.entries = [e for e in entries if not e.dropped]
        return due

    def _settle_solo_chain(self, chain: list, closed: bool, now: float) -> float:
        """_settle_chain for a chain of one writer's writes (entries, not groups)."""
        settle = self._settle
        for entry in chain[:-1]:
            if now >= entry.done_at + settle:
                entry.dropped = True
        last = chain[-1]
        if last.end_mono is None:
            return INF
        settled_at = max(e.done_at for e in chain) + settle
        closed_at = settled_at if closed else \
            last.done_at + self._window + self._chain_settle(last.writer)
        ready_at = max(settled_at, closed_at)
        if now >= ready_at:
            for entry in chain:
                entry.dropped = True
            return INF
        return ready_at

    def shed(self, state: PathState, out: list) -> None:
        """Report and forget the oldest finished writes of an overfull path."""
        excess = len(state.entries) - MAX_PATH_WRITES // 2
        place_remote_entries(state)
        for group in group_writes(state.entries):
            if excess <= 0:
                break
            finished = [e for e in group.entries if e.end_mono is not None][:excess]
            if len({e.writer.key for e in finished}) >= 2:
                out.append(self._collision(KIND_CONCURRENT, state.path, finished))
            self._drop(finished)
            excess -= len(finished)
        state.entries = [e for e in state.entries if not e.dropped]

    def _settle_chain(self, path: str, chain: Chain, now: float, force: bool,
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
            return INF
        settled_at = max(g.done_at for g in chain.groups) + self._settle
        # Open until `window` after the last end, plus `settle` for a next start in transit.
        closed_at = settled_at if chain.closed else \
            last.done_at + self._window + self._chain_settle(last.entries[0].writer)
        ready_at = max(settled_at, closed_at)
        if force or now >= ready_at:
            if len(chain.writers) >= 2:
                entries = [e for g in chain.groups for e in g.entries]
                out.append(self._collision(KIND_REDUNDANT, path, entries))
            for group in chain.groups:
                self._drop(group.entries)
            return INF
        return ready_at

    def _group_settle(self, group: Group) -> float:
        """settle, or job_settle when a writer belongs to a job that spans several nodes (its
        other nodes' writes may still be on their way through job scope)."""
        for entry in group.entries:
            if _spans_nodes(entry.writer):
                return self._job_settle
        return self._settle

    def _chain_settle(self, writer) -> float:
        """How long after the window a redundant chain whose last writer is `writer` stays
        open: job_settle for a job spanning nodes, whose other nodes' later writes are heard
        of through job scope's reads -- the last one a window after a write's end for a path
        that names its writer's rank (ckptwatch/jobscope.py) -- else settle."""
        return self._job_settle if _spans_nodes(writer) else self._settle

    def _drop(self, entries) -> None:
        for entry in entries:
            if not entry.dropped and entry.source == SOURCE_JOB:
                self.remote_dropped += 1
            entry.dropped = True

    def _collision(self, kind: str, path: str, entries: list) -> Collision:
        # Entries come in start order; one still in flight is named as known so far.
        writes = tuple(e.as_write() for e in entries)
        sources = tuple(sorted(set().union(*(e.seen_by for e in entries))))
        job = any(e.source == SOURCE_JOB for e in entries)
        if job or any(_spans_nodes(e.writer) for e in entries):
            # A job with ranks on other nodes: their agents may hear of this collision
            # through job scope (as scope "job") and must give it the same id, so it takes
            # the job's id even when every writer in it is of this node.
            runs = {e.writer.run_key for e in entries}
            cid = job_collision_id(sorted(map(repr, runs)), path, writes)
        else:
            cid = collision_id(path, writes[0].start_wall)
        return Collision(path=path, kind=kind, writes=writes,
                         scope=SCOPE_JOB if job else SCOPE_NODE, sources=sources,
                         detected_wall=self._wall_clock(), id=cid)
