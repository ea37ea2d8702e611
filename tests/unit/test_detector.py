"""Detector: writes, concurrent collisions, redundant writes, lost writes, bounds.

Everything runs on a fake clock; event mono times are on the same clock, as on a real node.
"""
import itertools
import random

import pytest

from monitor.detect.detector import Detector
from monitor.detect.grouping import MAX_CHAIN_WRITES, collision_id
from monitor.detect.model import OUTCOME_LOST
from monitor.detect.model import KIND_CONCURRENT, KIND_REDUNDANT, Collision, Write

WALL0 = 1_700_000_000.0
PATH = "/ckpt/last.pt"


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now

    def wall(self):
        return WALL0 + self.now


def start(pid, seq, mono, path=PATH, node="n1", rank=None, job="j1", restart=0, master=None,
          site="train.py:42", func="save_checkpoint"):
    return {"v": 1, "type": "start", "node": node, "pid": pid, "seq": seq, "path": path,
            "wall": WALL0 + mono, "mono": mono, "rank": rank, "job": job, "restart": restart,
            "master": master, "site": site, "func": func}


def end(pid, seq, mono, start_mono, path=PATH, node="n1", rank=None, job="j1", restart=0,
        master=None, nbytes=100, outcome="ok", site="train.py:42", func="save_checkpoint"):
    ev = start(pid, seq, mono, path, node, rank, job, restart, master, site, func)
    ev.update(type="end", start_wall=WALL0 + start_mono, start_mono=start_mono, bytes=nbytes,
              outcome=outcome)
    return ev


def make(clock, **kw):
    return Detector(clock=clock, wall_clock=clock.wall, **kw)


def feed(det, clock, timed_events):
    """Observe (time, event) pairs at their time -- a "remote" event through observe_remote
    -- and tick at every step. Returns all outputs."""
    out = []
    for at, ev in timed_events:
        clock.now = at
        out += det.observe_remote(ev) if ev["type"] == "remote" else det.observe(ev)
        out += det.tick()
    return out


def collisions(items, kind=None):
    return [c for c in items if isinstance(c, Collision) and (kind is None or c.kind == kind)]


def writes(items):
    return [w for w in items if isinstance(w, Write)]


def advance(det, clock, to):
    clock.now = to
    return det.tick()


def test_four_ranks_overlapping_make_one_collision():
    clock = FakeClock(1000.0)
    det = make(clock)
    evs = [(1000.0 + r * 0.1, start(10 + r, 1, 1000.0 + r * 0.1, rank=r)) for r in range(4)]
    evs += [(1001.0 + r * 0.2, end(10 + r, 1, 1001.0 + r * 0.2, 1000.0 + r * 0.1, rank=r))
            for r in range(4)]
    out = feed(det, clock, evs)
    assert len(writes(out)) == 4 and all(w.finished for w in writes(out))
    assert collisions(out) == []            # not final before `settle`
    out = advance(det, clock, 1001.6 + 1.0)
    [c] = collisions(out)
    assert c.kind == KIND_CONCURRENT and c.path == PATH and c.scope == "node"
    assert [w.writer.rank for w in c.writes] == [0, 1, 2, 3]
    assert c.first.writer.rank == 0 and c.last.writer.rank == 3
    assert c.id == collision_id(PATH, WALL0 + 1000.0)
    assert c.detected_wall == clock.wall()
    assert c.sources == ("hook",)
    assert advance(det, clock, 5000.0) == [] and det.flush() == []


def test_end_before_other_start_still_collides_when_intervals_overlap():
    clock = FakeClock(10.0)
    det = make(clock)
    # A's end arrives before B's start although B started (mono 10.5) while A was writing.
    out = feed(det, clock, [(10.0, start(1, 1, 10.0, rank=0)),
                            (11.0, end(1, 1, 11.0, 10.0, rank=0)),
                            (11.2, start(2, 1, 10.5, rank=1)),
                            (11.3, end(2, 1, 11.3, 10.5, rank=1))])
    out += advance(det, clock, 20.0)
    [c] = collisions(out)
    assert [w.writer.pid for w in c.writes] == [1, 2]


def test_sequential_writes_of_different_runs_are_normal():
    clock = FakeClock(0.0)
    det = make(clock)
    out = feed(det, clock, [
        (0.0, start(1, 1, 0.0, restart=0)), (1.0, end(1, 1, 1.0, 0.0, restart=0)),
        (2.0, start(2, 1, 2.0, restart=1)), (3.0, end(2, 1, 3.0, 2.0, restart=1)),
        (4.0, start(3, 1, 4.0, job="other")), (5.0, end(3, 1, 5.0, 4.0, job="other")),
        (6.0, start(4, 1, 6.0, job="none", master="h:1")),
        (7.0, end(4, 1, 7.0, 6.0, job="none", master="h:1")),
        (8.0, start(5, 1, 8.0, job="none", master="h:2")),
        (9.0, end(5, 1, 9.0, 8.0, job="none", master="h:2")),
        (10.0, start(6, 1, 10.0, job=None)), (11.0, end(6, 1, 11.0, 10.0, job=None)),
        (12.0, start(7, 1, 12.0, job=None)), (13.0, end(7, 1, 13.0, 12.0, job=None)),
    ])
    out += advance(det, clock, 500.0) + det.flush()
    assert collisions(out) == []
    assert len(writes(out)) == 7


def test_same_run_different_pids_within_window_is_one_redundant_collision():
    clock = FakeClock(0.0)
    det = make(clock, window=60.0)
    out = feed(det, clock, [
        (0.0, start(1, 1, 0.0, rank=0)), (1.0, end(1, 1, 1.0, 0.0, rank=0)),
        (30.0, start(2, 1, 30.0, rank=1)), (31.0, end(2, 1, 31.0, 30.0, rank=1)),
        (80.0, start(3, 1, 80.0, rank=2)), (81.0, end(3, 1, 81.0, 80.0, rank=2)),
    ])
    assert collisions(out) == []            # the chain is still open
    # closed `window` + `settle` after the last end (81 + 60 + 1)
    assert collisions(advance(det, clock, 141.5)) == []
    [c] = collisions(advance(det, clock, 142.5))
    assert c.kind == KIND_REDUNDANT
    assert [w.writer.rank for w in c.writes] == [0, 1, 2]
    assert det.flush() == []


def test_same_run_outside_window_is_nothing():
    clock = FakeClock(0.0)
    det = make(clock, window=10.0)
    out = feed(det, clock, [
        (0.0, start(1, 1, 0.0)), (1.0, end(1, 1, 1.0, 0.0)),
        (11.5, start(2, 1, 11.5)), (12.0, end(2, 1, 12.0, 11.5)),
    ])
    out += advance(det, clock, 100.0) + det.flush()
    assert collisions(out) == []


