"""Where another node's write sits among this node's writes of a path: on the walls, the same
numbers every agent holds.

A remote write (source "job") comes with its writer's wall start and end, and with a place in
this node's monotonic time base that the reporting process chose relative to its own write
(ckptwatch.jobkeys.place_remote: the store log's order against that one write). Grouping
compares monotonic times, so with that place alone an agent decides the remote write against
the reporter's write by the log and against every other local write by the walls -- and the
other node's agent, holding the same writes the other way round, decides some pairs the other
way (issue 16: one Lightning job, node A "concurrent {A2, A3, B2, B3}", node B "redundant
{A1, A2, B1}"). Every agent must tell the same story, so every pair with a remote write in it
is decided on the walls, to the microsecond (as the hook's events carry them):

- the local writes' own (wall, monotonic) points -- starts, and ends of finished writes --
  form a map from walls to this node's monotonic time, kept only where it rises in both
  (a point the clocks' reads disagree on by less than their own gap is left out);
- each remote write is placed through that map: linear between two neighbouring points,
  by the nearest point's offset outside them. The map is strictly increasing and passes
  through every local point, so a remote start or end falls before, on or after a local one
  exactly as its wall does, and two remote writes keep their walls' order.

An agent that holds local write X and remote write Y compares X's wall with Y's, and so does
the agent holding Y locally and X remotely: one verdict. Tolerance: clock skew between hosts
(the walls of two hosts; none on one host) and, between two local writes, the gap of the
hook's two clock reads (model.Write: a local pair is compared on the monotonic clock).
"""
from __future__ import annotations

from bisect import bisect_left

from monitor.detect.model import SOURCE_JOB
from monitor.detect.tracked import PathState, sort_key


def _us(wall: float) -> float:
    """A wall time to the microsecond: what a hook's event carries ("%.6f"), so the value an
    agent got from the hook and the one another agent read in the store's log agree."""
    return round(wall, 6)


def wall_map(state: PathState) -> tuple[list, list]:
    """The path's local (wall, mono) points, walls and monos each strictly increasing."""
    points = []
    for entry in state.entries:
        if entry.source == SOURCE_JOB:
            continue
        points.append((_us(entry.start_wall), entry.start_mono))
        if entry.end_mono is not None:
            points.append((_us(entry.end_wall), entry.end_mono))
    points = [p for p in points if p[0] == p[0] and p[1] == p[1]]     # no NaN
    points.sort()
    walls: list = []
    monos: list = []
    for wall, mono in points:
        if walls and (wall <= walls[-1] or mono <= monos[-1]):
            continue
        walls.append(wall)
        monos.append(mono)
    return walls, monos


def to_mono(wall: float, walls: list, monos: list, fallback_offset: float) -> float:
    """A wall time in the local monotonic base through the map (walls, monos)."""
    wall = _us(wall)
    if not walls or wall != wall:
        return wall - fallback_offset
    i = bisect_left(walls, wall)
    if i < len(walls) and walls[i] == wall:
        return monos[i]
    if i == 0:
        return monos[0] - (walls[0] - wall)
    if i == len(walls):
        return monos[-1] + (wall - walls[-1])
    w0, w1, m0, m1 = walls[i - 1], walls[i], monos[i - 1], monos[i]
    mono = m0 + (wall - w0) * (m1 - m0) / (w1 - w0)
    # Strictly between its neighbours, whatever the rounding.
    return mono if m0 < mono < m1 else (m0 + m1) / 2


def place_remote_entries(state: PathState) -> None:
    """Re-place every remote write of the path on the walls (module doc); keep the entries in
    start order. A no-op for a path without remote writes."""
    remote = [e for e in state.entries if e.source == SOURCE_JOB]
    if not remote:
        return
    walls, monos = wall_map(state)
    # Without a local point (the local writes were all forgotten), one offset for all: the
    # remote writes keep their walls' order among themselves.
    first = remote[0]
    offset = _us(first.start_wall) - first.start_mono
    moved = False
    for entry in remote:
        start = to_mono(entry.start_wall, walls, monos, offset)
        end = to_mono(entry.end_wall, walls, monos, offset)
        end = max(end, start)
        if start != entry.start_mono or end != entry.end_mono:
            moved = True
            entry.start_mono, entry.end_mono, entry.stop = start, end, end
            entry.done_at = max(entry.done_at, end)
    if moved:
        state.entries.sort(key=sort_key)
