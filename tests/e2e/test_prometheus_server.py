"""A real Prometheus scrapes a real MetricsServer and evaluates the shipped alert rules."""
from __future__ import annotations

import os
import time

import pytest

from exporters.metrics.collector import build_registry
from exporters.metrics.server import MetricsServer
from exporters.metrics.state import MetricsState
from helpers import REPO_ROOT
from monitor.detect.model import KIND_CONCURRENT, Collision, Write, Writer
from prom import start_prometheus, wait_for_query


RULES = os.path.join(REPO_ROOT, "deploy", "prometheus", "ckptwatch-rules.yml")
PATH = "/data/shared/ckpt/last.pt"


def write(pid, rank, job, start):
    return Write(writer=Writer(node="node-a", pid=pid, rank=rank, job=job), path=PATH, seq=1,
                 start_wall=1_700_000_000.0 + start, start_mono=start,
                 end_wall=1_700_000_000.5 + start, end_mono=start + 0.5, bytes=4096,
                 outcome="ok", site="train.py:10", func="main")


@pytest.fixture
def agent_metrics():
    state = MetricsState()
    writes = [write(100 + r, r, "job-7", 10.0 + r / 10) for r in range(4)]
    for w in writes:
        state.write_finished(w)
    state.write_finished(write(200, None, None, 30.0))  # a process with no job id
    # Detected now: the alert compares the collision's time with Prometheus' time().
    state.collision(Collision(path=PATH, kind=KIND_CONCURRENT, writes=tuple(writes),
                              detected_wall=time.time(), id="c1"))
    # The verifier found the file the writers left torn.
    state.verification("corrupt", "torn", job="job-7", path=PATH, collision_id="c1",
                       wall=time.time())
    server = MetricsServer("127.0.0.1:0", build_registry(state))
    server.start()
    yield server
    server.stop()


def test_prometheus_sees_collisions_and_rules_evaluate(agent_metrics):
    target = f"127.0.0.1:{agent_metrics.port}"
    with start_prometheus([target], rule_files=[RULES]) as prom:
        result = wait_for_query(prom, 'ckptwatch_collisions_total{kind="concurrent"}')
        assert len(result) == 1
        labels = result[0]["metric"]
        # The training job id is its own label; `job` stays the scrape job's name, with no
        # honor_labels needed (issue 8).
        assert labels["training_job"] == "job-7" and labels["scope"] == "node"
        assert labels["job"] == "ckptwatch"
        assert labels["instance"] == target
        assert result[0]["value"][1] == "1"
        assert all(PATH not in v for v in labels.values())

        # `up` keeps the scrape job name, which CkptwatchAgentDown relies on.
        up = prom.query('up{job="ckptwatch"}')
        assert [r["value"][1] for r in up] == ["1"]

        ranks = prom.query('ckptwatch_writes_total{training_job="job-7"}')
        assert sorted(r["metric"]["rank"] for r in ranks) == ["0", "1", "2", "3"]
        # training_job="" is stored as "no training_job label" (see
        # deploy/prometheus/prometheus.yml).
        unknown = prom.query('ckptwatch_writes_total{training_job=""}')
        assert len(unknown) == 1 and "training_job" not in unknown[0]["metric"]
        assert "rank" not in unknown[0]["metric"]

        # The shipped rule catches the collision from its timestamp: the alert is pending
        # (its `for:` is a minute, longer than this test).
        alerts = wait_for_query(
            prom, 'ALERTS{alertname="CkptwatchConcurrentWriteCollision"}')
        assert alerts[0]["metric"]["training_job"] == "job-7"
        assert alerts[0]["metric"]["severity"] == "critical"
        assert not prom.query('ALERTS{alertname="CkptwatchAgentDown"}')

        # The text is rendered by the real Prometheus, its template query included: it says
        # what the agent found in the file, and the command that shows the writers.
        by_name = {a["labels"]["alertname"]: a for a in prom.alerts()}
        collision = by_name["CkptwatchConcurrentWriteCollision"]["annotations"]
        assert collision["summary"] == ("Concurrent checkpoint writes in training job job-7 "
                                        f"on {target}: the checkpoint is corrupt")
        assert "The agent verified the file they left: it is corrupt." in \
            collision["description"]
        assert ("`ckptwatch report --journal /var/lib/ckptwatch/journal.jsonl` on "
                f"{target}") in collision["description"]
        corrupt = wait_for_query(prom, 'ALERTS{alertname="CkptwatchCorruptCheckpoint"}')
        assert corrupt[0]["metric"]["training_job"] == "job-7"
        assert corrupt[0]["metric"]["reason"] == "torn"
