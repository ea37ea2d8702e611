"""The ground-truth checker itself (tests/support/groundtruth: expect, compare), on hand-made
truths and reports: it must catch every kind of wrong report, and allow exactly what its
stated tolerance allows."""
from __future__ import annotations

import pytest

from groundtruth.compare import Observed, check
from groundtruth.expect import (CONCURRENT, REDUNDANT, TOLERANCE, Expected, alternatives)
from groundtruth.schedule import Profile, make_schedule
from groundtruth.truth import LOST, OK, TrueWrite

WINDOW = 2.0
T0 = 1_800_000_000.0


def tw(save, start, end, node="node-a", pid=None, path="/ckpt/last.pt", outcome=OK):
    return TrueWrite(save, node, pid or 1000 + int(save[1:]), 0, path, T0 + start, T0 + end,
                     outcome)


def entry(w: TrueWrite, outcome=None):
    return {"node": w.node, "pid": w.pid, "path": w.path, "start_wall": w.start + 0.0001,
            "outcome": outcome or ("lost" if w.outcome == LOST else w.outcome)}


def collision(kind, writes, cid="c1", **over):
    first, last = min(writes, key=lambda w: w.start), max(writes, key=lambda w: w.end)
    return {"type": "collision", "id": cid, "kind": kind, "path": writes[0].path,
            "scope": "node", "writers": [entry(w) for w in writes],
            "first": {"node": first.node, "pid": first.pid},
            "last": {"node": last.node, "pid": last.pid}, **over}


def observed(node, collisions, truth, **metric):
    counts = {CONCURRENT: 0, REDUNDANT: 0}
    for c in collisions:
        counts[c["kind"]] += 1
    counts.update(metric)
    return Observed(node, collisions, [dict(entry(w), type="write") for w in truth
                                       if w.node == node], counts)


def run_check(truth, *obs):
    return check(truth, list(obs), shared=lambda p: p.startswith("/shared/"), window=WINDOW)


# ---- expect: what the truth allows -----------------------------------------------------

def test_overlap_beyond_tolerance_is_one_concurrent_group_with_every_writer():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2), tw("s3", 1.9, 3)]      # s1-s2, s2-s3 overlap
    assert alternatives(truth, WINDOW) == [frozenset({
        Expected(CONCURRENT, frozenset({"s1", "s2", "s3"}))})]


def test_sequential_saves_within_the_window_are_one_redundant_chain():
    truth = [tw("s1", 0, 0.1), tw("s2", 1.0, 1.1), tw("s3", 2.5, 2.6)]
    assert alternatives(truth, WINDOW) == [frozenset({
        Expected(REDUNDANT, frozenset({"s1", "s2", "s3"}))})]


def test_a_gap_beyond_the_window_breaks_the_chain_and_a_solo_save_is_nothing():
    truth = [tw("s1", 0, 0.1), tw("s2", 2.5, 2.6)]
    assert alternatives(truth, WINDOW) == [frozenset()]


def test_a_concurrent_group_breaks_a_chain():
    truth = [tw("s1", 0, 0.1), tw("s2", 0.5, 1.0), tw("s3", 0.6, 1.1), tw("s4", 1.5, 1.6)]
    assert alternatives(truth, WINDOW) == [frozenset({
        Expected(CONCURRENT, frozenset({"s2", "s3"}))})]


def test_the_same_process_saving_again_is_not_redundant_and_its_older_saves_are_optional():
    truth = [tw("s1", 0, 0.1, pid=7), tw("s2", 0.5, 0.6, pid=7)]
    assert alternatives(truth, WINDOW) == [frozenset()]
    truth.append(tw("s3", 1.0, 1.1, pid=8))
    assert alternatives(truth, WINDOW) == [frozenset({
        Expected(REDUNDANT, frozenset({"s2", "s3"}), frozenset({"s1"}))})]


