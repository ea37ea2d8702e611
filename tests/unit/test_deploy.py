"""Deploy assets: promtool checks, metric names against the real exporter, manifest hygiene."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import yaml

from dockerfile import IMAGE_DIRS, default_command, dockerfile_stages, final_stage, image_env
from exporters.metrics import components
from exporters.metrics.collector import build_registry
from exporters.metrics.state import MetricsState
from helpers import REPO_ROOT
from monitor.detect.model import KIND_CONCURRENT, Collision, Write, Writer

DEPLOY = os.path.join(REPO_ROOT, "deploy")
PROM_DIR = os.path.join(DEPLOY, "prometheus")
RULES = os.path.join(PROM_DIR, "ckptwatch-rules.yml")
RULE_TESTS = os.path.join(PROM_DIR, "ckptwatch-rules.test.yml")
PROM_CONFIG = os.path.join(PROM_DIR, "prometheus.yml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "ckptwatch-dashboard.json")
K8S = os.path.join(DEPLOY, "kubernetes", "daemonset")
UNIT = os.path.join(DEPLOY, "systemd", "ckptwatch-agent.service")
LOCK = os.path.join(DEPLOY, "requirements.lock")
RUNBOOK = os.path.join(REPO_ROOT, "docs", "runbook.md")

ALERTS = ("CkptwatchConcurrentWriteCollision", "CkptwatchCorruptCheckpoint",
          "CkptwatchRedundantCheckpointWrites", "CkptwatchCheckpointSizeFluctuation",
          "CkptwatchCheckpointHazard", "CkptwatchEventsRejected", "CkptwatchClientEventsDropped",
          "CkptwatchLabelValuesOverflowed", "CkptwatchAgentDown")
# Series Prometheus makes itself rather than scraping them from the agent.
PROMETHEUS_SERIES = {"up", "ALERTS", "ALERTS_FOR_STATE"}
RUNBOOK_BASE = "https://github.com/ckptwatch/ckptwatch/blob/main/docs/runbook.md"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed")


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def promtool(*args, cwd=None):
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60,
                            cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def alert_rules():
    return [r for g in load_yaml(RULES)["groups"] for r in g["rules"] if "alert" in r]


def dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_exprs():
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dashboard()["panels"])
    return exprs


# --- metric names -------------------------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression (or Grafana label_values query) selects."""
    # Grafana's label_values(<selector>, <label>): only the selector names metrics.
    grafana = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr)
    if grafana:
        expr = grafana.group(1)
    names = set()
    # {__name__=~"a|b"} selectors name their metrics in a label matcher.
    for match in re.finditer(r'__name__\s*=~?\s*"([^"]*)"', expr):
        names.update(n for n in match.group(1).split("|") if n)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)            # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)                      # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                     # range durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)                    # Grafana variables
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)\b(?!\s*\()", text):
        word = match.group(1)
        if word.lower() not in _KEYWORDS and not re.fullmatch(r"\d+[smhdwy]", word):
            names.add(word)
    return names


def test_metric_name_extraction():
    # The extractor itself must find metrics and skip functions, labels and keywords.
    expr = ('histogram_quantile(0.9, sum by (job, le) (rate(ckptwatch_write_duration_seconds_'
            'bucket{job=~"$job"}[$__rate_interval]))) or up{job="x"} offset 5m '
            'unless on(job) process_open_fds')
    assert metric_names(expr) == {"ckptwatch_write_duration_seconds_bucket", "up",
                                  "process_open_fds"}
    assert metric_names('label_values({__name__=~"a_total|b_total"}, job)') == {
        "a_total", "b_total"}
    assert metric_names("label_values(up{job=\"ckptwatch\"}, node)") == {"up"}


@pytest.fixture(scope="module")
def exported_names():
    """Every sample name the real collectors export after one write and one collision, each
    component's collector reading a stand-in with that component's attributes."""
    from monitor.verify.integrity import CAUSES
    from monitor.verify.worker import RESULTS
    state = MetricsState(verify_results=RESULTS, corrupt_causes=CAUSES)
    writes = tuple(
        Write(writer=Writer(node="n", pid=10 + r, rank=r, job="j"), path="/c/x.pt", seq=1,
              start_wall=1.0, start_mono=1.0 + r / 10, end_wall=2.0, end_mono=2.0, bytes=10,
              outcome="ok")
        for r in range(2))
    for w in writes:
        state.write_finished(w)
    state.write_finished(Write(writer=Writer(node="n", pid=99, job="j"), path="/c/y.pt",
                               seq=2, start_wall=1.0, start_mono=1.0, end_wall=2.0,
                               end_mono=2.0, bytes=1, outcome="OSError"))
    state.collision(Collision(path="/c/x.pt", kind=KIND_CONCURRENT, writes=writes,
                              detected_wall=3.0))
    state.set_active_writes({"j": 1})
    state.finding("size_fluctuation", "j")
    state.finding("torn_read", "j")
    state.hazard("j", "local_rank_guard")
    state.verification("corrupt", "torn", job="j", path="/c/x.pt", wall=4.0)
    fs_stats = {"events_lost": 0, "fallbacks": 0, "attributions": 1,
                "attribution_seconds": 0.1, "attribution_errors": 0,
                "roots": {"/ckpt": {"mode": "inotify", "state": "watching"}}}
    registry = build_registry(
        state,
        components.IngestCollector(SimpleNamespace(connections=1, refused={"pid_limit": 0},
                                                   evicted={"make_room": 0})),
        components.DetectorCollector(SimpleNamespace(
            tracked_paths=1, evicted_paths_total=0, refused_starts={"open_limit": 0},
            remote_rejected={"unanchored": 0})),
        components.JobScopeCollector(SimpleNamespace(remote_received=0)),
        components.ChecksCollector(SimpleNamespace(pending=lambda: 0)),
        components.JournalCollector(SimpleNamespace(errors=0, records_lost=0)),
        components.LoopCollector(SimpleNamespace(oldest_wait=lambda: 0.0)),
        components.HttpCollector(SimpleNamespace(drops=lambda: {"timeout": 0})),
        components.FsCollector(SimpleNamespace(stats=lambda: fs_stats)))
    names = {s.name for family in registry.collect() for s in family.samples}
    assert "ckptwatch_write_duration_seconds_bucket" in names
    return names


def template_query_metrics(rule) -> set[str]:
    """Metrics an alert's annotations read with a template query (printf "name{...}" | query)."""
    return set(re.findall(r'printf "(\w+)\{', " ".join(rule.get("annotations", {}).values())))


def test_rules_use_only_exported_metrics(exported_names):
    used = set()
    for rule in alert_rules():
        used |= metric_names(rule["expr"]) | template_query_metrics(rule)
    assert {"ckptwatch_last_collision_timestamp_seconds",
            "ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
            "ckptwatch_last_collision_verification",
            "ckptwatch_last_size_fluctuation_timestamp_seconds",
            "ckptwatch_last_hazard_timestamp_seconds"} <= used
    assert used - exported_names - PROMETHEUS_SERIES == set()


JOB_ALERTS = ("CkptwatchConcurrentWriteCollision", "CkptwatchCorruptCheckpoint",
              "CkptwatchRedundantCheckpointWrites", "CkptwatchCheckpointSizeFluctuation",
              "CkptwatchCheckpointHazard")
JOURNAL = "/var/lib/ckptwatch/journal.jsonl"


def test_alerts_keep_every_target_label_and_name_the_report_command():
    """f503c65 grouped by (training_job, instance, node): in sidecar mode the pod and namespace
    of the training pod were lost, CkptwatchCorruptCheckpoint had no training_job, and the
    descriptions said "Run `ckptwatch report` on that node" with no journal."""
    rules = {r["alert"]: r for r in alert_rules()}
    for name, rule in rules.items():
        assert not re.search(r"\b(by|without)\s*\(", rule["expr"]), name
    for name in JOB_ALERTS:
        rule = rules[name]
        text = json.dumps(rule["annotations"])
        assert "$labels.training_job" in rule["annotations"]["summary"], name
        assert f"-- ckptwatch report --journal {JOURNAL}`" in text, name
        assert "kubectl -n {{ $labels.namespace }} exec {{ $labels.pod }}" in text, name
        assert "-c {{ . }}" in text, name                            # the sidecar's container
    metrics = {m for name in JOB_ALERTS for m in metric_names(rules[name]["expr"])}
    assert metrics <= {"ckptwatch_last_collision_timestamp_seconds",
                       "ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
                       "ckptwatch_last_size_fluctuation_timestamp_seconds",
                       "ckptwatch_last_hazard_timestamp_seconds"}


def test_dashboard_uses_only_exported_metrics(exported_names):
    board = dashboard()
    used = set()
    for expr in dashboard_exprs():
        used |= metric_names(expr)
    for var in board["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if var["type"] == "query":
            used |= metric_names(query)
    assert {"ckptwatch_collisions_total", "ckptwatch_write_duration_seconds_bucket"} <= used
    assert used - exported_names - PROMETHEUS_SERIES == set()


# --- Prometheus rules and config ----------------------------------------------------------

@needs_promtool
def test_promtool_check_rules():
    out = promtool("check", "rules", RULES)
    assert f"{len(alert_rules())} rules found" in out


@needs_promtool
def test_promtool_test_rules():
    promtool("test", "rules", os.path.basename(RULE_TESTS), cwd=PROM_DIR)


@needs_promtool
def test_promtool_check_config():
    promtool("check", "config", PROM_CONFIG, cwd=PROM_DIR)


def test_every_alert_is_complete_and_has_a_runbook_section():
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(ALERTS) <= set(rules)
    with open(RUNBOOK) as f:
        headings = {line[3:].strip().lower() for line in f if line.startswith("## ")}
    for name, rule in rules.items():
        assert rule.get("for"), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        annotations = rule["annotations"]
        for key in ("summary", "description", "runbook_url"):
            assert annotations.get(key), (name, key)
        base, anchor = annotations["runbook_url"].split("#", 1)
        assert base == RUNBOOK_BASE, name
        assert anchor == name.lower() and anchor in headings, \
            f"docs/runbook.md has no section for {name}"
    assert rules["CkptwatchConcurrentWriteCollision"]["labels"]["severity"] == "critical"


def github_anchors(markdown_path):
    """The anchors GitHub renders for a Markdown file's headings (lower case, punctuation
    dropped, spaces to hyphens, repeats numbered)."""
    anchors, seen = set(), {}
    in_code = False
    with open(markdown_path) as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            if in_code or not re.match(r"#{1,6} ", line):
                continue
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_runbook_link_points_at_an_existing_runbook_anchor():
    """Rules and dashboard links are absolute (Alertmanager and Grafana have no repository to
    be relative to) and every anchor is a heading of docs/runbook.md."""
    anchors = github_anchors(RUNBOOK)
    assert "finding-the-paths" in anchors
    urls = [r["annotations"]["runbook_url"] for r in alert_rules()]
    urls += re.findall(r'https?://[^"\s)]*runbook\.md#[\w-]+', json.dumps(dashboard()))
    assert len(urls) > len(alert_rules())
    for url in urls:
        base, anchor = url.split("#", 1)
        assert base == RUNBOOK_BASE, url
        assert anchor in anchors, f"{url}: no such heading in docs/runbook.md"


def test_runbook_base_appears_only_in_runbook_urls():
    # One sed (or the Helm chart) rewrites the base; no other copy may be left behind.
    with open(RULES) as f:
        lines = [ln for ln in f if RUNBOOK_BASE in ln and not ln.lstrip().startswith("#")]
    assert len(lines) == len(alert_rules())
    assert all(ln.strip().startswith(f'runbook_url: "{RUNBOOK_BASE}#') for ln in lines)


def test_rule_tests_cover_firing_pending_and_quiet_for_every_alert():
    tests = load_yaml(RULE_TESTS)
    assert tests["rule_files"] == [os.path.basename(RULES)]
    firing, quiet, pending = set(), set(), set()
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
        for case in group.get("promql_expr_test", []):
            for sample in case.get("exp_samples", []):
                if 'alertstate="pending"' in sample["labels"]:
                    pending.add(re.search(r'alertname="(\w+)"', sample["labels"]).group(1))
    for name in ALERTS:
        assert name in firing, f"{name}: no firing case"
        assert name in quiet, f"{name}: no not-firing case"
        assert name in pending, f"{name}: no pending case"


def test_scrape_config_keeps_target_labels_and_matches_agent_down_rule():
    config = load_yaml(PROM_CONFIG)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    # The agent exports training_job, never job: nothing for honor_labels to protect.
    assert not jobs["ckptwatch"].get("honor_labels", False)
    down = next(r for r in alert_rules() if r["alert"] == "CkptwatchAgentDown")
    assert 'up{job="ckptwatch"}' in down["expr"]
    assert os.path.basename(RULES) in config["rule_files"]


def test_training_job_is_never_the_job_label_in_rules_or_dashboard():
    """`job` is the scrape job's name (Prometheus'): rules and panels group and filter by
    training_job; `job` appears only as job="ckptwatch" to pick our targets."""
    exprs = [r["expr"] for r in alert_rules()] + dashboard_exprs()
    for expr in exprs:
        assert not re.search(r"\b(by|without|on|ignoring)\s*\([^)]*\bjob\b", expr), expr
        for match in re.finditer(r"(?<![\w])job\s*(=~|!=|!~|=)\s*\"([^\"]*)\"", expr):
            assert match.groups() == ("=", "ckptwatch"), expr
    annotations = json.dumps([r.get("annotations", {}) for r in alert_rules()])
    assert "$labels.job" not in annotations and "{{job}}" not in json.dumps(dashboard())


# --- Grafana ------------------------------------------------------------------------------

def test_dashboard_has_fixed_uid_and_datasource_variable():
    board = dashboard()
    assert board["uid"] == "ckptwatch-collisions"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("training_job", "node"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    ids = []

    def walk(panels):
        for p in panels:
            ids.append(p["id"])
            if p["type"] != "row":
                # No panel may hard-code a datasource: the variable picks it.
                assert p["datasource"]["uid"] == "${datasource}", p["title"]
                for t in p["targets"]:
                    assert t["datasource"]["uid"] == "${datasource}", p["title"]
            walk(p.get("panels", []))

    walk(board["panels"])
    assert len(ids) == len(set(ids))


def test_dashboard_covers_collisions_writes_and_ingest():
    exprs = dashboard_exprs()
    joined = "\n".join(exprs)
    for needle in ('ckptwatch_collisions_total', 'ckptwatch_last_collision_timestamp_seconds',
                   'by (training_job, rank)', 'ckptwatch_write_bytes_total',
                   'histogram_quantile(0.99', 'ckptwatch_active_writes',
                   'ckptwatch_events_received_total', 'by (reason)',
                   'ckptwatch_client_events_dropped_total'):
        assert needle in joined, needle
    # Per-training-job panels filter on the variables.
    assert all('node=~"$node"' in e for e in exprs)


def panel(title):
    def walk(panels):
        for p in panels:
            if p["title"] == title:
                return p
            found = walk(p.get("panels", []))
            if found:
                return found
    found = walk(dashboard()["panels"])
    assert found, title
    return found


def substitute(expr, values):
    """expr with Grafana's variables replaced, longest name first ($__range_s before
    $__range)."""
    for var in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${var}", values[var])
    assert "$" not in expr, expr
    return expr


def panel_expr(title, **values):
    (target,) = panel(title)["targets"]
    return substitute(target["expr"], values)


@needs_promtool
def test_collision_panels_count_a_jobs_first_collision(tmp_path):
    """A job's collision counter is born at 1: plain increase() shows 0 for its first
    collision. The panels must show it (evaluated by promtool's PromQL engine)."""
    values = {"training_job": ".*", "node": ".*"}
    series = [
        # train-a: its first concurrent collision at 30m, the series born with it.
        ('ckptwatch_collisions_total{training_job="train-a",kind="concurrent",scope="node",'
         'source="hook",instance="a:19400",node="a"}', "_x30 1x40"),
        # train-b: had one long before the range, a second at 40m.
        ('ckptwatch_collisions_total{training_job="train-b",kind="concurrent",scope="node",'
         'source="hook",instance="a:19400",node="a"}', "1x39 2x40"),
        # train-c: a redundant write at 35m, born at 1.
        ('ckptwatch_collisions_total{training_job="train-c",kind="redundant",scope="node",'
         'source="hook",instance="a:19400",node="a"}', "_x35 1x40"),
        # train-d: a size fluctuation at 45m, born at 1.
        ('ckptwatch_size_fluctuations_total{training_job="train-d",instance="a:19400",node="a"}',
         "_x45 1x40"),
    ]
    by_kind = panel_expr("Collisions by job and kind", __rate_interval="4m", **values)
    fluct = next(t["expr"] for t in panel("Corrupt checkpoints, size fluctuations, torn reads")
                 ["targets"] if "size_fluctuations" in t["expr"]).replace(
        "$__rate_interval", "4m").replace("$node", ".*")

    def case(expr, at, samples):
        return {"expr": f"round({expr}, 0.001)", "eval_time": at,
                "exp_samples": [{"labels": labels, "value": v} for labels, v in samples]}

    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "promql_expr_test": [
            # Over the last hour at 60m: train-a's first (1) + train-b's second (1).
            case(panel_expr("Concurrent collisions (time range)", __range="1h", **values),
                 "60m", [("{}", 2)]),
            case(panel_expr("Redundant writes (time range)", __range="1h", **values),
                 "60m", [("{}", 1)]),
            # The time series shows train-a's first collision when it happens...
            case(by_kind, "31m", [('{training_job="train-a",kind="concurrent",scope="node"}', 1),
                                  ('{training_job="train-b",kind="concurrent",scope="node"}', 0)]),
            # ...and train-b's increment.
            case(by_kind, "41m", [('{training_job="train-a",kind="concurrent",scope="node"}', 0),
                                  ('{training_job="train-b",kind="concurrent",scope="node"}', 1),
                                  ('{training_job="train-c",kind="redundant",scope="node"}', 0)]),
            case(fluct, "46m", [('{training_job="train-d"}', 1)]),
        ]}]}
    path = tmp_path / "panels.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    promtool("test", "rules", str(path))


