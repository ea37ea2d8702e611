"""Kubernetes manifests for the deploy tests: loading, schema validation, Pod Security checks.

Schemas: kubernetes-validate's copy of the Kubernetes 1.37 OpenAPI schemas, strict (unknown
fields are errors). Custom resources have no schema there; CRD_CHECKS lists the kinds we ship
and the minimal structure each must have instead (the Prometheus Operator's and the training
operator's CRDs are not vendored here).
"""
from __future__ import annotations

import os
import re

import yaml

from monitor.agent import config

K8S_VERSION = "1.37.0"


def load_all(path_or_text: str) -> list[dict]:
    text = path_or_text
    if os.path.exists(path_or_text):
        with open(path_or_text) as f:
            text = f.read()
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _monitor_checks(doc, endpoints_key):
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"], doc["metadata"]["name"]
    ns = spec["namespaceSelector"]
    assert ns.get("any") is True or ns.get("matchNames"), doc["metadata"]["name"]
    for ep in spec[endpoints_key]:
        assert isinstance(ep["port"], str) and ep["path"] == "/metrics", ep
        assert not ep.get("honorLabels", False), ep
        for r in ep.get("relabelings", []):
            assert r["targetLabel"], r


def _rule_checks(doc):
    for group in doc["spec"]["groups"]:
        assert group["name"] and group["rules"], group
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule) and rule["expr"], rule


def _pytorchjob_checks(doc):
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert "Master" in specs, "a PyTorchJob needs a Master replica"
    for name, replica in specs.items():
        assert isinstance(replica["replicas"], int), name
        names = [c["name"] for c in replica["template"]["spec"]["containers"]]
        # The training operator finds the trainer by this container name.
        assert "pytorch" in names, name
        validate_core(pod_template(replica["template"], f"{doc['metadata']['name']}-{name}"))


CRD_CHECKS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): lambda d: _monitor_checks(d, "podMetricsEndpoints"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): lambda d: _monitor_checks(d, "endpoints"),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _rule_checks,
    ("kubeflow.org/v1", "PyTorchJob"): _pytorchjob_checks,
}


def pod_template(template: dict, name: str) -> dict:
    """A core PodTemplate wrapping `template`, so a CRD's pod template gets the real schema."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": template}


def validate_core(doc: dict) -> None:
    import kubernetes_validate
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{doc['kind']} {doc['metadata'].get('name')}: {exc.message} "
                             f"at {list(exc.absolute_path)}") from None


def validate(doc: dict) -> str:
    """Validate one document; returns "schema" or "crd" (how it was checked)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_CHECKS:
        CRD_CHECKS[key](doc)
        return "crd"
    validate_core(doc)
    return "schema"


def pod_specs(doc: dict) -> list[dict]:
    """Every pod spec in a workload document (Job, DaemonSet, PyTorchJob replicas)."""
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    template = doc.get("spec", {}).get("template")
    return [template["spec"]] if template else []


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


# --- Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/)

RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret"}


def baseline_violations(spec: dict) -> list[str]:
    out = []
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        if spec.get(key):
            out.append(key)
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            out.append(f"hostPath volume {v['name']}")
    for c in containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                out.append(f"{c['name']}: hostPort")
        allowed = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
        for cap in sc.get("capabilities", {}).get("add", []):
            if cap not in allowed:
                out.append(f"{c['name']}: adds {cap}")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            out.append(f"{c['name']}: seccomp Unconfined")
    return out


def restricted_violations(spec: dict) -> list[str]:
    out = baseline_violations(spec)
    pod_sc = spec.get("securityContext", {})
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    for c in containers(spec):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds {caps['add']}")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccomp {seccomp}")
    return out


# ---- the agent in a pod (the manifests' sidecar and the Helm chart's example Job) ----------

AGENT_UID = 65532


def agent_container(spec):
    (agent,) = [c for c in containers(spec) if c.get("image", "").startswith("ckptwatch:")
                and c["name"] != "prepare-host-dirs"]
    return agent


