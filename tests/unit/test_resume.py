"""The agent resumes from its journal: a restarted agent exports the alerts' gauges as they
were (latest collision per series, the verdict on its file, latest corrupt checkpoint, latest
hazard and size fluctuation), journals verdicts as if it had not restarted, and reads its
journal bounded (issue 16 item 4). The same with the real agent process, Prometheus' rules and
promtool: tests/e2e/test_resume.py."""
from __future__ import annotations

import json
import os
import time

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporters.journal import read_records
from monitor.agent import config
from monitor.agent.daemon import Agent
from monitor.detect.model import FINDING_VERIFICATION, Collision, Finding, Write, Writer

# The families whose series an alert keys on (deploy/prometheus/ckptwatch-rules.yml).
ALERT_GAUGES = ("ckptwatch_last_collision_timestamp_seconds",
                "ckptwatch_last_collision_verification",
                "ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
                "ckptwatch_last_hazard_timestamp_seconds",
                "ckptwatch_last_size_fluctuation_timestamp_seconds")


def build(tmp, *extra):
    return Agent.build(config.load([
        "--ingest.socket", os.path.join(tmp, "s.sock"),
        "--journal.path", os.path.join(tmp, "j.jsonl"),
        "--web.listen-address", "127.0.0.1:0", "--node.name", "n1", *extra]))


def gauges(agent) -> dict:
    """{(family, labels): value} of the alerts' gauges, as a scrape shows them."""
    text = generate_latest(agent.server._registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in ALERT_GAUGES:
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counter(agent, name) -> float:
    text = generate_latest(agent.server._registry).decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def write(rank, path, start, job="jobA"):
    now = time.time()
    return Write(writer=Writer(node="n1", pid=100 + rank, rank=rank, job=job, restart=0),
                 path=path, seq=1, start_wall=now - 5 + start, start_mono=start,
                 end_wall=now - 4 + start, end_mono=start + 1, bytes=10, outcome="ok",
                 site="t.py:1", func="save")


def collision(path, cid, kind="concurrent", job="jobA", scope="node"):
    ws = (write(0, path, 0.0, job), write(1, path, 0.5, job))
    return Collision(path=path, kind=kind, writes=ws, scope=scope, detected_wall=time.time(),
                     id=cid)


def verdict(path, result, cause="", cid="", job="jobA"):
    return Finding(FINDING_VERIFICATION, path, job, wall=time.time(),
                   details={"result": result, "cause": cause, "collision_id": cid,
                            "format": "torch-zip", "reason": ""})


def drive(agent, tmp):
    """A concurrent collision whose file is found corrupt, a redundant one of another job
    whose file is found whole, a hazard, a size fluctuation, a torn read."""
    a, b = os.path.join(tmp, "a.pt"), os.path.join(tmp, "b.pt")
    ex = agent.exporters
    ex.publish_collision(collision(a, "c1"))
    ex.publish_finding(verdict(a, "corrupt", "torn", "c1"))
    ex.publish_collision(collision(b, "c2", kind="redundant", job="jobB", scope="job"))
    ex.publish_finding(verdict(b, "ok", job="jobB"))        # no collision_id: by its path
    ex.publish_finding(Finding("hazard", a, "jobA", wall=time.time(), node="n1",
                               source="hook", details={"hazard": "local_rank_guard",
                                                       "shared": "mount:nfs4"}))
    ex.publish_finding(Finding("size_fluctuation", a, "jobA", wall=time.time()))
    ex.publish_finding(Finding("torn_read", a, "jobA", wall=time.time()))
    agent.exporters.flush()


def test_a_restarted_agent_exports_the_alerts_gauges_as_they_were(tmp_path):
    tmp = str(tmp_path)
    first = build(tmp)
    try:
        drive(first, tmp)
        before = gauges(first)
    finally:
        first.exporters.close()
    second = build(tmp)
    try:
        after = gauges(second)
        # Counters count since this start: nothing was counted yet.
        assert counter(second, "ckptwatch_collisions_total") == 0
        assert counter(second, "ckptwatch_hazards_total") == 0
    finally:
        second.exporters.close()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] == pytest.approx(value, abs=0.01), key
    assert len(before) == 7, before    # 2 timestamps, 2 verdicts, corrupt, hazard, size
    assert ("ckptwatch_last_collision_verification",
            (("kind", "concurrent"), ("result", "corrupt"), ("scope", "node"),
             ("training_job", "jobA"))) in before
    assert ("ckptwatch_last_collision_verification",
            (("kind", "redundant"), ("result", "ok"), ("scope", "job"),
             ("training_job", "jobB"))) in before


def test_verdicts_are_journaled_after_a_restart_as_without_one(tmp_path):
    """A file found corrupt before the restart and whole after it: the ok verdict is
    journaled (it supersedes the corrupt one); a collision's file verified only after the
    restart: its verdict is journaled; another whole file is not."""
    tmp = str(tmp_path)
    a, c, other = (os.path.join(tmp, n) for n in ("a.pt", "c.pt", "other.pt"))
    first = build(tmp)
    first.exporters.publish_finding(verdict(a, "corrupt", "torn"))
    first.exporters.publish_collision(collision(c, "c3"))
    first.exporters.close()
    second = build(tmp)
    for path in (a, c, other):
        second.exporters.publish_finding(verdict(path, "ok"))
    second.exporters.close()
    oks = [r["path"] for r in read_records(os.path.join(tmp, "j.jsonl"))
           if r["type"] == "verification" and r["result"] == "ok"]
    assert oks == [a, c]