def test_same_pid_repeated_or_overlapping_itself_is_nothing():
    clock = FakeClock(0.0)
    det = make(clock)
    evs = []
    for i in range(5):
        evs += [(i * 2.0, start(1, i, i * 2.0)), (i * 2.0 + 1, end(1, i, i * 2.0 + 1, i * 2.0))]
    # two threads of pid 2 overlapping on another path
    evs += [(20.0, start(2, 1, 20.0, path="/x")), (20.1, start(2, 2, 20.1, path="/x")),
            (21.0, end(2, 1, 21.0, 20.0, path="/x")), (21.5, end(2, 2, 21.5, 20.1, path="/x"))]
    out = feed(det, clock, evs)
    out += advance(det, clock, 1000.0) + det.flush()
    assert collisions(out) == []
    assert len(writes(out)) == 7
    assert det.tracked_paths == 0


def test_a_bridging_write_merges_two_groups():
    clock = FakeClock(0.0)
    det = make(clock, settle=5.0)
    evs = [(0.0, start(1, 1, 0.0)), (0.1, start(2, 1, 0.1)),
           (1.0, end(1, 1, 1.0, 0.0)), (1.1, end(2, 1, 1.1, 0.1)),
           (2.0, start(3, 1, 2.0)), (2.1, start(4, 1, 2.1)),
           (3.0, end(3, 1, 3.0, 2.0)), (3.1, end(4, 1, 3.1, 2.1)),
           # pid 5 started at 0.5 and ended at 2.5: it overlaps both pairs
           (3.5, start(5, 1, 0.5)), (3.6, end(5, 1, 2.5, 0.5))]
    out = feed(det, clock, evs)
    out += advance(det, clock, 100.0)
    [c] = collisions(out)
    assert [w.writer.pid for w in c.writes] == [1, 2, 5, 3, 4]


def test_two_separate_groups_without_bridge():
    clock = FakeClock(0.0)
    det = make(clock, settle=5.0)
    evs = [(0.0, start(1, 1, 0.0, job=None)), (0.1, start(2, 1, 0.1, job=None)),
           (1.0, end(1, 1, 1.0, 0.0, job=None)), (1.1, end(2, 1, 1.1, 0.1, job=None)),
           (2.0, start(3, 1, 2.0, job=None)), (2.1, start(4, 1, 2.1, job=None)),
           (3.0, end(3, 1, 3.0, 2.0, job=None)), (3.1, end(4, 1, 3.1, 2.1, job=None))]
    out = feed(det, clock, evs) + advance(det, clock, 100.0)
    assert [[w.writer.pid for w in c.writes] for c in collisions(out)] == [[1, 2], [3, 4]]


def test_late_start_within_settle_joins_the_group():
    clock = FakeClock(0.0)
    det = make(clock, settle=1.0)
    out = feed(det, clock, [(0.0, start(1, 1, 0.0)), (0.1, start(2, 1, 0.1)),
                            (1.0, end(1, 1, 1.0, 0.0)), (1.1, end(2, 1, 1.1, 0.1)),
                            (1.9, start(3, 1, 0.9))])      # started at 0.9, arrives at 1.9
    assert collisions(out) == []
    # pid 3 is still in flight: it holds the group back (for at most settle + max_hold)
    assert collisions(advance(det, clock, 4.5)) == []
    out = feed(det, clock, [(4.6, end(3, 1, 4.6, 0.9))])
    out += advance(det, clock, 6.5)
    [c] = collisions(out)
    assert sorted(w.writer.pid for w in c.writes) == [1, 2, 3]
    assert c.last.writer.pid == 3


def test_end_without_start_stands_alone_and_collides():
    clock = FakeClock(0.0)
    det = make(clock)
    out = feed(det, clock, [(1.0, end(1, 1, 1.0, 0.0)), (1.2, end(2, 1, 1.2, 0.5))])
    assert [w.start_mono for w in writes(out)] == [0.0, 0.5]
    [c] = collisions(out + advance(det, clock, 10.0))
    assert len(c.writes) == 2


def test_dead_process_write_is_lost_and_still_collides():
    clock = FakeClock(0.0)
    alive = {1: True, 2: True}
    det = make(clock, pid_alive=lambda node, pid: alive[pid])
    out = feed(det, clock, [(0.0, start(1, 1, 0.0)), (0.1, start(2, 1, 0.1)),
                            (0.5, start(2, 2, 0.5, path="/other")),
                            (1.0, end(1, 1, 1.0, 0.0))])
    assert det.active_writes() == {"j1": 2}
    alive[2] = False
    out += advance(det, clock, 2.0)          # first sighting: only a suspect
    assert det.active_writes() == {"j1": 2}
    out += advance(det, clock, 3.0)
    lost = [w for w in writes(out) if w.outcome == OUTCOME_LOST]
    assert sorted(w.seq for w in lost) == [1, 2]
    # "last time known": pid 2's latest event was its start on /other at 0.5
    assert {w.end_mono for w in lost} == {0.5}
    assert det.active_writes() == {}
    out += advance(det, clock, 10.0)
    [c] = collisions(out)
    assert [w.writer.pid for w in c.writes] == [1, 2]
    # its real end arriving late is not a second write
    assert det.observe(end(2, 1, 11.0, 0.1)) == []


def test_a_writer_killed_mid_save_is_lost_at_its_hang_up_and_collides_with_saves_inside():
    """Found by the ground-truth checker: pid 1 starts a long save, pid 2 saves wholly inside
    it, then pid 1 is SIGKILLed. Its last event was its start, so its lost write ended there
    (duration 0) and the two were called redundant. The kernel closed its connection when it
    died: the hang-up is the last time it is known alive, and its write ends there."""
    clock = FakeClock(0.0)
    alive = {1: True, 2: True}
    det = make(clock, settle=0.3, pid_alive=lambda node, pid: alive[pid])
    out = feed(det, clock, [(0.0, start(1, 1, 0.0)), (0.2, start(2, 1, 0.2)),
                            (0.3, end(2, 1, 0.3, 0.2))])
    clock.now = 0.5
    det.hung_up("n1", 1, 0.5, WALL0 + 0.5)
    alive[1] = False
    for at in (1.5, 2.5, 3.5, 10.0):
        out += advance(det, clock, at)
    [lost] = [w for w in writes(out) if w.outcome == OUTCOME_LOST]
    assert (lost.writer.pid, lost.end_mono, lost.end_wall) == (1, 0.5, WALL0 + 0.5)
    [c] = collisions(out)
    assert c.kind == KIND_CONCURRENT
    assert {w.writer.pid: w.outcome for w in c.writes} == {1: OUTCOME_LOST, 2: "ok"}


def test_a_hang_up_of_a_process_without_writes_in_flight_changes_nothing():
    clock = FakeClock(0.0)
    det = make(clock, settle=0.3, pid_alive=lambda node, pid: False)
    out = feed(det, clock, [(0.0, start(1, 1, 0.0)), (0.1, end(1, 1, 0.1, 0.0))])
    det.hung_up("n1", 1, 0.5, WALL0 + 0.5)
    det.hung_up("n1", 99, 0.5, WALL0 + 0.5)
    out += advance(det, clock, 5.0)
    assert [(w.writer.pid, w.end_mono, w.outcome) for w in writes(out)] == [(1, 0.1, "ok")]
    assert collisions(out) == [] and det.open_writes == 0


def test_stale_write_is_lost_after_stale_after():
    clock = FakeClock(0.0)
    det = make(clock, stale_after=100.0)
    det.observe(start(1, 1, 0.0))
    assert det.tick() == []
    assert advance(det, clock, 50.0) == []
    out = advance(det, clock, 101.0)
    [w] = writes(out)
    assert w.outcome == OUTCOME_LOST and w.end_mono == 0.0
    assert det.active_writes() == {}


