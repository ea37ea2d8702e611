"""monitor.agent.jobreports: hazard events from local hooks become Findings."""
from __future__ import annotations

from ckptwatch import events
from ckptwatch.events import WRITER_FIELDS
from monitor.agent.jobreports import JobScopeEvents
from monitor.detect.model import FINDING_HAZARD, Finding, Writer

IDENTITY = {"node": "n2", "pid": 11, "rank": 2, "local_rank": 0, "world_size": 4,
            "local_world_size": 2, "node_rank": 1, "job": "j1", "master": "10.0.0.1:29500",
            "restart": 3}


def hazard(**over) -> dict:
    event = {"v": events.SCHEMA_VERSION, "type": "hazard", "kind": "local_rank_guard",
             "seq": 1, "path": "/shared/last.pt", "shared": "mount:nfs4", "wall": 1.0,
             "ranks": [0, 2], "nodes": ["n1", "n2"], "site": "train.py:42",
             "func": "save_checkpoint", **IDENTITY}
    event.update(over)
    return events.validate(event)


def test_a_hazard_finding_keeps_every_writer_field():
    assert set(IDENTITY) == set(WRITER_FIELDS)      # every field, each with its own value
    finding = JobScopeEvents().hazard(hazard())
    assert finding.kind == FINDING_HAZARD
    writer = finding.writers[0]
    assert {name: writer[name] for name in WRITER_FIELDS} == IDENTITY
    assert (writer["site"], writer["func"]) == ("train.py:42", "save_checkpoint")
    assert Writer.from_event(writer) == Writer(**IDENTITY)
    # ... and so does its journal record, read back.
    again = Finding.from_record(finding.to_record())
    assert Writer.from_event(again.writers[0]) == Writer(**IDENTITY)


def test_a_hazard_is_reported_once_per_run_path_and_kind():
    reports = JobScopeEvents()
    assert reports.hazard(hazard()) is not None
    assert reports.hazard(hazard(pid=12, rank=3)) is None               # the same run
    assert reports.hazard(hazard(kind="shared_storage_multi_writer")) is not None
    assert reports.hazard(hazard(path="/shared/other.pt")) is not None
    assert reports.hazard(hazard(restart=4)) is not None                # a new run


def test_the_local_rank_guard_is_not_named_when_another_local_rank_writes_the_path():
    """A hook without the job's store judges the local_rank == 0 guard on its own write; the
    agent, which sees every local writer, drops it when another local rank of the same run
    writes the path too: every rank writes, there is no guard to fix (issue 16)."""
    reports = JobScopeEvents()
    event = hazard()
    peer = Writer(**dict(IDENTITY, pid=12, rank=3, local_rank=1))
    other_run = Writer(**dict(IDENTITY, pid=13, rank=3, local_rank=1, restart=9))
    itself = Writer(**IDENTITY)
    assert reports.not_this_bug(event, [itself, peer]) is True
    assert reports.guard_contradicted == 1
    assert reports.not_this_bug(event, [itself, other_run]) is False
    assert reports.not_this_bug(event, [itself]) is False
    # The other hazard is about several ranks writing: never contradicted by that.
    assert reports.not_this_bug(hazard(kind="shared_storage_multi_writer"), [peer]) is False
