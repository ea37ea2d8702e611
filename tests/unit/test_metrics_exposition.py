"""The agent's whole /metrics exposition, pinned: every family's name, type and HELP text and
every sample's name, labels and value, for an agent driven into one scripted state.

tests/fixtures/metrics_exposition.txt was recorded from the agent before its metrics moved from
one copied snapshot to per-component collectors (issue 15), so any name, label, HELP or value
that a refactoring changes fails here. Metric names are a contract (deploy/ rules and
dashboards, tests/test_deploy.py); re-record the file only for a deliberate change:
    PYTHONPATH=.:tests python -c "import test_metrics_exposition as t; t.record()"
"""
from __future__ import annotations

import os
import re
import tempfile
import time

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO_ROOT
from monitor.agent import config
from monitor.agent.daemon import Agent
from monitor.detect.model import FINDING_VERIFICATION, Finding

GOLDEN = os.path.join(REPO_ROOT, "tests", "fixtures", "metrics_exposition.txt")

# Values that depend on when the test runs, not on the agent's state: the wall time of a
# collision, and the queue wait of the loop (0 here, but a clock reading).
TIMED = {"ckptwatch_last_collision_timestamp_seconds", "ckptwatch_loop_lag_seconds",
         "ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
         "ckptwatch_last_hazard_timestamp_seconds",
         "ckptwatch_last_size_fluctuation_timestamp_seconds"}


def _event(kind, pid, seq, mono, path, job="jobA", rank=None):
    event = {"v": 1, "type": kind, "node": "n1", "pid": pid, "seq": seq, "path": path,
             "wall": 1.7e9 + mono, "mono": mono, "rank": pid % 10 if rank is None else rank,
             "job": job}
    if kind == "end":
        event.update(start_wall=1.7e9 + mono - 1.0, start_mono=mono - 1.0, outcome="ok",
                     bytes=100 + pid)
    return event


def _drive(agent: Agent, root: str) -> None:
    """One of every input the metrics count: writes, a collision, a failed write, a dropped
    report, job-scope events, filesystem and verification findings; then one loop tick."""
    now = time.monotonic()
    path = os.path.join(root, "a.pt")
    agent.hook_batch([
        _event("start", 11, 1, now - 3.0, path),
        _event("start", 12, 1, now - 2.9, path),
        _event("start", 15, 1, now - 0.5, os.path.join(root, "d.pt"), job="jobB"),
        _event("end", 11, 1, now - 2.0, path),
        _event("end", 12, 1, now - 1.9, path),
        {**_event("end", 13, 1, now - 1.5, os.path.join(root, "b.pt"), job="jobB"),
         "outcome": "OSError"},
        {"v": 1, "type": "dropped", "node": "n1", "pid": 13, "count": 4},
        {"v": 1, "type": "jobscope", "node": "n1", "pid": 11, "state": "active",
         "reason": None, "rank": 1, "job": "jobA", "master": None, "restart": None,
         "wall": 1.7e9},
        {"v": 1, "type": "hazard", "node": "n1", "pid": 12, "kind": "local_rank_guard",
         "seq": 1, "path": path, "rank": 2, "local_rank": 0, "world_size": 4,
         "node_rank": 1, "job": "jobA", "master": None, "restart": None, "site": "t.py:1",
         "func": "save", "shared": "mount:nfs4", "ranks": [0, 2], "nodes": ["n0", "n1"],
         "wall": 1.7e9},
        {"v": 1, "type": "remote", "node": "n1", "pid": 14, "seq": 9,
         "path": os.path.join(root, "c.pt"), "wall": 1.7e9,
         "writer": {"node": "n2", "pid": 99, "job": "jobA"}, "wseq": 1,
         "start_wall": 1.7e9, "end_wall": 1.7e9 + 1, "start_mono": now - 5,
         "end_mono": now - 4, "bytes": 1, "outcome": "ok", "site": None, "func": None,
         "overlap": None, "shared": None},
    ])
    agent.state.event_rejected("malformed", 2)
    agent.exporters.publish_finding(Finding("torn_read", path, "jobA"))
    agent.exporters.publish_finding(Finding("size_fluctuation", path, "jobA"))
    agent.exporters.publish_finding(Finding(FINDING_VERIFICATION, path, "jobA",
                                            details={"result": "corrupt",
                                                     "cause": "truncated"}))
    agent.tick()


def exposition() -> str:
    """The normalised exposition: one line per family (type, HELP) and per sample, sorted;
    paths of the run's temporary directory replaced by <root>, timed values by <t>."""
    with tempfile.TemporaryDirectory(prefix="ckw-expo-") as tmp:
        root = os.path.join(tmp, "ckpt")
        os.makedirs(root)
        agent = Agent.build(config.load([
            "--ingest.socket", os.path.join(tmp, "s.sock"),
            "--journal.path", os.path.join(tmp, "j.jsonl"),
            "--web.listen-address", "127.0.0.1:0", "--collision.settle", "0",
            "--watch.path", root, "--watch.attribution", "proc", "--watch.mode", "polling",
            "--node.name", "n1"]))
        try:
            _drive(agent, root)
            text = generate_latest(agent.server._registry).decode()
        finally:
            agent.journal.close()
    blocks = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("ckptwatch_"):
            continue                       # process_*: the test process's own figures
        lines = [f"{family.name} {family.type} {family.documentation!r}"]
        for s in family.samples:
            labels = ",".join(f"{k}={v!r}" for k, v in sorted(s.labels.items()))
            value = "<t>" if family.name in TIMED else repr(s.value)
            lines.append(f"  {s.name}{{{labels}}} {value}")
        blocks.append("\n".join(lines))
    # Families in name order: Prometheus reads them in any order, and each collector yields
    # its own (the order of registration is not part of the contract).
    return re.sub(re.escape(root), "<root>", "\n".join(sorted(blocks))) + "\n"


def record() -> None:
    with open(GOLDEN, "w", encoding="utf-8") as fh:
        fh.write(exposition())


def test_the_exposition_is_the_one_recorded_before_the_collectors_were_split():
    with open(GOLDEN, encoding="utf-8") as fh:
        recorded = fh.read()
    got = exposition()
    assert "ckptwatch_collisions counter" in recorded      # the recording is not empty
    assert got == recorded