def test_pid_alive_errors_do_not_lose_writes():
    clock = FakeClock(0.0)

    def broken(node, pid):
        raise OSError("probe failed")
    det = make(clock, pid_alive=broken)
    det.observe(start(1, 1, 0.0))
    assert advance(det, clock, 5.0) == [] and advance(det, clock, 10.0) == []
    assert det.active_writes() == {"j1": 1}


def test_eviction_bounds_paths_and_finalizes_what_they_hold():
    clock = FakeClock(0.0)
    det = make(clock, max_paths=3)
    out = feed(det, clock, [(0.0, start(1, 1, 0.0, path="/a")), (0.1, start(2, 1, 0.1, path="/a")),
                            (1.0, end(1, 1, 1.0, 0.0, path="/a")),
                            (1.1, end(2, 1, 1.1, 0.1, path="/a"))])
    for i, p in enumerate(["/b", "/c", "/d", "/e"]):
        out += feed(det, clock, [(1.2 + i * 0.01, start(3, i, 1.2, path=p))])
        assert det.tracked_paths <= 3
    assert det.evicted_paths_total == 2
    [c] = collisions(out)                  # /a's pending collision was reported on eviction
    assert c.path == "/a"
    lost = [w for w in writes(out) if w.outcome == OUTCOME_LOST]
    assert [w.path for w in lost] == ["/b"]
    assert det.observe(end(3, 0, 2.0, 1.2, path="/b")) == []   # already counted as lost


def test_no_write_or_collision_is_returned_twice_and_flush_finalizes():
    clock = FakeClock(0.0)
    det = make(clock)
    evs = [(0.0, start(1, 1, 0.0)), (0.1, start(2, 1, 0.1)), (1.0, end(1, 1, 1.0, 0.0)),
           (1.05, start(3, 1, 1.05, path="/p2")), (1.1, end(2, 1, 1.1, 0.1)),
           (1.2, start(4, 1, 1.2, path="/p2"))]
    out = feed(det, clock, evs)
    out += det.tick() + det.tick()
    out += det.flush()
    assert det.flush() == [] and det.tick() == []
    ws = writes(out)
    assert len(ws) == 4 and len({(w.writer.pid, w.seq) for w in ws}) == 4
    assert {w.outcome for w in ws if w.path == "/p2"} == {OUTCOME_LOST}
    assert sorted(c.path for c in collisions(out)) == ["/ckpt/last.pt", "/p2"]
    assert det.tracked_paths == 0 and det.active_writes() == {}


def test_flush_reports_an_open_redundant_chain():
    clock = FakeClock(0.0)
    det = make(clock)
    out = feed(det, clock, [(0.0, start(1, 1, 0.0)), (1.0, end(1, 1, 1.0, 0.0)),
                            (2.0, start(2, 1, 2.0)), (3.0, end(2, 1, 3.0, 2.0))])
    assert collisions(out) == []
    [c] = collisions(det.flush())
    assert c.kind == KIND_REDUNDANT


def test_active_writes_per_job():
    clock = FakeClock(0.0)
    det = make(clock)
    det.observe(start(1, 1, 0.0, job="a"))
    det.observe(start(2, 1, 0.0, job="a", path="/x"))
    det.observe(start(3, 1, 0.0, job=None, path="/y"))
    assert det.active_writes() == {"a": 2, "": 1}
    det.observe(end(1, 1, 1.0, 0.0, job="a"))
    assert det.active_writes() == {"a": 1, "": 1}


def test_non_write_events_are_ignored():
    det = make(FakeClock(0.0))
    assert det.observe({"v": 1, "type": "dropped", "node": "n", "pid": 1, "count": 3}) == []
    assert det.tracked_paths == 0


def test_memory_is_bounded_for_a_long_single_writer_run():
    clock = FakeClock(0.0)
    det = make(clock, window=10.0)
    for i in range(200):
        t = i * 5.0
        feed(det, clock, [(t, start(1, i, t)), (t + 1, end(1, i, t + 1, t))])
    state = next(iter(det._paths.values()))
    assert len(state.entries) <= 4


def test_alternating_writers_are_reported_in_bounded_chains():
    clock = FakeClock(0.0)
    det = make(clock, window=10.0)
    out = []
    n = MAX_CHAIN_WRITES + 10
    for i in range(n):
        t = i * 2.0
        out += feed(det, clock, [(t, start(1 + i % 2, i, t)), (t + 1, end(1 + i % 2, i, t + 1, t))])
    out += det.flush()
    reds = collisions(out, KIND_REDUNDANT)
    assert len(reds) == 2 and sum(len(c.writes) for c in reds) == n


def test_concurrent_collision_breaks_a_redundant_chain():
    clock = FakeClock(0.0)
    det = make(clock, window=60.0)
    out = feed(det, clock, [
        (0.0, start(1, 1, 0.0)), (1.0, end(1, 1, 1.0, 0.0)),
        (2.0, start(2, 1, 2.0)), (2.1, start(3, 1, 2.1)),
        (3.0, end(2, 1, 3.0, 2.0)), (3.1, end(3, 1, 3.1, 2.1)),
        (10.0, start(4, 1, 10.0)), (11.0, end(4, 1, 11.0, 10.0))])
    out += advance(det, clock, 200.0) + det.flush()
    assert [c.kind for c in collisions(out)] == [KIND_CONCURRENT]


# ---------------------------------------------------------------- randomized reference check

def _reference(ws, window):
    """Brute force: pairwise overlap graph, components, then chains per run.

    ws: list of dicts with pid, seq, start, end, run (start order = (start, idx)).
    Returns (set of concurrent groups as frozensets of (pid, seq), list of redundant chains
    as {(pid, seq): start}).
    """
    n = len(ws)
    order = sorted(range(n), key=lambda i: (ws[i]["start"], i))
    rank = {i: k for k, i in enumerate(order)}
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def starts_during(x, y):
        return ws[y]["start"] <= ws[x]["start"] < ws[y]["end"]

    for a, b in itertools.combinations(range(n), 2):
        if starts_during(a, b) or starts_during(b, a):
            parent[find(a)] = find(b)
    comps = {}
    for i in order:
        comps.setdefault(find(i), []).append(i)
    comps = sorted(comps.values(), key=lambda c: rank[c[0]])
    concurrent = set()
    chains, current = [], {}
    for comp in comps:
        pids = {ws[i]["pid"] for i in comp}
        runs = {ws[i]["run"] for i in comp} - {None}
        if len(pids) >= 2:
            concurrent.add(frozenset((ws[i]["pid"], ws[i]["seq"]) for i in comp))
            for r in runs:
                if r in current:
                    chains.append(current.pop(r))
            continue
        run = ws[comp[0]]["run"]
        if run is None:
            continue
        stop = max(max(ws[i]["end"], ws[i]["start"]) for i in comp)
        start_ = ws[comp[0]]["start"]
        chain = current.get(run)
        if chain is not None and start_ - chain["stop"] <= window:
            chain["items"] += comp
            chain["stop"] = stop
        else:
            if chain is not None:
                chains.append(chain)
            current[run] = {"items": list(comp), "stop": stop}
    chains += current.values()
    redundant = []
    for chain in chains:
        if len({ws[i]["pid"] for i in chain["items"]}) >= 2:
            redundant.append({(ws[i]["pid"], ws[i]["seq"]): ws[i]["start"]
                              for i in chain["items"]})
    return concurrent, redundant


