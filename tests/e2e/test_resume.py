"""A real agent restart changes no alert (issue 16 item 4).

Two processes collide on a checkpoint the agent then finds corrupt; the agent is scraped,
stopped (SIGTERM, as systemd or the kubelet stops it), started again on the same journal and
scraped again. The restarted agent exports every series the alerts key on with the values it
had; then the scrapes, with the outage between them as Prometheus records it (stale markers),
are evaluated by promtool against the real rules file: the collision and corrupt-checkpoint
alerts fire once and stay firing through the outage and the restart -- never resolved, never
pending again -- until their window after the event ends. On f503c65 the gauges were empty
after the restart and the alerts resolved within a minute of the stop.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import textwrap

import pytest
import yaml

from agentproc import FAST, overlapping_writes, start_agent
from corpus import torch_zip_bytes
from helpers import REPO_ROOT, short_tmpdir, remove_tree, wait_for

RULES = os.path.join(REPO_ROOT, "deploy", "prometheus", "ckptwatch-rules.yml")
ALERT_GAUGES = ("ckptwatch_last_collision_timestamp_seconds",
                "ckptwatch_last_collision_verification",
                "ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
                "ckptwatch_last_hazard_timestamp_seconds",
                "ckptwatch_last_size_fluctuation_timestamp_seconds")
JOB = "job-resume"


@pytest.fixture
def workdir():
    path = short_tmpdir("cwres")
    yield path
    remove_tree(path)


def alert_gauges(agent) -> dict:
    """{(name, sorted labels): value} of the alerts' series in one scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in agent.samples()
            if s.name in ALERT_GAUGES and s.labels.get("training_job") == JOB}


def series_line(name, labels, values) -> dict:
    selector = ",".join(f'{k}="{v}"' for k, v in labels + (("job", "ckptwatch"),
                                                            ("instance", "node-r:19400")))
    return {"series": f"{name}{{{selector}}}", "values": " ".join(values)}


def promtool_case(before: dict, after: dict, t0: float, up_before: int, down: int,
                  up_after: int) -> list:
    """Input series: the scrape before the stop repeated for `up_before` minutes, `down`
    minutes of stale markers (the failed scrapes), the scrape after the restart for
    `up_after` minutes. Gauge times are shifted by t0 (promtool's time() starts at 0)."""
    lines = []
    for key in sorted(set(before) | set(after)):
        name, labels = key

        def value(scrape):
            if key not in scrape:
                return "_"
            v = scrape[key]
            return repr(round(v - t0, 3)) if name.endswith("_timestamp_seconds") else repr(v)

        values = [value(before)] * up_before + ["stale"] * down + [value(after)] * up_after
        lines.append(series_line(name, labels, values))
    return lines


def test_alerts_survive_an_agent_restart(workdir):
    path = os.path.join(workdir, "ckpt", "last.pt")
    os.makedirs(os.path.dirname(path))
    # What the two writers leave: a torch zip cut short (its central directory is gone).
    with open(path, "wb") as fh:
        fh.write(torch_zip_bytes(pickle.dumps({"w": 1}))[:-40])
    args = (*FAST, "--verify.quiet", "0.3")
    agent = start_agent(workdir, *args, window=5)
    try:
        overlapping_writes(agent, path, job=JOB)
        agent.wait_for_collision()
        wait_for(lambda: agent.metric("ckptwatch_last_collision_verification",
                                      training_job=JOB, result="corrupt") == 1
                 and agent.metric("ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
                                  training_job=JOB),
                 timeout=30, message=f"the corrupt verdict; agent log:\n{agent.log}")
        before = alert_gauges(agent)
        port = agent.port
    finally:
        agent.stop()
    assert {k[0] for k in before} >= {"ckptwatch_last_collision_timestamp_seconds",
                                      "ckptwatch_last_collision_verification",
                                      "ckptwatch_last_corrupt_checkpoint_timestamp_seconds"}
    again = start_agent(workdir, *args, window=5, port=port)
    try:
        after = alert_gauges(again)
        counted = again.metric("ckptwatch_collisions_total", training_job=JOB)
        log = again.log
    finally:
        again.stop()
    assert after == before
    assert counted is None          # counters count since this start
    assert "resumed from journal" in log

    # The real rules on these scrapes: the collision at 1m (t0), the agent stopped at 3m and
    # back at 7m.
    t0 = before[next(k for k in before
                     if k[0] == "ckptwatch_last_collision_timestamp_seconds")] - 60
    series = promtool_case(before, after, t0, up_before=3, down=4, up_after=20)
    firing = [{"alertname": "CkptwatchConcurrentWriteCollision", "state": "firing"},
              {"alertname": "CkptwatchCorruptCheckpoint", "state": "firing"}]

    def alerts_at(minute, expected):
        samples = []
        for want in expected:
            labels = {"alertname": want["alertname"], "alertstate": want["state"],
                      "training_job": JOB, "job": "ckptwatch", "instance": "node-r:19400",
                      "severity": "critical"}
            if want["alertname"] == "CkptwatchConcurrentWriteCollision":
                labels.update(kind="concurrent", scope="node")
            else:
                [reason] = {dict(k[1])["reason"] for k in before if k[0] ==
                            "ckptwatch_last_corrupt_checkpoint_timestamp_seconds"}
                labels["reason"] = reason
            selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
            samples.append({"labels": f"ALERTS{{{selector}}}", "value": 1})
        return {"expr": 'ALERTS{alertname=~"CkptwatchConcurrentWriteCollision|'
                        'CkptwatchCorruptCheckpoint"}',
                "eval_time": f"{minute}m", "exp_samples": samples}

    corrupt_minute = (before[next(k for k in before if k[0] ==
                                  "ckptwatch_last_corrupt_checkpoint_timestamp_seconds")]
                      - t0) / 60
    tests = [alerts_at(2, firing),      # for: 1m after the collision at 1m
             alerts_at(4, firing),      # the agent is down
             alerts_at(6, firing),
             alerts_at(8, firing),      # restarted: still firing, not pending again
             alerts_at(10, firing)]
    # 10 minutes after the collision its alert ends; the corrupt one 15 minutes after.
    tests.append(alerts_at(12, firing[1:]))
    tests.append(alerts_at(int(corrupt_minute) + 16, []))
    doc = {"rule_files": [RULES], "evaluation_interval": "1m",
           "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
    test_file = os.path.join(workdir, "resume.test.yml")
    with open(test_file, "w") as fh:
        yaml.safe_dump(doc, fh, sort_keys=False)
    proc = subprocess.run(["promtool", "test", "rules", test_file], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr + textwrap.indent(
        open(test_file).read(), "  ")
