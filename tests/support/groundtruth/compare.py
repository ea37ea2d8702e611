"""The checker: every agent's journal and /metrics against the truth (groundtruth.expect).

For each agent (one per simulated node) and each path:
- required: every collision the truth calls for that names a writer of the agent's node (a
  node-local path is written by its node's writers only; a path on shared storage by any
  node's, and every node with a writer in a collision must report it, learnt through job
  scope);
- permitted besides: on shared storage, a true collision of other nodes' writers that the
  agent learnt of through job scope (true, so no false alarm);
- the agent's collisions on the path must be exactly the required ones plus permitted ones,
  for one of the alternatives the tolerance allows, each once, naming the saves it must;
- every writer named in a collision has the truth's outcome ("lost" for a save killed while it
  wrote, "ok" otherwise), and its "first" and "last" writers are the truth's (within the
  tolerance);
- every save of the node is journaled as a write, with that outcome;
- one collision, one id: every agent reporting a collision gives it the same id;
- one story: two agents' collisions on one path that name a save in common are the same
  collision (kind, saves, id) -- each agent may match another of the tolerance's
  alternatives only if no other agent said otherwise about the same saves;
- /metrics: ckptwatch_collisions_total of the job, per kind, equals the journal's count.

Mismatches are plain strings naming the seed, the agent, the path and what differs.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from groundtruth.expect import KINDS, TOLERANCE, Expected, alternatives
from groundtruth.truth import LOST, TrueWrite

# A hook's wall clock reads sit inside the truth's interval; this much slack for the float
# conversions on the way (the hook sends time.time(), the truth logs time.time_ns()).
_CLOCK_SLACK = 0.002


@dataclass
class Observed:
    """What one agent said: its job's collision and write records and its metric counts."""

    node: str
    collisions: list[dict]
    writes: list[dict]
    metric_counts: dict[str, float]       # kind -> ckptwatch_collisions_total of the job


@dataclass
class Score:
    """Per agent and kind: true positives, false negatives, false positives."""

    tp: int = 0
    fn: int = 0
    fp: int = 0

    def add(self, other: "Score") -> None:
        self.tp += other.tp
        self.fn += other.fn
        self.fp += other.fp

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0


@dataclass
class Verdict:
    mismatches: list[str] = field(default_factory=list)
    scores: dict = field(default_factory=dict)       # (node, kind) -> Score
    # (node, kind, "shared" | "local") -> Score: paths on shared storage apart
    scores_by_storage: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def save_of(entry: dict, truth: list[TrueWrite]) -> TrueWrite | None:
    """The true save a journaled writer entry (or write record) stands for: same node, pid
    and path, its start inside the true interval."""
    best = None
    for w in truth:
        if (w.node, w.pid, w.path) != (entry.get("node"), entry.get("pid"), entry.get("path")):
            continue
        start = entry.get("start_wall")
        if start is not None and w.start - _CLOCK_SLACK <= start <= w.end + _CLOCK_SLACK:
            if best is None or abs(start - w.start) < abs(start - best.start):
                best = w
    return best


def check(truth: list[TrueWrite], observed: list[Observed], shared: callable,
          window: float, tolerance: float = TOLERANCE, label: str = "") -> Verdict:
    """shared(path) -> is the path on storage marked shared."""
    verdict = Verdict()
    by_save = {w.save: w for w in truth}
    by_path: dict[str, list[TrueWrite]] = defaultdict(list)
    for w in truth:
        by_path[w.path].append(w)
    alts = {path: alternatives(ws, window, tolerance) for path, ws in by_path.items()}
    ids: dict = defaultdict(dict)       # frozenset(saves) of a required collision -> node -> id
    told: dict = defaultdict(dict)      # path -> node -> {(kind, saves, id)}: _two_stories

    def bad(node, path, text):
        verdict.mismatches.append(f"{label}{node} {path}: {text}")

    for obs in observed:
        for kind in KINDS:
            verdict.scores[(obs.node, kind)] = Score()
        _check_writes(obs, truth, bad)
        reported: dict[str, list] = defaultdict(list)
        for rec in obs.collisions:
            saves, unknown = [], []
            for entry in rec["writers"]:
                w = save_of(entry, truth)
                if w is None:
                    unknown.append(entry)
                    continue
                saves.append(w.save)
                want = "lost" if w.outcome == LOST else w.outcome
                if entry.get("outcome") != want:
                    bad(obs.node, rec["path"], f"collision {rec['id']} names save {w.save} "
                        f"(pid {w.pid}) with outcome {entry.get('outcome')!r}, truth {want!r}")
            if unknown:
                bad(obs.node, rec["path"], f"collision {rec['id']} names writes no writer "
                    f"made: {[(e.get('node'), e.get('pid'), e.get('start_wall')) for e in unknown]}")
            reported[rec["path"]].append((rec["kind"], frozenset(saves), rec))
            told[rec["path"]].setdefault(obs.node, set()).add(
                (rec["kind"], frozenset(saves), rec["id"]))
        for path in set(by_path) | set(reported):
            got = reported.get(path, [])
            options = alts.get(path, [frozenset()])
            best = min((_score(obs.node, path, alt, got, shared(path), by_save)
                        for alt in options), key=lambda s: (s[0], -s[1]))
            problems, _, scores, matched = best
            storage = "shared" if shared(path) else "local"
            for kind, score in scores.items():
                verdict.scores[(obs.node, kind)].add(score)
                verdict.scores_by_storage.setdefault((obs.node, kind, storage),
                                                     Score()).add(score)
            for text in problems:
                bad(obs.node, path, text)
            for exp, rec in matched:
                ids[(path, exp.kind, exp.required)][obs.node] = rec["id"]
                for text in _first_and_last(rec, [by_save[s] for s in exp.required],
                                            tolerance):
                    bad(obs.node, path, f"collision {rec['id']}: {text}")
        counts = defaultdict(int)
        for rec in obs.collisions:
            counts[rec["kind"]] += 1
        for kind in KINDS:
            if int(obs.metric_counts.get(kind) or 0) != counts[kind]:
                bad(obs.node, "/metrics", f"ckptwatch_collisions_total{{kind={kind!r}}} = "
                    f"{obs.metric_counts.get(kind)}, journal has {counts[kind]}")
    for (path, kind, saves), per_node in ids.items():
        if len(set(per_node.values())) > 1:
            verdict.mismatches.append(f"{label}{path}: one {kind} collision "
                                      f"{sorted(saves)} has ids {per_node}")
    verdict.mismatches += [label + text for text in _two_stories(told)]
    return verdict