def test_resume_reads_only_the_newest_bytes_of_a_huge_journal(tmp_path, monkeypatch):
    from monitor.agent import resume as resume_mod
    tmp = str(tmp_path)
    journal = os.path.join(tmp, "j.jsonl")
    first = build(tmp)
    first.exporters.publish_collision(collision(os.path.join(tmp, "old.pt"), "old"))
    first.exporters.close()
    # 3 GiB of zeros without a newline after the old collision (sparse: no disk used), then
    # a newer collision of another job.
    with open(journal, "r+b") as fh:
        fh.truncate(os.path.getsize(journal) + (3 << 30))
    with open(journal, "ab") as fh:
        fh.write(b"\n")
    first = build(tmp)
    first.exporters.publish_collision(collision(os.path.join(tmp, "new.pt"), "new",
                                                job="jobN"))
    first.exporters.close()
    monkeypatch.setattr(resume_mod, "RESUME_MAX_BYTES", 8 << 20)
    seen = []
    real = resume_mod.resume

    def spy(*args, **kwargs):
        kwargs.setdefault("max_bytes", resume_mod.RESUME_MAX_BYTES)
        stats = real(*args, **kwargs)
        seen.append(stats)
        return stats

    monkeypatch.setattr("monitor.agent.daemon.resume", spy)
    second = build(tmp)
    try:
        jobs = {dict(k[1]).get("training_job") for k in gauges(second)}
    finally:
        second.exporters.close()
    [stats] = seen
    assert stats.bytes <= (8 << 20) + (4 << 20)     # the budget and at most one line's cut
    assert jobs == {"jobN"}                         # the newest is restored, the old not read


def test_hostile_lines_are_skipped_not_restored(tmp_path):
    from monitor.agent import resume as resume_mod
    tmp = str(tmp_path)
    journal = os.path.join(tmp, "j.jsonl")
    future = time.time() + 10 * 365 * 86400
    good = collision(os.path.join(tmp, "g.pt"), "g").to_record()
    lines = ['{"type":"collision",' + '"x":' + "[" * 3000 + "]" * 3000 + "}",
             '{"type":"verification","path":' + '{"a":' * 900 + "1" + "}" * 900 + "}",
             json.dumps({**good, "id": "f", "job": "jobF", "detected_wall": future,
                         "writers": [{**w, "end_wall": future} for w in good["writers"]]},
                        separators=(",", ":")),
             json.dumps({**good, "job": ["x"]}, separators=(",", ":")),
             json.dumps({**good, "writers": "all"}, separators=(",", ":")),
             json.dumps({"type": "verification", "path": "/p", "result": "corrupt",
                         "cause": {"a": 1}, "job": "jobV", "wall": time.time()},
                        separators=(",", ":")),
             json.dumps({"type": "hazard", "path": "/p", "hazard": "local_rank_guard",
                         "job": "jobH", "ts": float("inf")}),
             json.dumps({"type": "hazard", "path": "/p", "hazard": "local_rank_guard",
                         "job": "jobH", "ts": future}, separators=(",", ":"))]
    with open(journal, "w") as fh:
        for line in lines:
            fh.write(line + "\n")
    agent = build(tmp)
    try:
        assert gauges(agent) == {}
    finally:
        agent.exporters.close()
    stats = resume_mod.resume(journal, agent.state)
    assert stats.collisions == stats.verdicts == stats.hazards == 0
    assert stats.skipped >= 7


def test_a_rotated_file_that_is_a_fifo_is_skipped_not_waited_on(tmp_path):
    from monitor.agent import resume as resume_mod
    tmp = str(tmp_path)
    first = build(tmp)
    first.exporters.publish_collision(collision(os.path.join(tmp, "a.pt"), "c1"))
    first.exporters.close()
    os.mkfifo(os.path.join(tmp, "j.jsonl.1"))          # older than the current file
    agent = build(tmp)                                  # would block forever on open()
    try:
        assert any(k[0] == "ckptwatch_last_collision_timestamp_seconds" for k in gauges(agent))
    finally:
        agent.exporters.close()
    stats = resume_mod.resume(os.path.join(tmp, "j.jsonl"), agent.state)
    assert stats.collisions == 1 and stats.skipped == 1


def test_a_verdict_that_came_before_its_job_collision_is_restored(tmp_path):
    """A job-scope collision settles after the verifier's quiet period: its file's verdict
    comes first. It is journaled when the collision is, so a restart restores "ok", not
    "pending"."""
    tmp = str(tmp_path)
    b = os.path.join(tmp, "b.pt")
    first = build(tmp)
    first.exporters.publish_finding(verdict(b, "ok", job="jobB"))
    first.exporters.publish_collision(collision(b, "c9", job="jobB", scope="job"))
    before = gauges(first)
    first.exporters.close()
    key = ("ckptwatch_last_collision_verification",
           (("kind", "concurrent"), ("result", "ok"), ("scope", "job"), ("training_job", "jobB")))
    assert key in before
    second = build(tmp)
    try:
        assert key in gauges(second)
    finally:
        second.exporters.close()