def test_an_overlap_or_gap_within_the_tolerance_may_be_called_either_way():
    short = TOLERANCE / 2
    for second_start in (1 - short, 1 + short):       # a short overlap, a short gap
        truth = [tw("s1", 0, 1), tw("s2", second_start, 2)]
        assert set(alternatives(truth, WINDOW)) == {
            frozenset({Expected(CONCURRENT, frozenset({"s1", "s2"}))}),
            frozenset({Expected(REDUNDANT, frozenset({"s1", "s2"}))})}


def test_a_gap_within_the_tolerance_of_the_window_may_link_or_not():
    truth = [tw("s1", 0, 0.1), tw("s2", 0.1 + WINDOW + TOLERANCE / 2, 3)]
    assert set(alternatives(truth, WINDOW)) == {
        frozenset(), frozenset({Expected(REDUNDANT, frozenset({"s1", "s2"}))})}


# ---- compare: agents' reports against the truth ----------------------------------------

def test_the_right_report_passes_and_scores_one_true_positive():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2)]
    verdict = run_check(truth, observed("node-a", [collision(CONCURRENT, truth)], truth))
    assert verdict.ok, verdict.mismatches
    assert verdict.scores[("node-a", CONCURRENT)].tp == 1
    assert verdict.scores[("node-a", CONCURRENT)].precision == 1.0


def test_a_missed_collision_is_a_mismatch():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2)]
    verdict = run_check(truth, observed("node-a", [], truth))
    assert len(verdict.mismatches) == 1 and "missed concurrent" in verdict.mismatches[0]
    assert verdict.scores[("node-a", CONCURRENT)].recall == 0.0


def test_a_false_alarm_is_a_mismatch():
    truth = [tw("s1", 0, 1), tw("s2", 1.5, 2, pid=1001)]     # one process: nothing
    verdict = run_check(truth, observed("node-a", [collision(REDUNDANT, truth)], truth))
    assert any("false redundant" in m for m in verdict.mismatches), verdict.mismatches
    assert verdict.scores[("node-a", REDUNDANT)].precision == 0.0


def test_the_wrong_kind_a_writer_left_out_and_a_split_group_are_mismatches():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2), tw("s3", 1.5, 3)]
    for report in ([collision(REDUNDANT, truth)],
                   [collision(CONCURRENT, truth[:2])],
                   [collision(CONCURRENT, truth[:2]), collision(CONCURRENT, truth[1:], "c2")]):
        assert not run_check(truth, observed("node-a", report, truth)).ok, report


def test_a_collision_reported_twice_is_a_mismatch():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2)]
    twice = [collision(CONCURRENT, truth), collision(CONCURRENT, truth, "c2")]
    assert any("twice" in m for m in run_check(truth, observed("node-a", twice, truth)).mismatches)


def test_a_killed_writer_must_be_in_its_collision_as_lost():
    truth = [tw("s1", 0, 1, outcome=LOST), tw("s2", 0.5, 2)]
    good = collision(CONCURRENT, truth)
    assert run_check(truth, observed("node-a", [good], truth)).ok
    wrong = collision(CONCURRENT, truth)
    wrong["writers"][0]["outcome"] = "ok"
    assert any("outcome" in m for m in run_check(truth, observed("node-a", [wrong], truth))
               .mismatches)


def test_a_save_not_journaled_and_metrics_that_disagree_are_mismatches():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2)]
    obs = observed("node-a", [collision(CONCURRENT, truth)], truth)
    obs.writes = obs.writes[:1]
    assert any("not journaled" in m for m in run_check(truth, obs).mismatches)
    obs = observed("node-a", [collision(CONCURRENT, truth)], truth, concurrent=0)
    assert any("/metrics" in m for m in run_check(truth, obs).mismatches)


def test_cross_node_collision_required_on_every_involved_agent_with_one_id():
    truth = [tw("s1", 0, 1, node="node-a", path="/shared/x.pt"),
             tw("s2", 0.5, 2, node="node-b", path="/shared/x.pt")]
    a = observed("node-a", [collision(CONCURRENT, truth, "j1")], truth)
    b = observed("node-b", [collision(CONCURRENT, truth, "j1")], truth)
    assert run_check(truth, a, b).ok
    assert not run_check(truth, a, observed("node-b", [], truth)).ok
    other_id = observed("node-b", [collision(CONCURRENT, truth, "j2")], truth)
    assert any("ids" in m for m in run_check(truth, a, other_id).mismatches)