def test_collision_panels_link_to_the_paths():
    """Metrics carry no paths: every collision panel links to where they are (the report)."""
    for title in ("Concurrent collisions (time range)", "Redundant writes (time range)",
                  "Last collision", "Last collision by job", "Collisions by job and kind"):
        links = panel(title).get("links", [])
        assert any(link["url"].endswith("runbook.md#finding-the-paths") for link in links), title
    text = panel("Which paths? Run ckptwatch report where the agent runs")
    assert text["type"] == "text"
    assert "ckptwatch report --journal /var/lib/ckptwatch/journal.jsonl" in \
        text["options"]["content"]


def test_no_text_panel_uses_a_variable_that_can_be_all():
    """f503c65's text panel put ${node} into `--field-selector spec.nodeName=${node}`: with
    "All" (or several nodes) selected, a command that selects nothing."""
    variables = {v["name"] for v in dashboard()["templating"]["list"] if v.get("includeAll")
                 or v.get("multi")}
    assert variables == {"node", "training_job"}

    def walk(panels):
        for p in panels:
            if p["type"] == "text":
                for name in variables:
                    assert f"${name}" not in p["options"]["content"], p["title"]
                    assert "${" + name not in p["options"]["content"], p["title"]
            walk(p.get("panels", []))
    walk(dashboard()["panels"])


