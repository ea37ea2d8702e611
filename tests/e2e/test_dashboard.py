"""Every query of the Grafana dashboard, run by a real Prometheus against real agents.

Two real agents (node-a, node-b) get real events from real sender processes: on node-a two
ranks of train-a overlap on a checkpoint that really is torn (the agent verifies it: corrupt),
and train-a reports a hazard; on node-b two ranks of train-b save one path one after another
(redundant). A third target (node-c) has no agent: it is down. A real Prometheus scrapes the
three with `node` target labels, as deploy/prometheus/prometheus.yml does. Then every panel's
every query runs with the variables as Grafana fills them: "All", one value, several values.
No Grafana server exists here; Grafana sends exactly these PromQL strings after substituting
its variables ($__range, $__range_s, $__rate_interval, and the template variables: allValue
".*" for All, a regex alternation for several values).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from agentproc import FAST, EventSender, start_agent
from helpers import REPO_ROOT, free_port, subprocess_env, wait_for
from prom import start_prometheus, wait_for_query

DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana", "ckptwatch-dashboard.json")

TIME = {"__range": "5m", "__range_s": "300", "__rate_interval": "1m"}
SELECTIONS = {
    "all": {"training_job": ".*", "node": ".*"},
    "one": {"training_job": "train-a", "node": "node-a"},
    "several": {"training_job": "(train-a|train-b)", "node": "(node-a|node-b)"},
}

# Queries with nothing to show in this scenario, and why (every query still has to run).
EMPTY_HERE = {
    ("Active writes", "A"): "no save is in flight when Prometheus is asked",
    ("Failed saves", "A"): "no save raised",
    ("Filesystem watch", "A"): "no --watch.path",
    ("Filesystem watch", "B"): "no --watch.path",
    ("Corrupt checkpoints, size fluctuations, torn reads", "B"): "no size fluctuation",
    ("Corrupt checkpoints, size fluctuations, torn reads", "C"): "no torn read",
}

TORN = r"""
import sys, torch
torch.save({"w": torch.arange(200_000)}, sys.argv[1])
size = len(open(sys.argv[1], "rb").read())
with open(sys.argv[1], "r+b") as f:          # what a second writer's truncation leaves
    f.truncate(size // 2)
"""

HAZARD = r"""
import os, socket, sys, time
from ckptwatch import events
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
base = {"v": 1, "node": "n", "pid": os.getpid(), "path": "/shared/ckpt/last.pt",
        "rank": 2, "local_rank": 0, "world_size": 4, "job": "train-a",
        "master": "10.0.0.1:29500", "restart": 0, "site": "train.py:7", "func": "save"}
s.sendall(events.encode({**base, "type": "hazard", "seq": 1, "kind": "local_rank_guard",
                         "shared": "mount:nfs4", "ranks": [0, 2], "nodes": ["n", "m"],
                         "wall": time.time()}))
sys.stdin.read()                            # alive until the test has seen the hazard
"""


def substitute(expr: str, values: dict) -> str:
    for var in sorted(values, key=len, reverse=True):     # $__range_s before $__range
        expr = expr.replace(f"${{{var}}}", values[var]).replace(f"${var}", values[var])
    assert "$" not in expr, expr
    return expr


def panels(board):
    def walk(items):
        for p in items:
            yield p
            yield from walk(p.get("panels", []))
    return [p for p in walk(board["panels"]) if p["type"] != "row"]


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    pytest.importorskip("torch")
    workdir = str(tmp_path_factory.mktemp("dash"))
    dir_a, dir_b = os.path.join(workdir, "a"), os.path.join(workdir, "b")
    os.makedirs(dir_a), os.makedirs(dir_b)
    ckpt = os.path.join(dir_a, "last.pt")
    subprocess.run([sys.executable, "-c", TORN, ckpt], check=True, timeout=120,
                   env=subprocess_env())
    with start_agent(dir_a, *FAST, "--node.name", "node-a", "--verify.quiet", "0.3") as a, \
            start_agent(dir_b, *FAST, "--node.name", "node-b", window=2) as b:
        # node-a: two ranks of train-a overlap on the torn file.
        with EventSender(a.socket, ckpt, rank=0, job="train-a") as r0, \
                EventSender(a.socket, ckpt, rank=1, job="train-a") as r1:
            r0.start()
            r1.start()
            r0.end(os.path.getsize(ckpt))
            r1.end(os.path.getsize(ckpt))
            wait_for(lambda: a.metric("ckptwatch_last_collision_verification",
                                      training_job="train-a", result="corrupt"),
                     timeout=30, message=f"the collision's file found corrupt:\n{a.log}")
        sender = subprocess.Popen([sys.executable, "-c", HAZARD, a.socket],
                                  stdin=subprocess.PIPE, env=subprocess_env())
        try:
            wait_for(lambda: a.metric("ckptwatch_hazards_total", training_job="train-a"),
                     message="the hazard")
        finally:
            sender.stdin.close()
            assert sender.wait(timeout=30) == 0
        # node-b: two ranks of train-b, one after the other: redundant.
        path_b = os.path.join(dir_b, "model.pt")
        with EventSender(b.socket, path_b, rank=0, job="train-b") as r0, \
                EventSender(b.socket, path_b, rank=1, job="train-b") as r1:
            r0.start()
            r0.end(10)
            r1.start()
            r1.end(10)
            wait_for(lambda: b.metric("ckptwatch_collisions_total", training_job="train-b",
                                      kind="redundant"), timeout=30, message="redundant")
        down = f"127.0.0.1:{free_port()}"              # nothing listens: node-c is down
        targets = {f"127.0.0.1:{a.port}": "node-a", f"127.0.0.1:{b.port}": "node-b",
                   down: "node-c"}
        static = [{"targets": [t], "labels": {"node": n}} for t, n in targets.items()]
        with start_prometheus(list(targets), scrape_options={"static_configs": static}) as prom:
            wait_for_query(prom, 'up{job="ckptwatch"}', lambda r: len(r) == 3)
            wait_for_query(prom, "ckptwatch_last_corrupt_checkpoint_timestamp_seconds")
            wait_for_query(prom, 'ckptwatch_collisions_total{kind="redundant"}')
            wait_for_query(prom, "ckptwatch_hazards_total")
            # Three scrapes of every target, so rate() and increase() have their samples.
            wait_for_query(prom, 'count_over_time(ckptwatch_build_info[1m]) >= 3',
                           lambda r: len(r) == 2)
            with open(DASHBOARD) as f:
                yield prom, json.load(f)


def top_row(board):
    row = [p for p in board["panels"] if p["type"] != "row" and p["gridPos"]["y"] == 1]
    return sorted(row, key=lambda p: p["gridPos"]["x"])


def single(prom, expr):
    result = prom.query(expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def test_top_row_answers_on_a_real_prometheus(scene):
    prom, board = scene
    shown = {}
    for selection, values in SELECTIONS.items():
        for p in top_row(board):
            expr = substitute(p["targets"][0]["expr"], {**TIME, **values})
            shown[(selection, p["title"])] = single(prom, expr)
    titles = [p["title"] for p in top_row(board)]
    print("\ntop row (training_job, node):")
    for selection, values in SELECTIONS.items():
        print(f"  {values}: " + ", ".join(f"{t} = {shown[(selection, t)]:g}" for t in titles))
    expected = {"all": [1, 1, 1, 1], "one": [1, 1, 1, 0], "several": [1, 1, 1, 0]}
    for selection, numbers in expected.items():
        assert [shown[(selection, t)] for t in titles] == numbers, selection
    # node-b alone: nothing wrong there, and a zero rather than "No data".
    values = {**TIME, "training_job": ".*", "node": "node-b"}
    assert [single(prom, substitute(p["targets"][0]["expr"], values))
            for p in top_row(board)] == [0, 0, 0, 0]


def test_every_panel_query_runs_with_all_one_and_several_values(scene):
    prom, board = scene
    empty = set()
    for p in panels(board):
        for target in p.get("targets", []):
            for selection, values in SELECTIONS.items():
                expr = substitute(target["expr"], {**TIME, **values})
                if target.get("instant"):
                    result = prom.query(expr)         # raises on any PromQL or API error
                else:
                    now = time.time()
                    result = prom.api("query_range", query=expr, start=now - 60, end=now,
                                      step=5)["result"]
                if selection == "all" and not result:
                    empty.add((p["title"], target["refId"]))
    assert empty == set(EMPTY_HERE)


def test_the_verdict_and_agents_tables(scene):
    prom, board = scene
    values = {**TIME, **SELECTIONS["all"]}
    (verdict,) = [p for p in panels(board) if p["title"].startswith("Latest collision per job")]
    rows = {(r["metric"]["training_job"], r["metric"]["kind"]): r["metric"]["result"]
            for r in prom.query(substitute(verdict["targets"][0]["expr"], values))}
    assert rows[("train-a", "concurrent")] == "corrupt"
    assert ("train-b", "redundant") in rows
    (agents,) = [p for p in panels(board) if p["title"].startswith("Agents: where")]
    up = {r["metric"]["node"]: r["value"][1]
          for r in prom.query(substitute(agents["targets"][0]["expr"], values))}
    assert up == {"node-a": "1", "node-b": "1", "node-c": "0"}


def test_variables_list_the_nodes_and_jobs(scene):
    prom, board = scene
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        selector, label = var["query"]["query"][len("label_values("):-1].rsplit(",", 1)
        found = set(prom.api(f"label/{label.strip()}/values", **{"match[]": selector}))
        if var["name"] == "node":
            assert found == {"node-a", "node-b", "node-c"}
        else:
            assert {"train-a", "train-b"} <= found
        # "All" is a regex that also matches series without the label (jobs without an id).
        assert var["includeAll"] and var["allValue"] == ".*"