@pytest.mark.parametrize("seed", range(60))
def test_random_intervals_match_brute_force_reference(seed):
    rng = random.Random(seed)
    settle, window = 1.0, rng.choice([0.5, 2.0, 5.0])
    grid = rng.choice([0.5, 0.25, 1 / 128])
    ws, events = [], []
    procs = {}
    for _ in range(rng.randint(1, 25)):
        pid = rng.randint(1, 6)
        seq = procs[pid] = procs.get(pid, 0) + 1
        # A coarse grid makes touching intervals and equal starts common (exact in binary).
        s = round(rng.uniform(0, 40) / grid) * grid
        e = s + grid * rng.choice([0, rng.randint(1, int(3 / grid))])
        restart = pid % 2 if pid < 5 else None     # pids 5, 6 have no job
        run = ("j", None, restart) if restart is not None else None
        job = "j" if restart is not None else None
        ws.append({"pid": pid, "seq": seq, "start": s, "end": e, "run": run})
        delay_s, delay_e = rng.uniform(0, 0.9 * settle), rng.uniform(0, 0.9 * settle)
        arrive_s = s + delay_s
        arrive_e = max(e + delay_e, arrive_s)      # one process's sender is FIFO
        # A start that never arrives (dropped by the sender) is only recoverable while the
        # writes it overlaps are still held: keep the whole write within `settle`.
        if rng.random() < 0.1 and arrive_e - s < 0.9 * settle:
            events.append((arrive_e, end(pid, seq, e, s, job=job, restart=restart)))
        else:
            events.append((arrive_s, start(pid, seq, s, job=job, restart=restart)))
            events.append((arrive_e, end(pid, seq, e, s, job=job, restart=restart)))
    events.sort(key=lambda x: x[0])
    clock = FakeClock(0.0)
    # The reference builds maximal groups: no write is held long enough here for max_hold to
    # cut a group short (that is tested on its own below).
    det = make(clock, settle=settle, window=window, max_hold=1000.0)
    out = []
    ticks = iter([t / 4 for t in range(0, 400)])
    next_tick = next(ticks)
    for at, ev in events:
        while next_tick < at:
            out += advance(det, clock, next_tick)
            next_tick = next(ticks)
        clock.now = at
        out += det.observe(ev)
    out += advance(det, clock, 1000.0)
    assert det.tracked_paths == 0
    out += det.flush()
    ref_concurrent, ref_redundant = _reference(ws, window)
    got = collisions(out)
    for c in got:
        assert [w.start_mono for w in c.writes] == sorted(w.start_mono for w in c.writes)
    got_concurrent = {frozenset((w.writer.pid, w.seq) for w in c.writes)
                      for c in got if c.kind == KIND_CONCURRENT}
    assert got_concurrent == ref_concurrent
    got_redundant = [c for c in got if c.kind == KIND_REDUNDANT]
    # A single process's own old repeats at the head of a chain may be trimmed (memory bound);
    # everything from there on, and the set of writers, must match.
    assert len(got_redundant) == len(ref_redundant)
    for ref in ref_redundant:
        match = [c for c in got_redundant if {(w.writer.pid, w.seq) for w in c.writes} <= set(ref)]
        assert len(match) == 1, (ref, got_redundant)
        got_keys = {(w.writer.pid, w.seq) for w in match[0].writes}
        head = min(w.start_mono for w in match[0].writes)
        assert got_keys >= {k for k, s in ref.items() if s > head}
        assert {p for p, _ in got_keys} == {p for p, _ in ref}
    assert sorted((w.writer.pid, w.seq) for w in writes(out)) == sorted(
        (w["pid"], w["seq"]) for w in ws)


def test_a_storm_of_overlapping_writes_stays_bounded(monkeypatch):
    import monitor.detect.grouping
    MAX_PATH_WRITES = 64
    monkeypatch.setattr(monitor.detect.grouping, "MAX_PATH_WRITES", MAX_PATH_WRITES)
    clock = FakeClock(0.0)
    det = make(clock)
    out = []
    # Two writers alternate so that one of them is always in flight: one endless group.
    n = MAX_PATH_WRITES * 3
    out += feed(det, clock, [(0.0, start(1, 0, 0.0))])
    for i in range(1, n):
        t = float(i)
        pid = 1 + i % 2
        previous_end = end(3 - pid, i - 1, t + 0.5, t - 1)
        out += feed(det, clock, [(t, start(pid, i, t)), (t + 0.5, previous_end)])
        assert len(next(iter(det._paths.values())).entries) <= MAX_PATH_WRITES + 1
    out += det.flush()
    # Every write is named; a finished one at most once (the last may only be named in flight).
    assert len({(w.writer.pid, w.seq) for c in collisions(out) for w in c.writes}) == n
    finished = [(w.writer.pid, w.seq) for c in collisions(out) for w in c.writes if w.finished]
    assert len(finished) == len(set(finished)) >= n - 1
    # max_hold cuts the endless group into collisions a few seconds apart; a write in flight
    # at a cut is named in flight there, and finished in the next one.
    assert len(collisions(out)) >= n // 10     # one every few seconds of the storm
    for c in collisions(out):
        assert sum(not w.finished for w in c.writes) <= 1


# --- hostile input: open writes that never end (issue 8, defects 5 and 7b) ----------------

class LineBudget:
    """Counts the Python lines executed in monitor/detect/ while active and fails as soon as
    they exceed `limit`: an operation count, not a timing, so it is exact under any load."""

    def __init__(self, limit):
        self.limit, self.lines = limit, 0

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines > self.limit:
                raise AssertionError(f"detector work over budget: {self.lines} lines")
        return self._local

    def _global(self, frame, event, arg):
        if "/monitor/detect/" in frame.f_code.co_filename:
            return self._local
        return None

    def __enter__(self):
        import sys
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        import sys
        sys.settrace(self._previous)


FLOOD = 20_000
LINES_PER_EVENT = 120       # a few dozen lines per event is the linear cost; quadratic is 1000s


def test_a_flood_of_open_starts_costs_bounded_work_per_event_and_bounded_memory():
    clock = FakeClock(0.0)
    det = make(clock, pid_alive=lambda node, pid: True)
    with LineBudget(LINES_PER_EVENT * FLOOD):
        for i in range(FLOOD):
            clock.now = i * 1e-5
            det.observe(start(666, i, clock.now))
        det.tick()
    from monitor.detect.pairing import MAX_OPEN_PER_WRITER
    assert det.open_writes == MAX_OPEN_PER_WRITER
    assert det.refused_starts["writer_open_limit"] == FLOOD - MAX_OPEN_PER_WRITER
    assert len(det._paths[PATH].entries) <= MAX_OPEN_PER_WRITER


