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
        "daemonset": ["ConfigMap", "DaemonSet", "PodMonitor", "PriorityClass", "PrometheusRule",
                      "ServiceAccount"],
        "daemonset-servicemonitor": ["ConfigMap", "DaemonSet", "Namespace", "PriorityClass",
                                     "PrometheusRule", "Service", "ServiceAccount",
                                     "ServiceMonitor"],
        "sidecar": ["ConfigMap", "Job", "PodMonitor", "PrometheusRule"],
    }[mode]
    assert kinds == expected
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "ckptwatch", d["kind"]


def test_invalid_values_fail(tools):
    for args, says in (
            (["--set", "mode=both"], "mode"),
            (["--set", "monitoring.serviceMonitor.enabled=true"], "not both"),
            (["--set", "mode=sidecar", "--set", "monitoring.podMonitor.enabled=false",
              "--set", "monitoring.serviceMonitor.enabled=true"], "needs mode=daemonset"),
            (["--set", "agent.logLevel=loud"], "logLevel"),
            (["--set", "daemonset.watchCapabilities={NET_ADMIN}"], "watchCapabilities"),
            (["--set", "daemonset.watchCapabilities={SYS_PTRACE}"], "for daemonset.watchPaths"),
            (["--set", "daemonset.watchPaths[0].path=relative/dir"], "path")):
        result = run(tools["helm"], "template", "ckw", CHART, *args, check=False)
        assert result.returncode != 0, args
        assert says in result.stderr, (args, result.stderr)


def test_sidecar_with_a_service_monitor_says_what_is_wrong(tools):
    """f503c65 answered mode=sidecar + serviceMonitor with "enable one of podMonitor and
    serviceMonitor, not both" (the PodMonitor is on by default): the wrong reason."""
    result = run(tools["helm"], "template", "ckw", CHART, "--set", "mode=sidecar",
                 "--set", "monitoring.serviceMonitor.enabled=true", check=False)
    assert result.returncode != 0
    assert "monitoring.serviceMonitor needs mode=daemonset" in result.stderr
    assert "not both" not in result.stderr


@pytest.mark.parametrize("typo", ["podAnotations.a=b", "agent.logLvl=debug",
                                  "daemonset.watchPath[0].path=/x", "monitoring.intervall=5s",
                                  "serviceAccount.create=true,serviceAccount.automount=false"])
def test_values_schema_rejects_unknown_keys(tools, typo):
    """f503c65 had no values.schema.json: a misspelt value was ignored silently."""
    result = run(tools["helm"], "template", "ckw", CHART, "--set", typo, check=False)
    assert result.returncode != 0, typo
    assert "additional properties" in result.stderr, result.stderr


def _schema_keys(schema, prefix=""):
    keys = set()
    for name, sub in schema.get("properties", {}).items():
        keys.add(prefix + name)
        if sub.get("type") == "object" and "properties" in sub:
            assert sub["additionalProperties"] is False, prefix + name
            keys |= _schema_keys(sub, prefix + name + ".")
    return keys


def _value_keys(values, schema, prefix=""):
    keys = set()
    for name, value in values.items():
        keys.add(prefix + name)
        sub = schema.get("properties", {}).get(name, {})
        if isinstance(value, dict) and "properties" in sub:
            keys |= _value_keys(value, sub, prefix + name + ".")
    return keys


def test_schema_describes_exactly_the_values():
    with open(os.path.join(CHART, "values.schema.json")) as f:
        schema = json.load(f)
    with open(os.path.join(CHART, "values.yaml")) as f:
        values = yaml.safe_load(f)
    assert schema["additionalProperties"] is False
    assert _schema_keys(schema) == _value_keys(values, schema)


EVERYTHING = {
    "nameOverride": "ckw-agent-x", "fullnameOverride": "",
    "podAnnotations": {"example.com/scraped-by": "prom"},
    "podLabels": {"team": "ml-platform"},
    "podSecurityContext": {"fsGroup": 65532},
    "securityContext": {"seLinuxOptions": {"type": "spc_t"}},
    "serviceAccount": {"create": True, "name": "ckw-sa", "annotations": {"a": "b"}},
    "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
    "agent": {"extraEnv": [{"name": "TZ", "value": "UTC"}],
              "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ca", "readOnly": True}],
              "extraArgs": ["--metrics.max-jobs=200"], "logLevel": "WARN"},
    "daemonset": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                                                {"nodeSelectorTerms": [{"matchExpressions": [
                                                    {"key": "pool", "operator": "In",
                                                     "values": ["gpu"]}]}]}}},
                  "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                   "effect": "NoSchedule"}],
                  "watchPaths": [{"path": "/mnt/ckpt"}],
                  "watchCapabilities": ["SYS_PTRACE", "DAC_READ_SEARCH"]},
    "monitoring": {"podMonitor": {"enabled": False}, "serviceMonitor": {"enabled": True},
                   "scrapeTimeout": "10s",
                   "relabelings": [{"targetLabel": "cluster", "replacement": "eu-1"}],
                   "metricRelabelings": [{"sourceLabels": ["__name__"],
                                          "regex": "process_.*", "action": "drop"}]},
}