def top_row():
    """The panels of the dashboard's first row, left to right."""
    panels = dashboard()["panels"]
    assert panels[0]["type"] == "row" and panels[0]["gridPos"]["y"] == 0
    end = next(i for i, p in enumerate(panels[1:], 1) if p["type"] == "row")
    return sorted(panels[1:end], key=lambda p: p["gridPos"]["x"])


def test_top_row_is_what_on_call_reads_first():
    """Collisions, corrupt checkpoints, hazards, agents down: f503c65 showed no hazards and
    corrupt checkpoints only in a time series near the bottom."""
    row = top_row()
    assert [p["type"] for p in row] == ["stat"] * 4
    exprs = [p["targets"][0]["expr"] for p in row]
    assert 'ckptwatch_collisions_total{kind="concurrent"' in exprs[0]
    assert "ckptwatch_last_corrupt_checkpoint_timestamp_seconds" in exprs[1]
    assert "ckptwatch_hazards_total" in exprs[2]
    assert exprs[3].startswith('count(up{job="ckptwatch", node=~"$node"} == 0)')
    for p in row:
        assert p["targets"][0]["expr"].endswith(" or vector(0)"), p["title"]   # 0, not "No data"
        assert p["gridPos"]["y"] == 1 and p["links"], p["title"]