def test_a_flood_of_open_starts_does_not_delay_a_real_collision():
    clock = FakeClock(0.0)
    det = make(clock, pid_alive=lambda node, pid: True)
    for i in range(FLOOD):
        clock.now = i * 1e-5
        det.observe(start(666, i, clock.now))
    out = feed(det, clock, [(1.0, start(1, 1, 1.0)), (1.1, start(2, 1, 1.1)),
                            (1.5, end(1, 1, 1.5, 1.0)), (1.6, end(2, 1, 1.6, 1.1))])
    for _ in range(25):                     # 5 s of ticks at the agent's 0.2 s cadence
        out += advance(det, clock, clock.now + 0.2)
    [c] = collisions(out)
    assert c.kind == KIND_CONCURRENT
    done = {w.writer.pid for w in c.writes if w.finished}
    assert done == {1, 2}
    # The silent writer is named, still in flight.
    assert {w.writer.pid for w in c.writes if not w.finished} == {666}


def test_a_live_silent_writer_does_not_hide_a_collision_past_max_hold():
    clock = FakeClock(0.0)
    det = make(clock, settle=1.0, pid_alive=lambda node, pid: True)   # max_hold 3 s
    out = feed(det, clock, [(0.0, start(9, 1, 0.0)),          # opened, never ended
                            (10.0, start(1, 1, 10.0)), (10.2, start(2, 1, 10.2)),
                            (10.5, end(1, 1, 10.5, 10.0)), (10.6, end(2, 1, 10.6, 10.2))])
    out += advance(det, clock, 10.6 + 0.9)
    assert collisions(out) == []            # the finished writes are still settling
    # pid 9 has been open far longer than settle + max_hold: it holds nothing back.
    out += advance(det, clock, 10.6 + 1.0)
    [c] = collisions(out)
    assert [(w.writer.pid, w.finished) for w in c.writes] == [(9, False), (1, True),
                                                               (2, True)]
    assert c.last.writer.pid == 9           # the one still writing finishes last
    assert c.overlap_seconds == pytest.approx(0.6)
    # Later, when it ends alone, nothing new: no second report of the same collision.
    out = feed(det, clock, [(30.0, end(9, 1, 30.0, 0.0))])
    out += advance(det, clock, 100.0)
    assert collisions(out) == [] and [w.writer.pid for w in writes(out)] == [9]
    assert det.tracked_paths == 0


def test_two_silent_writers_are_reported_once_while_still_in_flight():
    clock = FakeClock(0.0)
    det = make(clock, settle=1.0, pid_alive=lambda node, pid: True)   # max_hold 3 s
    out = feed(det, clock, [(0.0, start(1, 1, 0.0)), (0.5, start(2, 1, 0.5))])
    for t in range(1, 20):
        out += advance(det, clock, float(t))
    [c] = collisions(out)
    assert [w.finished for w in c.writes] == [False, False]
    out = feed(det, clock, [(30.0, end(1, 1, 30.0, 0.0)), (31.0, end(2, 1, 31.0, 0.5))])
    out += advance(det, clock, 100.0)
    assert collisions(out) == []
    assert det.tracked_paths == 0


def test_open_writes_are_capped_per_path_and_the_excess_ends_still_count():
    from monitor.detect.pairing import MAX_OPEN_PER_PATH, MAX_OPEN_PER_WRITER
    clock = FakeClock(0.0)
    det = make(clock, pid_alive=lambda node, pid: True)
    writers = MAX_OPEN_PER_PATH // MAX_OPEN_PER_WRITER + 1
    for pid in range(100, 100 + writers):
        for seq in range(MAX_OPEN_PER_WRITER):
            det.observe(start(pid, seq, 0.0))
    assert det.open_writes == MAX_OPEN_PER_PATH
    assert det.refused_starts["path_open_limit"] == MAX_OPEN_PER_WRITER * writers - \
        MAX_OPEN_PER_PATH
    # A refused start's end still reports its write (it stands alone).
    out = det.observe(end(100 + writers - 1, 0, 1.0, 0.0))
    assert [w.writer.pid for w in writes(out)] == [100 + writers - 1]

# ---- job scope: remote writes (Detector.observe_remote) ---------------------------------------

def remote(reporter_pid, reporter_seq, wpid, wseq, s_mono, e_mono, node="n1", wnode="n2",
           rank=2, path=PATH, job="j1", master="10.0.0.1:29500"):
    return {"v": 1, "type": "remote", "node": node, "pid": reporter_pid, "seq": reporter_seq,
            "path": path, "wall": WALL0 + e_mono,
            "writer": {"node": wnode, "pid": wpid, "rank": rank, "local_rank": 0,
                       "world_size": 4, "job": job, "master": master, "restart": 0},
            "wseq": wseq, "start_wall": WALL0 + s_mono, "end_wall": WALL0 + e_mono,
            "start_mono": s_mono, "end_mono": e_mono, "bytes": 10, "outcome": "ok",
            "site": "train.py:42", "func": "save_checkpoint", "overlap": True, "shared": None}


def dist_start(pid, seq, mono, **kw):
    ev = start(pid, seq, mono, master="10.0.0.1:29500", **kw)
    ev["world_size"] = 4
    return ev


def dist_end(pid, seq, mono, start_mono, **kw):
    ev = end(pid, seq, mono, start_mono, master="10.0.0.1:29500", **kw)
    ev["world_size"] = 4
    return ev


def test_remote_write_overlapping_a_local_one_is_a_job_scope_collision():
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=2.0)
    out = feed(det, clock, [(0.0, dist_start(11, 1, 0.0, rank=0)),
                            (1.0, dist_end(11, 1, 1.0, 0.0, rank=0))])
    clock.now = 1.2
    got = det.observe_remote(remote(11, 1, 99, 7, 0.5, 1.5))
    assert not [i for i in got if isinstance(i, Write)]      # never a write of this node
    for t in (1.6, 2.5, 3.4, 3.6):
        clock.now = t
        out += det.tick()
    found = collisions(out)
    assert len(found) == 1
    c = found[0]
    assert c.kind == KIND_CONCURRENT and c.scope == "job" and "job" in c.sources
    assert {(w.writer.node, w.writer.pid) for w in c.writes} == {("n1", 11), ("n2", 99)}
    remote_write = [w for w in c.writes if w.source == "job"][0]
    assert remote_write.reporter == 11 and c.to_record()["writers"][1]["reported_by"] == 11
    # The id depends on the run, the path and the earliest write only: the other agent,
    # which holds the same two writes the other way round, derives the same -- and so does
    # one that learnt of fewer of the later writes (issue 16: two agents, two ids).
    from monitor.detect.grouping import job_collision_id
    run = sorted(map(repr, {w.writer.run_key for w in c.writes}))
    assert c.id == job_collision_id(run, PATH, tuple(reversed(c.writes)))
    first = min(c.writes, key=lambda w: w.start_wall)
    assert c.id == job_collision_id(run, PATH, (first,))
    assert c.id != job_collision_id(run, PATH, tuple(w for w in c.writes if w is not first))


@pytest.mark.parametrize("sent, kept", [(None, None), ("dcp", "dcp"),
                                         ("safetensors", "safetensors"), ("Evil\x1b", "other")])