@pytest.fixture(scope="module")
def everything(tools, tmp_path_factory):
    path = tmp_path_factory.mktemp("values") / "everything.yaml"
    path.write_text(yaml.safe_dump(EVERYTHING))
    return render(tools, "-f", str(path))


def test_every_value_lands_and_validates(everything):
    """Every option of the chart at once, rendered by the real helm and validated against the
    Kubernetes 1.37 schemas (strict)."""
    assert {validate(d) for d in everything} == {"schema", "crd"}
    ds = by_kind(everything, "DaemonSet")
    template = ds["spec"]["template"]
    spec = template["spec"]
    assert template["metadata"]["annotations"] == {"example.com/scraped-by": "prom"}
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "ckw-agent-x"
    assert ds["metadata"]["name"] == "ckw-ckw-agent-x-agent"
    assert spec["securityContext"]["fsGroup"] == 65532
    assert spec["securityContext"]["runAsNonRoot"] is True          # merged, not replaced
    assert spec["serviceAccountName"] == "ckw-sa"
    assert spec["affinity"]["nodeAffinity"]
    assert spec["tolerations"] == EVERYTHING["daemonset"]["tolerations"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in spec["volumes"]
    agent = agent_container(spec)
    assert {"name": "TZ", "value": "UTC"} in agent["env"]
    assert {"name": "ca", "mountPath": "/etc/ca", "readOnly": True} in agent["volumeMounts"]
    assert "--metrics.max-jobs=200" in agent["args"] and "--log.level=WARN" in agent["args"]
    assert agent["securityContext"]["seLinuxOptions"] == {"type": "spc_t"}
    sa = by_kind(everything, "ServiceAccount")
    assert sa["metadata"]["name"] == "ckw-sa" and sa["metadata"]["annotations"] == {"a": "b"}
    assert sa["automountServiceAccountToken"] is False
    sm = by_kind(everything, "ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    # The job label the rules match survives nameOverride (app.kubernetes.io/name changed).
    assert ep["relabelings"][0] == {"targetLabel": "job", "replacement": "ckptwatch"}
    assert ep["relabelings"][-1] == {"targetLabel": "cluster", "replacement": "eu-1"}
    assert ep["metricRelabelings"] == EVERYTHING["monitoring"]["metricRelabelings"]
    assert ep["scrapeTimeout"] == "10s"
    svc = by_kind(everything, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()


def test_watch_capabilities_run_the_agent_as_uid_0_with_only_those(tools, everything):
    """Kubernetes grants an added capability to uid 0 only (no ambient capabilities): with
    watchCapabilities the agent is uid 0 with every other capability dropped, and its host
    directories are handed to uid 0. Without them it stays uid 65532 with none."""
    spec = pod_specs(by_kind(everything, "DaemonSet"))[0]
    sc = agent_container(spec)["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    (init,) = spec["initContainers"]
    assert init["command"][2].startswith("chown 0:65532 ")
    default = agent_container(pod_specs(by_kind(render(tools), "DaemonSet"))[0])
    assert default["securityContext"]["runAsUser"] == 65532
    assert "add" not in default["securityContext"]["capabilities"]


def test_sidecar_journal_claim_keeps_each_pods_journal(tools):
    job = by_kind(render(tools, *MODES["sidecar"], "--set",
                         "sidecar.exampleJob.journalClaim=ckptwatch-journals",
                         namespace="training"), "Job")
    validate(job)
    spec = pod_specs(job)[0]
    agent = agent_container(spec)
    (mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == "/var/lib/ckptwatch"]
    assert mount["subPathExpr"] == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in agent["env"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["persistentVolumeClaim"] == {"claimName": "ckptwatch-journals"}


def test_alerts_name_the_daemonsets_journal(tools):
    rule = by_kind(render(tools, "--set", "daemonset.journalDir=/srv/ckptwatch"),
                   "PrometheusRule")
    text = json.dumps(rule["spec"])
    assert "--journal /srv/ckptwatch/journal.jsonl" in text
    assert "/var/lib/ckptwatch/journal.jsonl" not in text


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