def test_save_duration_panels_read_the_histogram():
    heatmap = next(p for p in dashboard()["panels"] if p["type"] == "heatmap")
    (target,) = heatmap["targets"]
    assert target["format"] == "heatmap"
    assert "by (le)" in target["expr"] and "ckptwatch_write_duration_seconds_bucket" in \
        target["expr"]


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    # promtool has no expression checker, but it parses recording rules: wrap each query.
    values = {"__rate_interval": "5m", "__range": "1h", "__range_s": "3600",
              "training_job": ".*", "node": ".*"}
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        rules.append({"record": f"dashboard:query_{i}", "expr": substitute(expr, values)})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path))


# --- Kubernetes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifests():
    docs = {}
    for name in sorted(os.listdir(K8S)):
        if name.endswith((".yaml", ".yml")) and name != "kustomization.yaml":
            docs[name] = load_all(os.path.join(K8S, name))
            assert docs[name], name
    return docs


def find(manifests, kind):
    return next(d for docs in manifests.values() for d in docs if d["kind"] == kind)


def all_containers(pod_spec):
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def test_every_object_and_pod_template_is_labelled(manifests):
    for docs in manifests.values():
        for doc in docs:
            assert doc["metadata"].get("labels"), (doc["kind"], doc["metadata"]["name"])
            template = doc.get("spec", {}).get("template")
            if template:
                assert template["metadata"].get("labels"), doc["metadata"]["name"]