def test_a_remote_writes_library_is_kept_bounded(sent, kept):
    """Job scope passes the other node's writer kind on (`writer_kind`): the collision's
    remote write carries it, bounded like a local one's; the report names both libraries."""
    from monitor.cli.report import writer_kinds
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=2.0)
    out = feed(det, clock, [(0.0, dist_start(11, 1, 0.0, rank=0)),
                            (1.0, dist_end(11, 1, 1.0, 0.0, rank=0))])
    clock.now = 1.2
    event = remote(11, 1, 99, 7, 0.5, 1.5)
    if sent is not None:
        event["writer_kind"] = sent
    det.observe_remote(event)
    for t in (1.6, 2.5, 3.4, 3.6):
        clock.now = t
        out += det.tick()
    (c,) = collisions(out)
    (remote_write,) = [w for w in c.writes if w.source == "job"]
    assert remote_write.writer_kind == kept
    assert writer_kinds(c) == ([] if kept is None else sorted({kept, "torch.save"}))
    assert Write.from_record(remote_write.to_record()).writer_kind == kept


def _story(det, clock, timed, until):
    """feed() the (time, event) pairs, tick to `until`; the collisions as (kind, id, writes)."""
    out = feed(det, clock, timed)
    t = clock.now
    while t < until:
        t += 0.25
        out += advance(det, clock, t)
    return sorted((c.kind, c.id, sorted((w.writer.node, w.writer.pid, w.seq) for w in c.writes))
                  for c in collisions(out))


def test_two_agents_holding_the_same_writes_the_other_way_round_tell_one_story():
    """Node n1's rank saves X [3, 4]; on node n2 one rank saves Z [0, 1], another Y [3.9, 5]
    (walls of one host: X and Y overlap). Each process's job scope places another node's write
    against the one write of its own it was read for, on the store log's order, which here
    says Y started after X ended (Y's start line lagged): X's process reports Y moved after X,
    Z's process reports X as its walls say (X is after Z either way). Before, n1's agent made
    a redundant chain Z, X, Y of it and n2's a concurrent collision X, Y (issue 16: a
    Lightning job on two nodes, two stories). Every pair with another node's write in it is
    decided on the walls now (monitor.detect.placement): one story, the walls'."""
    def placed(event, s_mono, e_mono):
        event["start_mono"], event["end_mono"] = s_mono, e_mono
        return event

    kw = dict(settle=0.5, job_settle=2.0, window=5.0)
    clock_a = FakeClock(0.0)
    story_a = _story(make(clock_a, **kw), clock_a, [
        (3.0, dist_start(11, 1, 3.0, rank=0)), (4.0, dist_end(11, 1, 4.0, 3.0, rank=0)),
        (4.05, remote(11, 1, 98, 1, 0.0, 1.0, rank=2)),
        (5.05, placed(remote(11, 1, 99, 1, 3.9, 5.0, rank=1), 4.0 + 1e-6, 5.0))], until=30.0)
    clock_b = FakeClock(0.0)
    story_b = _story(make(clock_b, **kw), clock_b, [
        (0.0, dist_start(98, 1, 0.0, node="n2", rank=2)),
        (1.0, dist_end(98, 1, 1.0, 0.0, node="n2", rank=2)),
        (3.9, dist_start(99, 1, 3.9, node="n2", rank=1)),
        (4.05, remote(98, 1, 11, 1, 3.0, 4.0, node="n2", wnode="n1", rank=0)),
        (5.0, dist_end(99, 1, 5.0, 3.9, node="n2", rank=1))], until=30.0)
    assert story_a == story_b
    # ... and it is the walls' story: X and Y overlapped; Z alone ahead of them is not a
    # collision (a concurrent collision breaks a redundant chain).
    assert [(kind, writes) for kind, _, writes in story_a] == [
        (KIND_CONCURRENT, [("n1", 11, 1), ("n2", 99, 1)])]


def test_a_collision_of_one_nodes_writers_has_the_same_id_on_the_node_that_hears_of_it():
    """Two ranks of node n1 (a job on two nodes) overlap on a shared path; node n2's agent
    hears of both through its rank's job scope (its own save of the path came later). n1
    calls it scope "node", n2 scope "job" -- but one collision, one id (the ground-truth
    checker's "two stories": a57b23ea65fe325b on one agent, j6b49ed8d84077e8 on the other)."""
    kw = dict(settle=0.5, job_settle=2.0, window=1.0)
    clock_a = FakeClock(0.0)
    det_a = make(clock_a, **kw)
    out_a = feed(det_a, clock_a, [
        (2.0, dist_start(11, 1, 2.0, rank=0)), (2.5, dist_start(12, 1, 2.5, rank=1)),
        (3.0, dist_end(11, 1, 3.0, 2.0, rank=0)), (3.5, dist_end(12, 1, 3.5, 2.5, rank=1))])
    out_a += advance(det_a, clock_a, 30.0)
    clock_b = FakeClock(0.0)
    det_b = make(clock_b, **kw)
    out_b = feed(det_b, clock_b, [
        (3.6, dist_start(21, 1, 3.6, node="n2", rank=2)),
        (3.9, dist_end(21, 1, 3.9, 3.6, node="n2", rank=2))] + [
        (4.0, remote(21, 1, pid, 1, s_mono, e_mono, node="n2", wnode="n1", rank=rank))
        for pid, rank, s_mono, e_mono in ((11, 0, 2.0, 3.0), (12, 1, 2.5, 3.5))])
    out_b += advance(det_b, clock_b, 30.0)
    (a,), (b,) = collisions(out_a), collisions(out_b)
    assert (a.scope, b.scope) == ("node", "job")
    assert a.kind == b.kind == KIND_CONCURRENT
    assert {w.writer.pid for w in a.writes} == {w.writer.pid for w in b.writes} == {11, 12}
    assert a.id == b.id


def test_remote_writes_need_the_reporters_own_write_of_the_path():
    clock = FakeClock(0.0)
    det = make(clock)
    assert det.observe_remote(remote(11, 1, 99, 7, 0.5, 1.5)) == []
    assert det.remote_rejected["unanchored"] == 1 and det.tracked_paths == 0
    feed(det, clock, [(0.0, dist_start(11, 1, 0.0)), (1.0, dist_end(11, 1, 1.0, 0.0))])
    # another process's write is no anchor, nor another seq of the reporter
    assert det.observe_remote(remote(12, 1, 99, 7, 0.5, 1.5)) == []
    assert det.observe_remote(remote(11, 2, 99, 7, 0.5, 1.5)) == []
    assert det.remote_rejected["unanchored"] == 3


def test_a_remote_report_can_never_name_a_writer_of_this_node():
    # Issue 17 item 1: the sender claims node "elsewhere", names the agent's node "n1" as the
    # writer's (validation compares the two), and the agent then stamps its own node "n1" on
    # the event. Taken in, the victim (pid 66, a process of this node) became a writer of a
    # file it never touched, in the journal and, under warn, in a notice to it.
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=1.0)
    out = feed(det, clock, [(0.0, dist_start(11, 1, 0.0)), (1.0, dist_end(11, 1, 1.0, 0.0))])
    clock.now = 1.2
    assert det.observe_remote(remote(11, 1, 66, 7, 0.5, 1.5, node="n1", wnode="n1")) == []
    for t in (2.0, 3.0, 4.0):
        clock.now = t
        out += det.tick()
    assert collisions(out) == []
    assert {w.writer.pid for w in out if isinstance(w, Write)} == {11}
    assert det.remote_rejected["local_writer"] == 1


