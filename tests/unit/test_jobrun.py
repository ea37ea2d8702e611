"""ckptwatch.jobrun: one job run's identity, and every user of it agreeing on the tricky cases.

The users: the detector's redundant-write chains and job-scope collision ids
(monitor.detect.model.Writer.run_key), the agent's hazard deduplication
(monitor.agent.jobreports), the store keys of the hook's job scope (ckptwatch.jobkeys.run_prefix).
"""
from __future__ import annotations

import itertools

import pytest

from ckptwatch.jobrun import job_run
from ckptwatch.jobkeys import run_prefix
from monitor.agent.jobreports import JobScopeEvents
from monitor.detect.model import Writer

# (job, master, restart): no job id, torchrun's static "none", named jobs; with and without a
# master; restart counts unknown, 0 and 1.
JOBS = (None, "none", "j1", "j2")
MASTERS = (None, "10.0.0.1:29500", "10.0.0.2:29500")
RESTARTS = (None, 0, 1)
RUNS = list(itertools.product(JOBS, MASTERS, RESTARTS))


def ident(job, master, restart, pid=100) -> dict:
    return {"node": "n1", "pid": pid, "rank": 0, "local_rank": 0, "world_size": 4,
            "local_world_size": 2, "node_rank": 0, "job": job, "master": master,
            "restart": restart}


def same_run(a, b) -> bool:
    return job_run(*a) is not None and job_run(*a) == job_run(*b)


@pytest.mark.parametrize("job, master, restart, expected", [
    (None, None, 0, None),                              # nothing names it
    ("none", None, 0, None),                            # static rendezvous, no master
    (None, "h:1", 0, (None, "h:1", 0)),                 # no job id: the master names it
    ("none", "h:1", 0, ("none", "h:1", 0)),
    ("j1", "h:1", 0, ("j1", None, 0)),                  # a job id names it alone
    ("j1", None, None, ("j1", None, None)),
])
def test_a_run_is_its_job_id_and_restart_or_the_master_where_the_id_does_not_name_it(
        job, master, restart, expected):
    assert job_run(job, master, restart) == expected


def test_the_detector_sees_the_same_runs():
    for a, b in itertools.product(RUNS, repeat=2):
        ka, kb = Writer(**ident(*a)).run_key, Writer(**ident(*b)).run_key
        assert (ka is not None and ka == kb) == same_run(a, b), (a, b)


def test_hazards_are_deduplicated_per_run_exactly_when_it_is_the_same_run():
    for a, b in itertools.product(RUNS, repeat=2):
        reports = JobScopeEvents()
        first = dict(ident(*a, pid=100), type="hazard", kind="local_rank_guard", seq=1,
                     path="/shared/last.pt", shared="mount:nfs4", wall=1.0)
        second = dict(ident(*b, pid=200), type="hazard", kind="local_rank_guard", seq=1,
                      path="/shared/last.pt", shared="mount:nfs4", wall=2.0)
        assert reports.hazard(first) is not None
        assert (reports.hazard(second) is None) == same_run(a, b), (a, b)


def test_job_scope_store_keys_are_shared_exactly_when_it_is_the_same_run():
    # Job scope starts only with MASTER_ADDR and MASTER_PORT set: every run it names has a
    # master, so a run without one never reaches run_prefix.
    with_master = [run for run in RUNS if run[1] is not None]
    for a, b in itertools.product(with_master, repeat=2):
        assert (run_prefix(ident(*a)) == run_prefix(ident(*b, pid=200))) == same_run(a, b), \
            (a, b)


def test_the_store_prefix_of_a_run_is_what_it_was_before_the_one_definition():
    # The run's digest has not moved since the one definition (f"{job}\0{master or None}\0
    # {restart}"); the layout version before it (2: per-path write logs) keeps ranks of an
    # older layout out of the keys of this one (docs/decisions.md, "Job scope v2").
    import hashlib
    for job, master, restart in RUNS:
        if master is None:
            continue
        kept = master if job in (None, "none") else None
        text = f"{job}\0{kept}\0{restart}".encode()
        assert run_prefix(ident(job, master, restart)) == \
            "/ckptwatch/2/" + hashlib.sha1(text).hexdigest()[:16]