def test_two_agents_each_within_the_tolerance_but_telling_two_stories_is_a_mismatch():
    """An overlap shorter than the tolerance may be called concurrent or redundant -- but
    every agent must call it the same (issue 16: a Lightning job, two agents, two stories)."""
    short = TOLERANCE / 2
    truth = [tw("s1", 0, 1, node="node-a", path="/shared/x.pt"),
             tw("s2", 1 - short, 2, node="node-b", path="/shared/x.pt")]
    concurrent = [collision(CONCURRENT, truth, "j1")]
    redundant = [collision(REDUNDANT, truth, "j1")]
    assert run_check(truth, observed("node-a", concurrent, truth),
                     observed("node-b", concurrent, truth)).ok
    assert run_check(truth, observed("node-a", redundant, truth),
                     observed("node-b", redundant, truth)).ok
    verdict = run_check(truth, observed("node-a", concurrent, truth),
                        observed("node-b", redundant, truth))
    assert [m for m in verdict.mismatches if "two stories" in m], verdict.mismatches


def test_on_shared_storage_an_uninvolved_agent_may_report_a_true_collision_only():
    truth = [tw("s1", 0, 1, node="node-a", path="/shared/x.pt"),
             tw("s2", 0.5, 2, node="node-a", path="/shared/x.pt")]
    a = observed("node-a", [collision(CONCURRENT, truth)], truth)
    assert run_check(truth, a, observed("node-b", [collision(CONCURRENT, truth)], truth)).ok
    wrong = observed("node-b", [collision(REDUNDANT, truth)], truth)
    assert not run_check(truth, a, wrong).ok


# ---- schedule: reproducible ---------------------------------------------------------------

def test_a_seed_gives_the_same_schedule_and_covers_every_shape_and_exit():
    profile = Profile(rounds=40)
    assert make_schedule(5, profile) == make_schedule(5, profile)
    assert make_schedule(5, profile) != make_schedule(6, profile)
    rounds = make_schedule(5, profile).rounds
    assert {r.shape for r in rounds} == {"together", "staggered", "sequential"}
    assert {s.exit for r in rounds for s in r.saves} >= {"stay", "exit", "os_exit", "sigterm",
                                                         "sigkill", "killed"}
    assert any(r.shared for r in rounds) and any(not r.shared for r in rounds)
    assert len({r.path for r in rounds}) < len(rounds)      # some rounds reuse a path


@pytest.mark.parametrize("seed", range(20))
def test_every_schedule_stays_within_what_the_checker_can_enumerate(seed):
    for rnd in make_schedule(seed, Profile(rounds=30)).rounds:
        assert 2 <= len(rnd.saves) <= 3
        assert len({s.slot for s in rnd.saves}) == len(rnd.saves)


def test_a_short_save_wholly_inside_a_long_one_is_an_overlap_whatever_its_length():
    # s2 lasts 20 ms, well inside s1: its start and end are far from s1's.
    truth = [tw("s1", 0, 0.2), tw("s2", 0.1, 0.12)]
    assert alternatives(truth, WINDOW) == [frozenset({
        Expected(CONCURRENT, frozenset({"s1", "s2"}))})]


def test_the_wrong_last_writer_is_a_mismatch_unless_within_the_tolerance():
    truth = [tw("s1", 0, 1), tw("s2", 0.5, 2)]
    wrong = collision(CONCURRENT, truth, last={"node": "node-a", "pid": truth[0].pid})
    assert any("last names" in m for m in
               run_check(truth, observed("node-a", [wrong], truth)).mismatches)
    close = [tw("s1", 0, 1.99), tw("s2", 0.5, 2)]
    either = collision(CONCURRENT, close, last={"node": "node-a", "pid": close[0].pid})
    assert run_check(close, observed("node-a", [either], close)).ok
