"""The Helm chart (deploy/helm/ckptwatch) with real helm and kubectl binaries: lint, render each
mode, validate against the Kubernetes schemas, and keep it in step with the plain manifests,
the alert rules and the dashboard. helm/kubectl come from scripts/fetch-k8s-tools (cached
outside the repository); the tests skip, quoting why, when they cannot be obtained."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from helpers import REPO_ROOT
from k8sdocs import (agent_container, check_sidecar_pod, load_all, pod_specs,
                     restricted_violations, validate)

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")

CHART = os.path.join(REPO_ROOT, "deploy", "helm", "ckptwatch")
RULES = os.path.join(REPO_ROOT, "deploy", "prometheus", "ckptwatch-rules.yml")
DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana", "ckptwatch-dashboard.json")
PLAIN_DAEMONSET = os.path.join(REPO_ROOT, "deploy", "kubernetes", "daemonset")
PLAIN_SIDECAR_JOB = os.path.join(REPO_ROOT, "deploy", "kubernetes", "sidecar", "job.yaml")

MODES = {
    "daemonset": [],
    "daemonset-servicemonitor": ["--set", "monitoring.podMonitor.enabled=false",
                                 "--set", "monitoring.serviceMonitor.enabled=true",
                                 "--set", "namespace.create=true"],
    "sidecar": ["--set", "mode=sidecar", "--set", "sidecar.exampleJob.enabled=true"],
}


@pytest.fixture(scope="module")
def tools():
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts",
                                                          "fetch-k8s-tools")],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.skip(f"helm/kubectl unobtainable: {result.stderr.strip()}")
    directory = result.stdout.strip().splitlines()[-1]
    return {name: os.path.join(directory, name) for name in ("helm", "kubectl")}


def run(binary, *args, check=True):
    result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def render(tools, *args, namespace="ckptwatch"):
    out = run(tools["helm"], "template", "ckw", CHART, "--namespace", namespace, *args).stdout
    return load_all(out)


def by_kind(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def test_tool_versions(tools):
    assert "v4.3.1" in run(tools["helm"], "version", "--short").stdout
    assert "v1.37.1" in run(tools["kubectl"], "version", "--client").stdout


@pytest.mark.parametrize("mode", sorted(MODES))
def test_helm_lint(tools, mode):
    out = run(tools["helm"], "lint", "--strict", CHART, *MODES[mode]).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_rendered_objects_validate(tools, mode):
    docs = render(tools, *MODES[mode])
    checked = {validate(d) for d in docs}
    assert checked == {"schema", "crd"}
    kinds = sorted(d["kind"] for d in docs)
    expected = {
        "daemonset": ["ConfigMap", "DaemonSet", "PodMonitor", "PriorityClass", "PrometheusRule"],
        "daemonset-servicemonitor": ["ConfigMap", "DaemonSet", "Namespace", "PriorityClass",
                                     "PrometheusRule", "Service", "ServiceMonitor"],
        "sidecar": ["ConfigMap", "Job", "PodMonitor", "PrometheusRule"],
    }[mode]
    assert kinds == expected
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "ckptwatch", d["kind"]


def test_invalid_values_fail(tools):
    for args in (["--set", "mode=both"],
                 ["--set", "monitoring.serviceMonitor.enabled=true"],
                 ["--set", "mode=sidecar", "--set", "monitoring.podMonitor.enabled=false",
                  "--set", "monitoring.serviceMonitor.enabled=true"]):
        result = run(tools["helm"], "template", "ckw", CHART, *args, check=False)
        assert result.returncode != 0, args


def test_daemonset_matches_the_plain_manifest(tools):
    """The chart and deploy/kubernetes/daemonset/ describe the same agent pod."""
    chart = pod_specs(by_kind(render(tools), "DaemonSet"))[0]
    plain = pod_specs(next(d for d in load_all(os.path.join(PLAIN_DAEMONSET, "daemonset.yaml"))
                           if d["kind"] == "DaemonSet"))[0]
    for key in ("hostPID", "priorityClassName", "securityContext", "tolerations", "volumes"):
        assert chart[key] == plain[key], key
    a, b = agent_container(chart), agent_container(plain)
    for key in ("args", "env", "ports", "resources", "volumeMounts", "readinessProbe",
                "livenessProbe"):
        assert a[key] == b[key], key
    # The chart states runAsUser/runAsNonRoot on the container too; nothing else differs.
    assert {k: v for k, v in a["securityContext"].items()
            if k not in ("runAsUser", "runAsGroup", "runAsNonRoot")} == b["securityContext"]
    init_chart, init_plain = chart["initContainers"][0], plain["initContainers"][0]
    assert init_chart["command"] == init_plain["command"]
    assert init_chart["securityContext"] == init_plain["securityContext"]


def test_daemonset_watch_paths_are_read_only_host_mounts(tools):
    spec = pod_specs(by_kind(render(tools, "--set", "daemonset.watchPaths[0].path=/mnt/ckpt"),
                             "DaemonSet"))[0]
    agent = agent_container(spec)
    assert "--watch.path=/mnt/ckpt" in agent["args"]
    (mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == "/mnt/ckpt"]
    assert mount["readOnly"] is True
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["hostPath"]["path"] == "/mnt/ckpt"


def test_sidecar_example_job_is_the_plain_one(tools):
    job = by_kind(render(tools, *MODES["sidecar"], namespace="training"), "Job")
    spec = pod_specs(job)[0]
    check_sidecar_pod(spec, "Job")
    assert restricted_violations(spec) == []
    plain = pod_specs(load_all(PLAIN_SIDECAR_JOB)[0])[0]
    a, b = agent_container(spec), agent_container(plain)
    for key in ("args", "env", "ports", "resources", "volumeMounts", "startupProbe",
                "restartPolicy"):
        assert a[key] == b[key], key
    assert spec["volumes"] == plain["volumes"]
    assert spec["securityContext"] == plain["securityContext"]


def test_sidecar_podmonitor_selects_the_example(tools):
    docs = render(tools, *MODES["sidecar"], namespace="training")
    pm, job = by_kind(docs, "PodMonitor"), by_kind(docs, "Job")
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["selector"]["matchLabels"].items() <= \
        job["spec"]["template"]["metadata"]["labels"].items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in {p["name"] for p in agent_container(pod_specs(job)[0])["ports"]}
    assert {"targetLabel": "job", "replacement": "ckptwatch"} in ep["relabelings"]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_monitoring_objects_carry_the_release_label(tools, mode):
    for d in render(tools, *MODES[mode], "--set", "monitoring.labels.release=prom"):
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            assert d["metadata"]["labels"]["release"] == "prom", d["kind"]


def test_chart_sources_are_links_to_the_deploy_files():
    for name, target in (("ckptwatch-rules.yml", RULES),
                         ("ckptwatch-dashboard.json", DASHBOARD)):
        path = os.path.join(CHART, "files", name)
        assert os.path.islink(path), f"{path} must stay a symbolic link (one source of truth)"
        assert os.path.realpath(path) == os.path.realpath(target)


def _without_runbook_urls(groups):
    for g in groups:
        for r in g["rules"]:
            r.get("annotations", {}).pop("runbook_url", None)
    return groups


def test_prometheus_rule_is_the_rules_file(tools):
    with open(RULES) as f:
        source = yaml.safe_load(f)
    base = "https://runbooks.example.com/ckptwatch.md"
    rule = by_kind(render(tools, "--set", f"prometheusRule.runbookBaseURL={base}"),
                   "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"]
            for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith(base + "#") for u in urls), urls
    anchors = [r["annotations"]["runbook_url"].split("#", 1)[1] for g in source["groups"]
               for r in g["rules"] if "alert" in r]
    assert [u.split("#", 1)[1] for u in urls] == anchors
    assert _without_runbook_urls(rule["spec"]["groups"]) == \
        _without_runbook_urls(source["groups"])


def test_dashboard_configmap(tools):
    cm = by_kind(render(tools, "--set", "dashboard.namespace=monitoring"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    (key,) = cm["data"]
    with open(DASHBOARD) as f:
        assert json.loads(cm["data"][key]) == json.load(f)


def test_plain_daemonset_kustomization_builds_and_validates(tools):
    out = run(tools["kubectl"], "kustomize", PLAIN_DAEMONSET).stdout
    docs = load_all(out)
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "Namespace", "PodMonitor",
                                                "PriorityClass"]
    for d in docs:
        validate(d)