def _two_stories(told: dict) -> list[str]:
    """Pairs of agents whose collisions on a path share a save but differ in kind, saves or
    id (design.md: every agent tells the same story). told: path -> node -> {(kind, saves,
    id)}."""
    out = []
    for path, by_node in told.items():
        for a, b in itertools.combinations(sorted(by_node), 2):
            for ca, cb in itertools.product(by_node[a], by_node[b]):
                if ca != cb and ca[1] & cb[1]:
                    out.append(f"{path}: two stories, {a} {ca[0]} {sorted(ca[1])} {ca[2]}, "
                               f"{b} {cb[0]} {sorted(cb[1])} {cb[2]}")
    return out


def _score(node: str, path: str, alt: frozenset, got: list, shared: bool, by_save):
    """(problems, matched count, scores by kind, [(Expected, record)]) of the agent's
    collisions `got` on `path` against one alternative."""
    required = [e for e in alt if any(by_save[s].node == node for s in e.required)]
    permitted = [e for e in alt if e not in required] if shared else []
    problems: list[str] = []
    scores = {kind: Score() for kind in KINDS}
    matched = []
    left = list(got)
    for exp in required:
        hits = [g for g in left if exp.matches(g[0], g[1])]
        if not hits:
            scores[exp.kind].fn += 1
            problems.append(f"missed {exp.kind} collision of saves {_names(exp, by_save)}")
            continue
        scores[exp.kind].tp += 1
        matched.append((exp, hits[0][2]))
        left.remove(hits[0])
        for extra in hits[1:]:
            left.remove(extra)
            scores[exp.kind].fp += 1
            problems.append(f"{exp.kind} collision of saves {_names(exp, by_save)} reported "
                            f"twice (id {extra[2]['id']})")
    for kind, saves, rec in left:
        if any(e.matches(kind, saves) for e in permitted):
            continue
        scores[kind].fp += 1
        problems.append(f"false {kind} collision {rec['id']} of saves {sorted(saves)} "
                        f"(scope {rec.get('scope')}; truth allows "
                        f"{[(e.kind, sorted(e.required)) for e in alt] or 'nothing'})")
    return problems, len(matched), scores, matched


def _first_and_last(rec: dict, saves: list[TrueWrite], tolerance: float) -> list[str]:
    """The record's "first" and "last" writers (who started first; who finished last, whose
    bytes are on disk) are the truth's, or within the tolerance of it."""
    problems = []
    for field_, pick, of in (("first", min, lambda w: w.start), ("last", max, lambda w: w.end)):
        named = rec.get(field_) or {}
        best = of(pick(saves, key=of))
        allowed = {(w.node, w.pid) for w in saves if abs(of(w) - best) <= tolerance}
        if (named.get("node"), named.get("pid")) not in allowed:
            problems.append(f"{field_} names {named.get('node')} pid {named.get('pid')}, "
                            f"truth {sorted(allowed)}")
    return problems


def _names(exp: Expected, by_save) -> str:
    return ", ".join(f"{s}({by_save[s].node} pid {by_save[s].pid} "
                     f"{by_save[s].start:.3f}-{by_save[s].end:.3f} {by_save[s].outcome})"
                     for s in sorted(exp.required))


def _check_writes(obs: Observed, truth: list[TrueWrite], bad) -> None:
    """Every save of the agent's node is journaled as a write with the truth's outcome."""
    mine = [w for w in truth if w.node == obs.node]
    journaled = {}
    for rec in obs.writes:
        w = save_of(rec, mine)
        if w is not None:
            journaled[w.save] = rec
    for w in mine:
        rec = journaled.get(w.save)
        want = "lost" if w.outcome == LOST else w.outcome
        if rec is None:
            bad(obs.node, w.path, f"save {w.save} (pid {w.pid}, {w.outcome}) not journaled")
        elif rec.get("outcome") != want:
            bad(obs.node, w.path, f"save {w.save} (pid {w.pid}) journaled {rec.get('outcome')!r},"
                f" truth {want!r}")
