"""Issue 16 item 1: every agent's verdicts checked against ground truth (tests/support/
groundtruth). A simulated two-node job (2 ranks per node, the job's real TCPStore, one real
agent per node, real writer processes under `ckptwatch run`) runs a fixed-seed randomized
schedule; the checker compares both agents' journals and /metrics with the writers' true
intervals, within the stated tolerance (groundtruth.expect.TOLERANCE).

The CI batch (test_fixed_seed_batch_every_agent_tells_the_truth): seed 70's 8 node-local
rounds (every shape; writers that stay, exit, os._exit, die of SIGTERM or SIGKILL right after
saving, mostly as children forked for the save as multiprocessing does, and three SIGKILLed
while they write; a path written again by a later round), a rank's own process SIGKILLed
while it writes around another's save (a defect this checker found), and the cross-node rounds
that pass today: 21 saves, 71 s on the 2-CPU build machine at load 20 (most of it the torch
imports of 4 + 1 writer processes). Cross-node saves right before their process dies (os._exit,
SIGKILL) are the second test; bench/groundtruth.py runs many seeds, quiet and under load.
"""
from __future__ import annotations

import dataclasses

import pytest

from groundtruth.schedule import (EXIT, KILLED, LARGE, MEDIUM, OS_EXIT, SEQUENTIAL, SIGKILL,
                                  STAGGERED, TOGETHER, Profile, Round, Save, Schedule,
                                  make_schedule)
from groundtruth.trial import run_trial
from helpers import remove_tree, short_tmpdir

pytestmark = pytest.mark.torch

PROFILE = Profile(nodes=("node-a", "node-b"), local_world=2, rounds=8, p_shared=0.0,
                  p_exit=0.4, p_killed=0.25, p_fork=0.8)
SEED = 70
A0, A1, B0, B1 = ("node-a", 0), ("node-a", 1), ("node-b", 0), ("node-b", 1)

# Found by the checker (seen failing before the fix in monitor/detect + monitor/ingest): a
# writer SIGKILLed while it writes, after another writer's whole save began and ended inside
# its interval, was closed as lost at its start (duration 0) and the pair called redundant.
KILLED_AROUND_ANOTHER = Round(STAGGERED, "node-a/killed-around.pt",
                              (Save(A0, LARGE, KILLED), Save(A1, MEDIUM, delay=0.1)))

# Cross-node rounds (paths on storage marked shared) that every agent gets right today.
CROSS_NODE_PASSING = (
    # Three writers of two nodes in flight at once: one concurrent collision, the same id and
    # writers on both agents.
    Round(TOGETHER, "shared/x0.pt", (Save(A0), Save(B0), Save(B1))),
    # One node's save, then another node's 0.8 s later: redundant on both agents.
    Round(SEQUENTIAL, "shared/x1.pt", (Save(B1), Save(A1, delay=0.8))),
)
# Not here, flaky under load (passed twice, failed once at load 20: node-b missed the
# concurrent collision): two nodes' ranks saving at once whose processes then end normally
# (atexit runs; job scope waits a fixed 1 s for the other ranks' ends, issue 16 item 3).
# Neither passing nor failing every time, it can be neither in this batch nor a strict xfail;
# bench/groundtruth.py draws such rounds (shared storage, EXIT) among its seeds.
CROSS_NODE_FLAKY = Round(TOGETHER, "shared/x2.pt", (Save(A1, exit=EXIT), Save(B0, exit=EXIT)))

# Cross-node rounds whose saves end their process right after them without atexit (os._exit,
# SIGKILL): the process announced its write in the store but reads nothing, so its node's agent
# reads the store itself for it (monitor/agent/storereader.py). Each failed on main at d0526c2
# (job scope v2): y0 (A0 lives, B0 SIGKILLed after its save) and y1 (both os._exit): the agent
# of the node whose writer died missed the concurrent collision; y3 (B1, then A0 1.2 s later
# SIGKILLed after its save, then A1 1.2 s later): node-b missed the redundant chain {B1, A0,
# A1} -- B1's path names its rank (y3.pt, rank 3), so its job scope read the log once at its
# end and never heard of the later writes; it now reads once more a window after its end.
CROSS_NODE_DYING = (
    # A0's 4 MiB save outlasts the start skew of a loaded machine, so y0 truly overlaps.
    Round(TOGETHER, "shared/y0.pt", (Save(A0, MEDIUM), Save(B0, exit=SIGKILL))),
    Round(TOGETHER, "shared/y1.pt", (Save(A1, exit=OS_EXIT), Save(B1, exit=OS_EXIT))),
    Round(SEQUENTIAL, "shared/y3.pt", (Save(B1), Save(A0, delay=1.2, exit=SIGKILL),
                                       Save(A1, delay=1.2))),
)


@pytest.fixture
def workdir():
    path = short_tmpdir("cwgt")
    yield path
    remove_tree(path)


def assert_truthful(result) -> None:
    verdict = result.verdict
    assert verdict.ok, (f"{len(verdict.mismatches)} mismatch(es) in {result.seconds:.0f}s "
                        f"(job {result.job}):\n" + "\n".join(verdict.mismatches))
    # The batch judged something: the checker saw both kinds on both agents.
    for node in result.schedule.profile.nodes:
        for kind in ("concurrent", "redundant"):
            assert verdict.scores[(node, kind)].tp >= 1, (node, kind, verdict.scores)


def test_fixed_seed_batch_every_agent_tells_the_truth(workdir):
    base = make_schedule(SEED, PROFILE)
    schedule = dataclasses.replace(
        base, rounds=base.rounds + (KILLED_AROUND_ANOTHER,) + CROSS_NODE_PASSING)
    assert_truthful(run_trial(schedule, workdir))


def test_cross_node_saves_right_before_a_process_dies_are_on_every_agent(workdir):
    rounds = CROSS_NODE_DYING
    schedule = Schedule(0, dataclasses.replace(PROFILE, rounds=len(rounds)), rounds)
    result = run_trial(schedule, workdir)
    assert result.verdict.ok, "\n".join(result.verdict.mismatches)
    # Every round is in a collision on both agents, of the kind the true intervals say (the
    # verdict above): y3 is a redundant chain; y0 and y1 start together, and y1's two small
    # saves may truly not overlap on a loaded machine (then redundant, seen 1 run in 12), so
    # the test counts collisions of either kind and needs at least y0 concurrent.
    for node in PROFILE.nodes:
        scores = result.verdict.scores
        assert scores[(node, "concurrent")].tp + scores[(node, "redundant")].tp == 3, scores
        assert scores[(node, "concurrent")].tp >= 1, scores
