"""Kubernetes manifests (deploy/kubernetes): schemas, Pod Security, how the agent and training
pods meet in each mode, and limits that agree with the systemd unit and the Helm chart."""
from __future__ import annotations

import errno
import os
import re
import socket
import stat
import tempfile

import pytest
import yaml

from ckptwatch import paths
from helpers import REPO_ROOT
from k8sdocs import (AGENT_UID, CRD_CHECKS, K8S_VERSION, agent_container, baseline_violations,
                     check_sidecar_pod, load_all, parse_quantity, pod_specs, restricted_violations,
                     validate)

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed "
                    "(requirements-test.txt)")

K8S = os.path.join(REPO_ROOT, "deploy", "kubernetes")
DAEMONSET_DIR = os.path.join(K8S, "daemonset")
SIDECAR_DIR = os.path.join(K8S, "sidecar")
UNIT = os.path.join(REPO_ROOT, "deploy", "systemd", "ckptwatch-agent.service")
HELM_VALUES = os.path.join(REPO_ROOT, "deploy", "helm", "ckptwatch", "values.yaml")
SIDECAR_WORKLOADS = ("job.yaml", "pytorchjob.yaml")


def manifest_files():
    out = []
    for root, _dirs, files in os.walk(K8S):
        for name in sorted(files):
            if name.endswith((".yaml", ".yml")) and name != "kustomization.yaml":
                out.append(os.path.relpath(os.path.join(root, name), K8S))
    return sorted(out)


def docs_of(relpath):
    return load_all(os.path.join(K8S, relpath))


def the(kind, directory):
    found = [d for name in sorted(os.listdir(directory)) if name.endswith(".yaml")
             and name != "kustomization.yaml"
             for d in load_all(os.path.join(directory, name)) if d["kind"] == kind]
    assert len(found) == 1, (kind, directory, len(found))
    return found[0]


# --- schemas ------------------------------------------------------------------------------

def test_manifest_tree_is_what_the_readme_describes():
    assert set(manifest_files()) >= {
        "daemonset/namespace.yaml", "daemonset/priorityclass.yaml", "daemonset/daemonset.yaml",
        "daemonset/podmonitor.yaml", "daemonset/service.yaml", "daemonset/servicemonitor.yaml",
        "daemonset/training-job.yaml", "sidecar/namespace.yaml", "sidecar/job.yaml",
        "sidecar/pytorchjob.yaml", "sidecar/podmonitor.yaml"}


@pytest.mark.parametrize("relpath", manifest_files())
def test_manifest_validates_against_kubernetes_schemas(relpath):
    docs = docs_of(relpath)
    assert docs
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("labels"), (relpath, doc["metadata"]["name"])
        for spec in pod_specs(doc):
            assert spec is not None


def test_schema_validation_can_fail():
    job = docs_of("sidecar/job.yaml")[0]
    job["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(AssertionError, match="restartPolicyy"):
        validate(job)


@pytest.mark.parametrize("api_version,kind", sorted(CRD_CHECKS))
def test_custom_resources_have_no_core_schema(api_version, kind):
    """Why these kinds get our structural checks instead: kubernetes-validate has only the
    core API's schemas. Fails (and the check can be replaced) if a schema ever appears."""
    import kubernetes_validate
    doc = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}, "spec": {}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_the_agent_manifests():
    kust = yaml.safe_load(open(os.path.join(DAEMONSET_DIR, "kustomization.yaml")))
    assert kust["resources"] == ["namespace.yaml", "priorityclass.yaml", "daemonset.yaml",
                                 "podmonitor.yaml"]


# --- Pod Security -------------------------------------------------------------------------

@pytest.mark.parametrize("name", SIDECAR_WORKLOADS)
def test_sidecar_workloads_pass_pod_security_restricted(name):
    (doc,) = docs_of(f"sidecar/{name}")
    assert doc["metadata"]["namespace"] == "training"
    for spec in pod_specs(doc):
        assert restricted_violations(spec) == []
    ns = the("Namespace", SIDECAR_DIR)
    assert ns["metadata"]["name"] == "training"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_daemonset_mode_needs_privileged_and_says_so():
    # The checker flags exactly what the namespace comment names: hostPID and hostPath.
    ds_spec = pod_specs(the("DaemonSet", DAEMONSET_DIR))[0]
    assert set(baseline_violations(ds_spec)) == {
        "hostPID", "hostPath volume socket-dir", "hostPath volume journal-dir"}
    train_spec = pod_specs(the("Job", DAEMONSET_DIR))[0]
    assert baseline_violations(train_spec) == ["hostPath volume ckptwatch"]
    ns = the("Namespace", DAEMONSET_DIR)
    assert ns["metadata"]["name"] == the("DaemonSet", DAEMONSET_DIR)["metadata"]["namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    with open(os.path.join(DAEMONSET_DIR, "namespace.yaml")) as f:
        comment = f.read()
    assert "hostPath" in comment and "hostPID" in comment and "baseline" in comment


def test_daemonset_has_a_priority_class_that_never_preempts_training():
    ds_spec = pod_specs(the("DaemonSet", DAEMONSET_DIR))[0]
    pc = the("PriorityClass", DAEMONSET_DIR)
    assert ds_spec["priorityClassName"] == pc["metadata"]["name"]
    assert pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    assert 0 < pc["value"] < 1_000_000_000       # below the system-* classes


# --- how the training side reaches the agent ----------------------------------------------

def test_daemonset_training_pod_mounts_the_socket_directory_read_only():
    spec = pod_specs(the("Job", DAEMONSET_DIR))[0]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"]
                if m["mountPath"] == "/run/ckptwatch"]
    assert mount["readOnly"] is True