def agent_config(args):
    """The agent's Config for `args`, and its --ingest.socket-group as a number. The group is
    taken out before loading: config checks that the gid exists, which it does in the image
    (group ckptwatch, 65532) but need not on the test host."""
    group = [a for a in args if a.startswith("--ingest.socket-group=")]
    cfg = config.load([a for a in args if a not in group])
    return cfg, (int(group[0].split("=", 1)[1]) if group else None)


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def check_sidecar_pod(spec, kind):
    """The sidecar pod's contract (also applied to the Helm chart's example Job)."""
    assert spec["shareProcessNamespace"] is True      # the agent's pid check sees the trainer
    assert "hostPID" not in spec
    agent = agent_container(spec)
    assert agent in spec["initContainers"] and agent["restartPolicy"] == "Always"
    cfg, socket_group = agent_config(agent["args"])
    trainer = next(c for c in spec["containers"] if c["name"] in ("train", "pytorch"))
    env = env_of(trainer)
    # The hook sends exactly where the agent listens.
    assert env["CKPTWATCH_SOCKET"]["value"] == cfg.socket
    for c in (agent, trainer):
        assert env_of(c)["CKPTWATCH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "spec.nodeName"
    job_field = env["CKPTWATCH_JOB"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert job_field == {"Job": "metadata.labels['batch.kubernetes.io/job-name']",
                         "PyTorchJob": "metadata.labels['training.kubeflow.org/job-name']"}[kind]

    volumes = {v["name"]: v for v in spec["volumes"]}
    agent_mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    trainer_mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    # The socket sits in a subdirectory of an emptyDir: the emptyDir itself is 0777, which
    # the agent refuses; the subdirectory is the agent's own.
    sock_dir = os.path.dirname(cfg.socket)
    mount_dir = os.path.dirname(sock_dir)
    assert sock_dir not in agent_mounts and mount_dir in agent_mounts
    vol = agent_mounts[mount_dir]["name"]
    assert "emptyDir" in volumes[vol]
    assert trainer_mounts[mount_dir]["name"] == vol
    assert trainer_mounts[mount_dir]["readOnly"] is True
    assert not agent_mounts[mount_dir].get("readOnly", False)
    # uids: the agent its own, the trainer another; the socket's group joins them.
    pod_sc = spec["securityContext"]
    assert agent["securityContext"]["runAsUser"] == AGENT_UID
    assert pod_sc["runAsUser"] != AGENT_UID
    assert socket_group == AGENT_UID and AGENT_UID in pod_sc["supplementalGroups"]
    # Checkpoints are read by the agent at the trainer's paths, read-only.
    shared = [p for p in trainer_mounts if p != mount_dir and p in agent_mounts]
    assert shared, "mount the checkpoint volume in the agent too"
    for p in shared:
        assert agent_mounts[p]["readOnly"] is True
        assert agent_mounts[p]["name"] == trainer_mounts[p]["name"]
    # Read-only root: the agent's writable places are volumes.
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert os.path.dirname(cfg.journal_path) in agent_mounts and "/tmp" in agent_mounts
    journal_volume = volumes[agent_mounts[os.path.dirname(cfg.journal_path)]["name"]]
    limit = parse_quantity(journal_volume["emptyDir"]["sizeLimit"])
    assert cfg.journal_max_bytes * (cfg.journal_backups + 1) < limit
    # The trainer starts once the agent is ready (started: its socket bound); liveness is
    # /-/healthy, which an agent that is merely behind its queue still passes.
    assert agent["startupProbe"]["httpGet"]["path"] == "/-/ready"
    assert agent["readinessProbe"]["httpGet"]["path"] == "/-/ready"
    assert agent["livenessProbe"]["httpGet"]["path"] == "/-/healthy"


_UNITS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "Ki": 1024, "Mi": 1024**2,
          "Gi": 1024**3}


def parse_quantity(q) -> float:
    """A Kubernetes quantity ("512Mi", "1", "50m") as a number (bytes or cores)."""
    q = str(q)
    if q.endswith("m") and q[:-1].isdigit():
        return int(q[:-1]) / 1000
    number, unit = re.fullmatch(r"([\d.]+)([A-Za-z]*)", q).groups()
    return float(number) * _UNITS[unit]