def test_a_remote_write_reported_many_times_counts_once_and_a_path_holds_few():
    from monitor.detect.remote import MAX_REMOTE_PER_PATH
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=1.0)
    feed(det, clock, [(0.0, dist_start(11, 1, 0.0)), (1.0, dist_end(11, 1, 1.0, 0.0))])
    for _ in range(5):
        det.observe_remote(remote(11, 1, 99, 7, 0.5, 1.5))
    for i in range(MAX_REMOTE_PER_PATH + 50):
        det.observe_remote(remote(11, 1, 1000 + i, 1, 0.2, 0.8))
    assert det.remote_rejected["path_full"] == 51
    out = []
    for t in (2.0, 3.0, 4.0):
        clock.now = t
        out += det.tick()
    c = collisions(out)[0]
    assert len([w for w in c.writes if w.writer.pid == 99]) == 1
    assert len(c.writes) == 1 + MAX_REMOTE_PER_PATH


def test_a_node_collision_also_seen_in_the_job_is_reported_once_as_job_scope():
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=2.0)
    out = feed(det, clock, [(0.0, dist_start(11, 1, 0.0, rank=0)),
                            (0.1, dist_start(12, 1, 0.1, rank=1)),
                            (1.0, dist_end(11, 1, 1.0, 0.0, rank=0)),
                            (1.1, dist_end(12, 1, 1.1, 0.1, rank=1))])
    clock.now = 2.0                  # past settle, within job settle: the remote still joins
    out += det.tick()
    assert collisions(out) == []
    det.observe_remote(remote(11, 1, 99, 7, 0.5, 1.5, rank=2))
    det.observe_remote(remote(12, 1, 99, 7, 0.5, 1.5, rank=2))     # the same write, twice
    for t in (3.0, 4.0):
        clock.now = t
        out += det.tick()
    found = collisions(out)
    assert len(found) == 1 and found[0].scope == "job"
    assert sorted(w.writer.rank for w in found[0].writes) == [0, 1, 2]


def test_single_node_distributed_jobs_keep_the_short_settle():
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=5.0)
    evs = [dist_start(11, 1, 0.0), dist_start(12, 1, 0.1), dist_end(11, 1, 1.0, 0.0),
           dist_end(12, 1, 1.1, 0.1)]
    for ev in evs:
        ev["local_world_size"] = 4          # world_size 4: every rank on this node
    out = feed(det, clock, [(0.0, evs[0]), (0.1, evs[1]), (1.0, evs[2]), (1.1, evs[3]),
                            (1.7, start(13, 1, 1.7, path="/other"))])
    assert len(collisions(out)) == 1


def test_node_only_jobs_keep_the_short_settle():
    clock = FakeClock(0.0)
    det = make(clock, settle=0.5, job_settle=5.0)
    out = feed(det, clock, [(0.0, start(11, 1, 0.0)), (0.1, start(12, 1, 0.1)),
                            (1.0, end(11, 1, 1.0, 0.0)), (1.1, end(12, 1, 1.1, 0.1)),
                            (1.7, start(13, 1, 1.7, path="/other"))])
    assert len(collisions(out)) == 1 and collisions(out)[0].scope == "node"


def test_a_write_sent_again_after_a_reconnect_is_not_a_second_write():
    # A hook sends again what the agent had not acknowledged when the connection ended
    # (ckptwatch/emitter.py): a start or end seen before must change nothing -- no second
    # write, and above all no collision of a process with itself.
    clock = FakeClock()
    det = make(clock, window=0, settle=0.5)
    first = feed(det, clock, [(1000.0, start(10, 1, 1000.0)), (1000.2, end(10, 1, 1000.2, 1000.0)),
                              (1000.3, end(11, 1, 1000.3, 1000.25))])       # a lone end
    again = feed(det, clock, [(1001.0, start(10, 1, 1000.0)), (1001.0, end(10, 1, 1000.2, 1000.0)),
                              (1001.1, end(11, 1, 1000.3, 1000.25))])
    later = advance(det, clock, 1010.0)
    assert len(writes(first)) == 2
    assert writes(again) == [] and writes(later) == []
    assert collisions(first + again + later) == []
    assert det.repeated == 3


def test_a_recycled_pid_starting_its_own_seq_1_is_a_new_write():
    # Another process may get the pid of one that ended, and count its writes from 1 again:
    # its start time tells it apart from a repeat.
    clock = FakeClock()
    det = make(clock, window=0, settle=0.5)
    out = feed(det, clock, [(1000.0, end(10, 1, 1000.1, 1000.0)),
                            (1005.0, end(10, 1, 1005.1, 1005.0))])
    assert len(writes(out)) == 2 and det.repeated == 0


# --- the fast paths hold to the plain ones they stand for ----------------------------------

def test_write_of_builds_the_same_write_as_its_constructor():
    import inspect

    from monitor.detect.model import Writer
    assert list(inspect.signature(Write.of).parameters) == list(Write.__dataclass_fields__)
    writer = Writer("n1", 7, 3, 3, 8, 8, 0, "j1", None, 2)
    for values in [(writer, "/c/x.pt", 4, 1.5, 2.5, 3.5, 4.5, 100, "ok", "t.py:1", "f", "hook",
                    None),
                   (writer, "/c/y.pt", 5, 1.0, 1.0, None, None, None, None, None, None, "job",
                    11)]:
        fast, plain = Write.of(*values), Write(*values)
        assert fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
        assert vars(fast) == vars(plain) and list(vars(fast)) == list(vars(plain))
        assert fast.to_record() == plain.to_record()


def test_a_paths_entries_keep_insorts_order_with_ties_late_starts_and_nan():
    """_PathState.insert appends when it can; the list must be exactly what insort makes,
    also once a NaN start (which compares false with everything) is in it."""
    from bisect import insort

    from monitor.detect.tracked import Entry as _Entry, PathState as _PathState, sort_key as _sort_key
    from monitor.detect.model import Writer
    writer = Writer("n1", 1)
    for seed in range(200):
        rng = random.Random(seed)
        state, reference = _PathState("/p"), []
        for order in range(rng.randint(1, 40)):
            start_mono = rng.choice([float(order), float(order), rng.randint(0, 40) / 4,
                                     float("nan") if rng.random() < 0.2 else 1.0])
            entry = _Entry(writer, "/p", order, start_mono, start_mono, None, None, order, 0.0)
            state.insert(entry)
            insort(reference, entry, key=_sort_key)
            assert state.entries == reference, seed