def _shipped_socket_dir_mode(ds_spec) -> int:
    (init,) = [c for c in ds_spec["initContainers"] if c["name"] == "prepare-host-dirs"]
    match = re.search(r"chmod (\d{4}) /run/ckptwatch\b", init["command"][-1])
    return int(match.group(1), 8)


def test_group_member_cannot_replace_the_socket_in_the_shipped_directory_mode():
    """The DaemonSet's socket directory mode, for real: the agent accepts it, a process in
    the socket's group can connect but cannot remove, rename or plant a socket there."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as two different users")
    mode = _shipped_socket_dir_mode(pod_specs(the("DaemonSet", DAEMONSET_DIR))[0])
    assert mode == 0o2750
    trainer_uid = 1000
    base = tempfile.mkdtemp(prefix="ckw-k8s-", dir="/tmp")
    os.chmod(base, 0o755)
    directory = os.path.join(base, "ckptwatch")
    os.mkdir(directory)
    sock_path = os.path.join(directory, "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(sock_path)
        listener.listen(4)
        os.chmod(sock_path, 0o660)
        os.chown(sock_path, AGENT_UID, AGENT_UID)
        os.chown(directory, AGENT_UID, AGENT_UID)
        os.chmod(directory, mode)
        assert stat.S_IMODE(os.lstat(directory).st_mode) == mode
        assert paths.directory_problem(directory, AGENT_UID) is None

        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:     # the training pod: another uid, in the agent's group
            results = []
            try:
                os.setgroups([AGENT_UID])
                os.setgid(trainer_uid)
                os.setuid(trainer_uid)
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(sock_path)
                results.append("connect:ok")
                for name, attempt in (
                        ("unlink", lambda: os.unlink(sock_path)),
                        ("rename", lambda: os.rename(sock_path, sock_path + ".old")),
                        ("bind", lambda: socket.socket(socket.AF_UNIX).bind(
                            os.path.join(directory, "other.sock")))):
                    try:
                        attempt()
                        results.append(f"{name}:ok")
                    except OSError as exc:
                        results.append(f"{name}:{errno.errorcode[exc.errno]}")
            except BaseException as exc:          # report, never run the parent's code
                results.append(f"error:{exc!r}")
            os.write(w, " ".join(results).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            got = f.read().split()
        assert got == ["connect:ok", "unlink:EACCES", "rename:EACCES", "bind:EACCES"]
        assert os.path.exists(sock_path)
    finally:
        listener.close()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
        os.rmdir(base)


@pytest.mark.parametrize("name", SIDECAR_WORKLOADS)
def test_sidecar_wiring(name):
    (doc,) = docs_of(f"sidecar/{name}")
    for spec in pod_specs(doc):
        check_sidecar_pod(spec, doc["kind"])


def test_sidecar_podmonitor_finds_the_sidecars():
    pm = the("PodMonitor", SIDECAR_DIR)
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert {"targetLabel": "job", "replacement": "ckptwatch"} in endpoint["relabelings"]
    for name in SIDECAR_WORKLOADS:
        (doc,) = docs_of(f"sidecar/{name}")
        template = (doc["spec"]["template"] if doc["kind"] == "Job"
                    else doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"])
        assert pm["spec"]["selector"]["matchLabels"].items() <= \
            template["metadata"]["labels"].items()
        ports = {p["name"] for p in agent_container(template["spec"])["ports"]}
        assert endpoint["port"] in ports


def test_node_monitors_carry_the_kube_prometheus_stack_release_label():
    for kind in ("PodMonitor", "ServiceMonitor"):
        mon = the(kind, DAEMONSET_DIR)
        assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    svc = the("Service", DAEMONSET_DIR)
    ds = the("DaemonSet", DAEMONSET_DIR)
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    sm = the("ServiceMonitor", DAEMONSET_DIR)
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "ckptwatch"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


# --- limits agree everywhere --------------------------------------------------------------

def unit_limits():
    text = open(UNIT).read()
    memory = re.search(r"^MemoryMax=(\d+)([KMG]?)$", text, re.M)
    cpu = re.search(r"^CPUQuota=(\d+)%$", text, re.M)
    assert memory and cpu, "the unit sets MemoryMax= and CPUQuota="
    # systemd's K/M/G are powers of 1024.
    factor = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[memory.group(2)]
    return {"memory": int(memory.group(1)) * factor, "cpu": int(cpu.group(1)) / 100}


def test_agent_limits_agree_across_kubernetes_helm_and_systemd():
    expected = unit_limits()
    seen = {}
    sources = [("daemonset", pod_specs(the("DaemonSet", DAEMONSET_DIR))[0])]
    for name in SIDECAR_WORKLOADS:
        (doc,) = docs_of(f"sidecar/{name}")
        sources += [(name, s) for s in pod_specs(doc)]
    for label, spec in sources:
        seen[label] = agent_container(spec)["resources"]["limits"]
    seen["helm values"] = yaml.safe_load(open(HELM_VALUES))["agent"]["resources"]["limits"]
    for label, limits in seen.items():
        got = {"memory": parse_quantity(limits["memory"]), "cpu": parse_quantity(limits["cpu"])}
        assert got == expected, (label, got, expected)


def test_quantity_parser():
    assert parse_quantity("512Mi") == 512 * 1024**2
    assert parse_quantity("50m") == 0.05 and parse_quantity("1") == 1
    assert parse_quantity("1Gi") == 1024**3