def test_daemonset_hygiene(manifests):
    ds = find(manifests, "DaemonSet")
    template = ds["spec"]["template"]
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    spec = template["spec"]
    assert spec["hostPID"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    agent = next(c for c in spec["containers"] if c["name"] == "agent")

    env = {e["name"]: e for e in agent["env"]}
    assert env["CKPTWATCH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"metrics": 19400}
    assert "--web.listen-address=:19400" in agent["args"]
    assert agent["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": "metrics"}
    # Not a blanket `operator: Exists` (f503c65): it also tolerates NoExecute taints.
    assert all(t.get("key") for t in spec["tolerations"]), spec["tolerations"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}

    for c in all_containers(spec):
        sc = c["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
    # The long-running agent gets nothing back; only the init container chowns.
    assert "add" not in agent["securityContext"]["capabilities"]
    assert agent["securityContext"].get("runAsUser", 65532) != 0

    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert volumes[mounts["/run/ckptwatch"]]["hostPath"]["path"] == "/run/ckptwatch"
    assert "--ingest.socket=/run/ckptwatch/agent.sock" in agent["args"]
    # Any host path other than the agent's own two directories is mounted read-only.
    own = {"/run/ckptwatch", "/var/lib/ckptwatch"}
    for m in agent["volumeMounts"]:
        host = volumes[m["name"]].get("hostPath")
        if host and host["path"] not in own:
            assert m.get("readOnly") is True, m


def test_daemonset_args_are_valid_agent_config(manifests):
    from monitor.agent import config
    agent = next(c for c in find(manifests, "DaemonSet")["spec"]["template"]["spec"]
                 ["containers"] if c["name"] == "agent")
    cfg = config.load(agent["args"])
    assert cfg.listen_address == ":19400"
    assert cfg.socket == "/run/ckptwatch/agent.sock"


def test_training_pod_example_reaches_the_agent_socket(manifests):
    ds_spec = find(manifests, "DaemonSet")["spec"]["template"]["spec"]
    job = find(manifests, "Job")
    spec = job["spec"]["template"]["spec"]
    train = spec["containers"][0]
    # The ingest accepts a pod's own-namespace pids (NSpid), so training pods need no
    # host PID namespace: that privilege stays with the agent.
    assert "hostPID" not in spec
    assert train["command"][:3] == ["ckptwatch", "run", "--"]
    assert "torchrun" in train["command"]
    env = {e["name"]: e for e in train["env"]}
    socket = env["CKPTWATCH_SOCKET"]["value"]
    mounts = {m["mountPath"]: m["name"] for m in train["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount_dir = os.path.dirname(socket)
    assert volumes[mounts[mount_dir]]["hostPath"]["path"] == "/run/ckptwatch"
    assert env["CKPTWATCH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The socket is group-owned by the agent's group; the training pod must be in it.
    assert ds_spec["securityContext"]["runAsGroup"] in spec["securityContext"][
        "supplementalGroups"]


def test_podmonitor_scrapes_named_port_without_honor_labels(manifests):
    ds = find(manifests, "DaemonSet")
    pm = find(manifests, "PodMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # The job name comes from this pod label; CkptwatchAgentDown expects "ckptwatch".
    assert pod_labels[pm["spec"]["jobLabel"]] == "ckptwatch"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and not endpoint.get("honorLabels", False)


# --- systemd and Docker -------------------------------------------------------------------

def unit_settings():
    settings: dict[str, list[str]] = {}
    with open(UNIT) as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value.strip())
    return settings


def test_systemd_unit_is_hardened_and_runs_the_agent():
    s = unit_settings()
    exec_start = shlex.split(s["ExecStart"][0])
    assert exec_start[1] == "agent"
    from monitor.agent import config
    assert config.load(exec_start[2:]).socket == "/run/ckptwatch/agent.sock"
    assert s["User"] == ["ckptwatch"]
    assert s["CapabilityBoundingSet"] == [""]
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "RuntimeDirectory": "ckptwatch", "StateDirectory": "ckptwatch"}.items():
        assert s[key] == [value], key
    # The agent must see the real /tmp: checkpoints saved there are verified, and
    # --watch.path may name a directory under it. ProtectSystem=strict keeps /tmp read-only
    # for the agent, which never writes there.
    assert s.get("PrivateTmp", ["no"]) == ["no"]
    assert not any("/tmp" in v for v in s.get("ReadWritePaths", []) + s.get("TemporaryFileSystem", []))
    assert "ProtectProc" not in s  # the agent must see training processes in /proc


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify(tmp_path):
    # verify insists that ExecStart exists and is executable: a stand-in for the installed
    # console script, so that the check needs no `pip install` of this checkout.
    exe = str(tmp_path / "ckptwatch")
    with open(exe, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -m monitor.cli.main \"$@\"\n")
    os.chmod(exe, 0o755)
    with open(UNIT) as f:
        text = f.read().replace("/usr/local/bin/ckptwatch", exe)
    unit = tmp_path / "ckptwatch-agent.service"
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def lock_pins():
    pins = {}
    with open(LOCK) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_dockerfile_is_multi_stage_with_pinned_dependencies():
    stages = dockerfile_stages()
    assert len(stages) == 2 and stages[0][0] == "python:3.11-slim AS build"
    assert stages[1][0] == "python:3.11-slim"
    runs = [arg for kind, arg in stages[0][1] if kind == "RUN"]
    assert any("pip install" in r and "-c deploy/requirements.lock" in r and "'.[fast]'" in r
               for r in runs), runs
    by_kind = final_stage()
    # The runtime stage takes the built venv, not the sources or a compiler.
    assert "COPY --from=build /opt/ckptwatch /opt/ckptwatch" in [
        f"COPY {a}" for a in by_kind["COPY"]]
    assert not any("pip install" in r for r in by_kind["RUN"])


def test_lock_pins_every_dependency_within_pyproject():
    import tomllib
    from packaging.requirements import Requirement
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    pins = lock_pins()
    wanted = project["dependencies"] + project["optional-dependencies"]["fast"]
    for spec in map(Requirement, wanted):
        name = re.sub(r"[-_.]+", "-", spec.name).lower()
        assert name in pins, f"{spec.name} is not pinned in deploy/requirements.lock"
        assert spec.specifier.contains(pins[name]), (spec, pins[name])


def test_dockerfile_copies_everything_the_package_needs():
    import tomllib
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    copied = set()
    for kind, arg in dockerfile_stages()[0][1]:
        if kind == "COPY":
            for src in arg.split()[:-1]:
                assert os.path.exists(os.path.join(REPO_ROOT, src)), src
                copied.add(src.rstrip("/"))
    for package in pyproject["tool"]["setuptools"]["packages"]:
        assert package.split(".")[0] in copied, package
    for name in pyproject["project"]["license-files"] + [pyproject["project"]["readme"]]:
        assert name in copied, name
    for kind, arg in dockerfile_stages()[1][1]:
        if kind == "COPY" and not arg.startswith("--from"):
            assert os.path.exists(os.path.join(REPO_ROOT, arg.split()[0])), arg


def test_image_runs_as_its_user_with_home_and_directories():
    by_kind = final_stage()
    user = by_kind["USER"][-1]
    uid, gid = user.split(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    env = image_env()
    assert env["HOME"] == "/home/ckptwatch"
    assert env["PATH"].startswith("/opt/ckptwatch/bin:")
    # The directories are made for exactly the USER's ids.
    assert any(r.endswith(f"image-dirs.sh {uid} {gid}") for r in by_kind["RUN"])
    with open(IMAGE_DIRS) as f:
        script = f.read()
    for d in ("/run/ckptwatch", "/var/lib/ckptwatch", env["HOME"]):
        assert d in script, d
    assert by_kind["EXPOSE"] == ["19400"]
    from monitor.agent import config
    cmd = default_command()
    assert cmd[:2] == ["ckptwatch", "agent"]
    cfg = config.load(cmd[2:])
    assert cfg.listen_address == ":19400"
    assert cfg.socket == "/run/ckptwatch/agent.sock"
    assert cfg.journal_path == "/var/lib/ckptwatch/journal.jsonl"