def test_grouping_a_list_in_start_order_matches_grouping_after_the_sort():
    from bisect import insort

    from monitor.detect.grouping import group_writes
    from monitor.detect.tracked import Entry as _Entry, sort_key as _sort_key
    from monitor.detect.model import Writer
    for seed in range(200):
        rng = random.Random(seed)
        entries = []
        for order in range(rng.randint(1, 30)):
            start_mono = rng.randint(0, 60) / 4      # a coarse grid: equal starts are common
            entry = _Entry(Writer("n1", rng.randint(1, 3)), "/p", order, start_mono,
                           start_mono, None, None, order, 0.0)
            if rng.random() < 0.8:
                end_mono = start_mono + rng.choice([0.0, rng.randint(1, 12) / 4])
                entry.finish(end_mono, end_mono, 1, "ok", 0.0)
            insort(entries, entry, key=_sort_key)
        fast = group_writes(entries, in_start_order=True)
        plain = group_writes(entries)
        assert [g.entries for g in fast] == [g.entries for g in plain], seed


def test_writer_key_is_the_events_writer_fields_in_order():
    from monitor.detect.model import WRITER_FIELDS, Writer, writer_key
    event = {name: f"value of {name}" for name in WRITER_FIELDS}
    event.update(type="start", path="/p", seq=1)
    assert writer_key(event) == tuple(map(event.get, WRITER_FIELDS))
    assert Writer(*writer_key(event)) == Writer.from_event(event)
    del event["rank"], event["restart"]         # optional fields: None when absent
    assert writer_key(event) == tuple(map(event.get, WRITER_FIELDS))


# ------------------------------------------------------------ one writer's path, fast (issue 22)

def _solo_path(rng, run, n, in_flight, gaps=(0.0, 0.001, 0.5, 2.0, 59.0, 61.0, 200.0)):
    """A PathState of n writes by one Writer, one after another, gaps around the window."""
    from monitor.detect.model import Writer
    from monitor.detect.tracked import Entry, PathState
    writer = Writer("n1", 7, job="j1" if run else None, restart=0 if run else None)
    state, t = PathState(PATH), 1000.0
    for i in range(n):
        t += rng.choice(gaps)
        e = Entry(writer, PATH, i, WALL0 + t, t, "x.py:1", "f", i, t)
        duration = rng.choice((0.0, 0.01, 0.3))
        if not (in_flight and i == n - 1):
            e.finish(WALL0 + t + duration, t + duration, 100, "ok",
                     t + duration + rng.choice((0.0, 0.2)))
        state.insert(e)
        t += duration
    return state, t


def _regroup(state, now, fast):
    import copy

    from monitor.detect.grouping import Grouping
    g = Grouping(60.0, 1.0, 3.0, 3.0, lambda: WALL0)
    if not fast:
        g._regroup_solo = lambda state, now: None     # the general way, as before
    state = copy.deepcopy(state)
    out: list = []
    due = g.regroup(state, now, False, out)
    return due, [(e.seq, e.start_mono) for e in state.entries], out


@pytest.mark.parametrize("seed", range(40))
def test_a_one_writer_path_is_regrouped_as_the_general_way_does(seed):
    """The short way for a path holding one writer's saves forgets the same writes and asks
    for the same next look as building its groups and chains; nothing is reported."""
    rng = random.Random(seed)
    # Every fifth: a chain longer than MAX_CHAIN_WRITES (saves well within the window).
    gaps = (0.001, 0.5, 2.0) if seed % 5 == 0 else (0.0, 0.001, 0.5, 2.0, 59.0, 61.0, 200.0)
    state, t = _solo_path(rng, run=seed % 2 == 0, in_flight=seed % 3 == 0, gaps=gaps,
                          n=MAX_CHAIN_WRITES + 20 if seed % 5 == 0 else
                          rng.choice((1, 2, 5, 40, 300)))
    for now in (t, t + 0.5, t + 1.0, t + 1.5, t + 30.0, t + 61.0, t + 62.0, t + 500.0):
        fast = _regroup(state, now, True)
        assert fast == _regroup(state, now, False), (seed, now)
        assert fast[2] == []


def test_a_one_writer_path_saved_again_and_again_stays_small_and_reports_nothing():
    clock = FakeClock()
    d = Detector(window=60.0, settle=1.0, clock=clock)
    out = []
    for seq in range(500):
        t = clock.now
        out += d.observe(start(5, seq, t))
        clock.now += 0.05
        out += d.observe(end(5, seq, clock.now, t))
        clock.now += 0.3
        out += d.tick()
    assert [type(o) for o in out] == [Write] * 500
    assert len(d._paths[PATH].entries) <= 5
    clock.now += 62.0
    assert d.tick() == [] and d.tracked_paths == 0


def test_a_job_collision_id_is_the_same_from_the_hooks_text_and_the_stores_full_wall():
    """One agent holds a write's start from its hook's event ("%.6f" text), the other from the
    store's log: the two numbers may differ below the microsecond, never the id (issue 16: two
    agents gave one collision two ids)."""
    from monitor.detect.grouping import job_collision_id
    from monitor.detect.model import Writer
    a, b = Writer("n1", 11, rank=0, job="j"), Writer("n2", 22, rank=2, job="j")
    full = 1733389000.1234567
    hooked = float("%.6f" % full)
    assert hooked != full

    def writes(first_wall):
        return (Write(a, PATH, 1, first_wall, 5.0, first_wall + 1, 6.0),
                Write(b, PATH, 1, first_wall + 0.5, 1.0, first_wall + 2, 2.0))
    assert job_collision_id(("j",), PATH, writes(full)) == \
        job_collision_id(("j",), PATH, writes(hooked))


def test_a_spanning_jobs_chain_waits_a_job_settle_past_the_window_for_a_later_report():
    """A rank's write of a path that names its rank is read once more a window after its end
    (ckptwatch/jobscope.py): a redundant write of another node then arrives after window +
    settle. The chain of a job spanning nodes stays open job_settle past the window, so it is
    still joined (tests/e2e/test_groundtruth.py y3: node-b missed the chain)."""
    clock = FakeClock(0.0)
    det = make(clock, window=2.0, settle=0.3, job_settle=3.0)
    out = feed(det, clock, [(0.0, dist_start(11, 1, 0.0, rank=3)),
                            (0.1, dist_end(11, 1, 0.1, 0.0, rank=3))])
    for t in (1.0, 2.2, 2.45):                  # past window + settle: the old close
        clock.now = t
        out += det.tick()
    ev = remote(11, 1, 99, 7, 1.3, 1.4)
    ev["overlap"] = False
    clock.now = 2.5
    det.observe_remote(ev)
    for t in (3.0, 5.0, 8.0, 12.0):
        clock.now = t
        out += det.tick()
    found = collisions(out)
    assert [c.kind for c in found] == [KIND_REDUNDANT]
    assert {(w.writer.node, w.writer.pid) for w in found[0].writes} == {("n1", 11), ("n2", 99)}


def test_a_node_local_chain_still_closes_a_settle_past_the_window():
    clock = FakeClock(0.0)
    det = make(clock, window=2.0, settle=0.3, job_settle=3.0)
    out = feed(det, clock, [(0.0, start(11, 1, 0.0)), (0.1, end(11, 1, 0.1, 0.0)),
                            (1.0, start(12, 1, 1.0)), (1.1, end(12, 1, 1.1, 1.0))])
    clock.now = 3.5                             # 1.1 + 2.0 + 0.3 < 3.5 < 1.1 + 2.0 + 3.0
    out += det.tick()
    assert [c.kind for c in collisions(out)] == [KIND_REDUNDANT]
