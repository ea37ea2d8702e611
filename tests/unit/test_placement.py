"""monitor.detect.placement: another node's write placed among this node's writes on the walls.

The property every agent's agreement rests on: after placement, a remote start or end compares
with every local start and end (on the monotonic clock, as grouping does) exactly as their
walls to the microsecond compare, and remote writes keep their walls' order."""
from hypothesis import given, settings, strategies as st

from monitor.detect.model import SOURCE_HOOK, SOURCE_JOB, Writer
from monitor.detect.placement import place_remote_entries, to_mono, wall_map
from monitor.detect.tracked import Entry, PathState

WALL0 = 1_700_000_000.0


def _entry(pid, seq, start_wall, end_wall, offset, source, order):
    writer = Writer(node="n2" if source == SOURCE_JOB else "n1", pid=pid, rank=None,
                    local_rank=None, world_size=None, local_world_size=None, node_rank=None,
                    job="j", master=None, restart=0)
    entry = Entry(writer, "/c/p.pt", seq, start_wall, start_wall - offset, None, None, order,
                  0.0, source)
    if end_wall is not None:
        entry.finish(end_wall, end_wall - offset, 1, "ok", 0.0)
    return entry


# Times in microseconds from WALL0: distinct ticks make ties as likely as they are in events.
ticks = st.integers(min_value=0, max_value=2_000_000)


@settings(max_examples=300, deadline=None)
@given(local=st.lists(st.tuples(ticks, st.integers(0, 500_000), st.booleans()), min_size=1,
                      max_size=6),
       remote=st.lists(st.tuples(ticks, st.integers(0, 500_000), st.floats(-0.05, 0.05)),
                       min_size=1, max_size=6),
       offset=st.floats(1000.0, 5000.0))
def test_remote_writes_compare_with_local_ones_as_their_walls_do(local, remote, offset):
    state = PathState("/c/p.pt")
    order = 0
    for i, (start, length, finished) in enumerate(local):
        sw = WALL0 + start / 1e6
        state.insert(_entry(10 + i, 1, sw, sw + length / 1e6 if finished else None, offset,
                            SOURCE_HOOK, order))
        order += 1
    for i, (start, length, skew) in enumerate(remote):
        sw = WALL0 + start / 1e6
        # The reporter's own placement is off by up to 50 ms (the log's order, its clock).
        state.insert(_entry(90 + i, 1, sw, sw + length / 1e6, offset + skew, SOURCE_JOB, order))
        order += 1
    place_remote_entries(state)
    local_points = [(e.start_wall, e.start_mono) for e in state.entries
                    if e.source != SOURCE_JOB]
    local_points += [(e.end_wall, e.end_mono) for e in state.entries
                     if e.source != SOURCE_JOB and e.end_mono is not None]
    remotes = [e for e in state.entries if e.source == SOURCE_JOB]
    remote_points = [(e.start_wall, e.start_mono) for e in remotes] + \
        [(e.end_wall, e.end_mono) for e in remotes]
    for rw, rm in remote_points:
        for lw, lm in local_points:
            walls = (round(rw, 6) > round(lw, 6)) - (round(rw, 6) < round(lw, 6))
            assert (rm > lm) - (rm < lm) == walls, (rw, lw, rm, lm)
    for aw, am in remote_points:
        for bw, bm in remote_points:
            if round(aw, 6) < round(bw, 6):
                assert am < bm
    assert [e.start_mono for e in state.entries] == sorted(e.start_mono for e in state.entries)


def test_points_the_clocks_disagree_on_are_left_out_of_the_map():
    """Two local points whose walls and monotonic times are in opposite orders (a thread
    descheduled between the hook's two clock reads) cannot both be honoured: the map keeps
    the first and stays increasing."""
    state = PathState("/c/p.pt")
    state.insert(_entry(1, 1, WALL0 + 1.0, WALL0 + 2.0, WALL0, SOURCE_HOOK, 0))
    late = _entry(2, 1, WALL0 + 1.5, None, WALL0, SOURCE_HOOK, 1)
    late.start_mono = 0.9                         # read before the first write's start
    state.insert(late)
    walls, monos = wall_map(state)
    assert walls == sorted(walls) and monos == sorted(monos)
    assert len(walls) == 2
    assert to_mono(WALL0 + 1.5, walls, monos, WALL0) == 1.5


def test_without_local_points_remote_writes_keep_one_offset():
    assert to_mono(WALL0 + 3.0, [], [], WALL0 + 1.0) == 2.0
