"""What the truth allows an agent to report on one path: pure, from the true intervals.

The definitions are design.md's and the detector's (monitor/detect/grouping.py), applied to
the writers' true intervals instead of the hooks' reports:

- two saves by different writers overlap when their intervals do; a concurrent collision is a
  maximal group of transitively overlapping saves on one path with two or more writers;
- a redundant collision is a maximal chain of solo saves (groups of one writer) of one job run
  on one path, each starting within `window` of the previous one's end, with two or more
  writers and no concurrent collision in between. The detector forgets the older saves of a
  chain that has had one writer so far (a process saving again and again is normal), so the
  first writer's saves before its last one ahead of the second writer are optional in the
  report.

Tolerance (TOLERANCE, docs/decisions.md "The ground-truth checker"): two instants closer than
it may be ordered either way. Whether two saves overlap is two comparisons (each one's start
against the other's end): when either is within the tolerance and neither says "apart" by
more, the pair may be called overlapping or not -- so an overlap or a gap shorter than the
tolerance may be called either way, while a short save wholly inside a long one, its start and
end far from the long one's, is an overlap. A gap within the tolerance of the window's edge
may link a chain or not. Each such pair or gap is a choice; the alternatives are every
combination of choices, and a report is right when it equals one of them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from groundtruth.truth import TrueWrite

CONCURRENT, REDUNDANT = "concurrent", "redundant"
KINDS = (CONCURRENT, REDUNDANT)

# The ordering tolerance, seconds. Across nodes overlap is decided on the job store's tickets,
# which lag the real event by the job-scope thread's wake-up plus a round trip; on one node on
# the hooks' clock reads, taken inside the truth's (a save's report nests in its true
# interval, so a true gap is never read as an overlap there, but a true overlap shorter than
# a descheduling of the writer between its two clock reads can be missed). 50 ms covers both
# on the 2-CPU build machine at load 2x its cores.
TOLERANCE = 0.05
# Choices enumerated at most per path (2^12 alternatives); a schedule beyond it is a bug in
# the schedule, not a verdict.
MAX_CHOICES = 12


@dataclass(frozen=True)
class Expected:
    """One collision the truth calls for: its kind, the saves it must name and the saves it
    may name besides."""

    kind: str
    required: frozenset
    optional: frozenset = frozenset()

    def matches(self, kind: str, saves: frozenset) -> bool:
        return kind == self.kind and self.required <= saves <= self.required | self.optional


def margins(a: TrueWrite, b: TrueWrite) -> tuple[float, float]:
    """The two comparisons that decide whether a and b overlap (both positive: they do; one
    negative: they do not): how long after a's start b ended, and after b's start a ended."""
    return b.end - a.start, a.end - b.start


def alternatives(writes: list[TrueWrite], window: float,
                 tolerance: float = TOLERANCE) -> list[frozenset]:
    """Every set of collisions the truth allows for the saves of one path (one job run)."""
    writes = sorted(writes, key=lambda w: w.start)
    certain, choices = [], []
    for a, b in itertools.combinations(writes, 2):
        if a.writer == b.writer:
            continue
        m = margins(a, b)
        if min(m) > tolerance:
            certain.append((a.save, b.save))
        elif min(m) >= -tolerance:
            choices.append((a.save, b.save))
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"{len(choices)} ambiguous pairs on one path: too many to enumerate")
    found: set = set()
    for picked in itertools.product((False, True), repeat=len(choices)):
        edges = certain + [pair for pair, on in zip(choices, picked) if on]
        groups = _groups(writes, edges)
        for outcome in _outcomes(groups, window, tolerance, len(choices)):
            found.add(outcome)
    return sorted(found, key=lambda alt: sorted(map(repr, alt)))


def _groups(writes: list[TrueWrite], edges) -> list[list[TrueWrite]]:
    parent = {w.save: w.save for w in writes}

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[root(a)] = root(b)
    groups: dict = {}
    for w in writes:
        groups.setdefault(root(w.save), []).append(w)
    return sorted(groups.values(), key=lambda g: min(w.start for w in g))


def _outcomes(groups, window: float, tolerance: float, used: int):
    """The collision sets of one grouping, over every choice at the window's edge."""
    # Which solo-to-solo gaps are at the window's edge (the walk of _collisions).
    edge = []
    prev = None
    for i, group in enumerate(groups):
        if len({w.writer for w in group}) >= 2:
            prev = None
            continue
        if prev is not None:
            gap = min(w.start for w in group) - max(w.end for w in prev)
            if abs(gap - window) <= tolerance:
                edge.append(i)
        prev = group
    if used + len(edge) > MAX_CHOICES:
        raise ValueError("too many choices at the window's edge to enumerate")
    for picked in itertools.product((False, True), repeat=len(edge)):
        linked_at_edge = {i for i, on in zip(edge, picked) if on}
        yield _collisions(groups, window, tolerance, set(edge), linked_at_edge)


def _collisions(groups, window, tolerance, edge: set, linked_at_edge: set) -> frozenset:
    out = []
    chain: list = []

    def close():
        writers = {w.writer for g in chain for w in g}
        if len(writers) >= 2:
            out.append(_redundant(chain))

    for i, group in enumerate(groups):
        if len({w.writer for w in group}) >= 2:
            close()
            chain = []
            out.append(Expected(CONCURRENT, frozenset(w.save for w in group)))
            continue
        if chain:
            gap = min(w.start for w in group) - max(w.end for w in chain[-1])
            linked = (i in linked_at_edge) if i in edge else gap <= window
            if linked:
                chain.append(group)
                continue
            close()
        chain = [group]
    if chain:
        close()
    return frozenset(out)


def _redundant(chain) -> Expected:
    saves = [w for g in chain for w in g]
    first = saves[0].writer
    lead = 0
    while lead < len(saves) and saves[lead].writer == first:
        lead += 1
    # saves[:lead] are the first writer's; all but the last of them may have been forgotten.
    optional = frozenset(w.save for w in saves[:lead - 1])
    return Expected(REDUNDANT, frozenset(w.save for w in saves) - optional, optional)
