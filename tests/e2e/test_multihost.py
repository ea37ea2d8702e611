"""End to end on separate hosts: two compute hosts (network, mount, UTS and pid namespaces) and a
storage host serving a directory over sshfs, a real network filesystem, mounted at one path on
both (tests/support/hosts.py; docs/multihost.md). Each host has its own agent, named by its
hostname; jobs are real torchruns across the hosts over their network (gloo, rendezvous on
host0's address), and nothing sets a CKPTWATCH_* variable: the shared storage is known from
the mount (fuse.sshfs), the node from the hostname, the job from torchrun's --rdzv-id.

Cost: ~1.5 minutes on the 2-CPU build machine (set-up 0.4 s; three torchrun jobs and a few
single processes); skipped with the reason where the kernel refuses namespaces or FUSE.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from helpers import REPO_ROOT, wait_for

torch = pytest.importorskip("torch")
hosts = pytest.importorskip("hosts")

pytestmark = pytest.mark.torch

AGENT_ARGS = ("--collision.settle", "0.5", "--collision.job-settle", "3",
              "--collision.window", "5", "--verify.quiet", "0.5")
HOSTJOB = os.path.join(REPO_ROOT, "tests", "support", "hostjob.py")
# Job scope orders cross-host writes by the store's tickets: an overlap or a gap shorter than
# this may be called either way (design.md, "ordering tolerance").
TOLERANCE = 0.05
CONSISTENCY_BUG = ("job scope's cross-node story is not yet the same on every agent "
                   "(issue 16 item 3, branch groundtruth)")


@pytest.fixture(scope="module")
def cluster():
    try:
        with hosts.Cluster(hosts=2) as made:
            yield made
    except hosts.HostsUnavailable as exc:
        pytest.skip(f"no test hosts here: {exc}")


@pytest.fixture(scope="module")
def agents(cluster):
    """One agent per compute host, as a DaemonSet would run it: no --node.name, no settings
    about shared storage."""
    return [host.start_agent(None, *AGENT_ARGS) for host in cluster.hosts]


def records(agent, job: str, kind: str) -> list[dict]:
    return [r for r in agent.journal_records() if r.get("type") == kind and r.get("job") == job]


def on_path(agent, job: str, kind: str, path: str) -> list[dict]:
    return [r for r in records(agent, job, kind) if r["path"] == path]


def writers(record: dict) -> set:
    return {(w["node"], w["rank"]) for w in record["writers"]}


def truth_kind(intervals: list[tuple[float, float]]) -> set:
    """What the writers' true intervals allow: {"concurrent"} when they form one group
    overlapping by more than TOLERANCE, {"redundant"} when every gap exceeds it, else both."""
    ordered = sorted(intervals)
    overlaps = [min(a[1], b[1]) - b[0] for a, b in zip(ordered, ordered[1:])]
    if all(o > TOLERANCE for o in overlaps):
        return {"concurrent"}
    if all(o < -TOLERANCE for o in overlaps):
        return {"redundant"}
    return {"concurrent", "redundant"}


# ---- the mount is the evidence -------------------------------------------------------------

def test_each_host_sees_the_network_filesystem_as_shared_from_the_mount(cluster):
    probe = ("import sys; from ckptwatch.sharedfs import SharedPaths; s = SharedPaths(); "
             "print(s.shared(sys.argv[1]), s.shared(sys.argv[2]))")
    for host in cluster.hosts:
        out = host.python(probe, os.path.join(cluster.shared, "a", "last.pt"),
                          os.path.join(host.dir, "last.pt")).stdout.split()
        assert out == ["mount:fuse.sshfs", "None"], (host.name, out)
    # Outside the hosts the mount point is a plain local directory.
    from ckptwatch.sharedfs import SharedPaths
    assert SharedPaths(environ={}).shared(os.path.join(cluster.shared, "last.pt")) is None


# ---- one torchrun across both hosts: the bugs and the correct patterns ----------------------

@pytest.fixture(scope="module")
def patterns_job(cluster, agents):
    """hostjob.py's four patterns in one job, 2 hosts x 2 ranks: (job, out, truth by path)."""
    job = f"mh-{uuid.uuid4().hex[:8]}"
    out = os.path.join(cluster.shared, job)
    log = os.path.join(cluster.root, f"{job}-truth")
    os.makedirs(log)
    hosts.finish(cluster.torchrun([HOSTJOB, "--out", out, "--truth", log], job=job, nproc=2,
                                  agents=agents))
    truth: dict = {}
    for name in os.listdir(log):
        with open(os.path.join(log, name)) as f:
            for line in f:
                save = json.loads(line)
                truth.setdefault(save["path"], []).append(save)
    return job, out, truth


def test_local_rank0_guard_is_one_job_collision_on_every_host(agents, patterns_job):
    job, out, truth = patterns_job
    path = os.path.join(out, "guard", "last.pt")
    assert {(s["node"], s["rank"]) for s in truth[path]} == {("host0", 0), ("host1", 2)}
    allowed = truth_kind([(s["start"], s["end"]) for s in truth[path]])
    seen = {}
    for agent in agents:
        found = wait_for(lambda: on_path(agent, job, "collision", path), timeout=60,
                         message=f"the collision on {agent.host.name}\n{agent.log[-3000:]}")
        seen[agent.host.name] = found
    for name, found in seen.items():
        assert len(found) == 1, (name, found)
        c = found[0]
        assert c["scope"] == "job" and c["kind"] in allowed, (name, c["kind"], allowed)
        assert writers(c) == {("host0", 0), ("host1", 2)}, (name, c["writers"])
        assert all("hostjob.py:" in w["site"] for w in c["writers"])
    assert len({f[0]["id"] for f in seen.values()}) == 1, seen
    assert len({f[0]["kind"] for f in seen.values()}) == 1, seen
    # The hazard names the filesystem it learnt from the mount.
    guard = wait_for(lambda: [h for h in on_path(agents[1], job, "hazard", path)
                              if h["hazard"] == "local_rank_guard"], timeout=30,
                     message="local_rank_guard on host1")
    assert guard[0]["shared"] == "mount:fuse.sshfs"
    for agent in agents:
        multi = wait_for(lambda: [h for h in on_path(agent, job, "hazard", path)
                                  if h["hazard"] == "shared_storage_multi_writer"], timeout=30,
                         message=f"shared_storage_multi_writer on {agent.host.name}")
        assert multi[0]["shared"] == "mount:fuse.sshfs" and multi[0]["ranks"] == [0, 2]


def test_every_rank_saving_is_one_job_collision_naming_all_four_writers_on_every_host(
        agents, patterns_job):
    job, out, truth = patterns_job
    path = os.path.join(out, "every", "last.pt")
    everyone = {("host0", 0), ("host0", 1), ("host1", 2), ("host1", 3)}
    assert {(s["node"], s["rank"]) for s in truth[path]} == everyone
    allowed = truth_kind([(s["start"], s["end"]) for s in truth[path]])
    seen = {}
    for agent in agents:
        wait_for(lambda: [c for c in on_path(agent, job, "collision", path)
                          if c["scope"] == "job"], timeout=60,
                 message=f"the job-scope collision on {agent.host.name}\n{agent.log[-3000:]}")
        agent.wait_judged()
        seen[agent.host.name] = on_path(agent, job, "collision", path)
    for name, found in seen.items():
        # Seen on the host and in the job: one collision, the job's, with all four writers.
        assert len(found) == 1, (name, [(c["scope"], writers(c)) for c in found])
        assert found[0]["scope"] == "job" and found[0]["kind"] in allowed
        assert writers(found[0]) == everyone, (name, found[0]["writers"])
    assert len({f[0]["id"] for f in seen.values()}) == 1


def test_a_correct_job_reports_nothing(agents, patterns_job):
    """Global rank 0 saving, and each rank saving its own file: the same job, the same
    hosts, nothing to report (no collision, no hazard) on either agent."""
    job, out, truth = patterns_job
    correct = {os.path.join(out, "rank0", "last.pt")} | {
        os.path.join(out, "per-rank", f"rank{r}.pt") for r in range(4)}
    assert correct <= set(truth)
    for agent in agents:
        wait_for(lambda: len([w for w in records(agent, job, "write")
                              if w["path"] in correct]) == (3 if agent is agents[0] else 2),
                 timeout=60, message=f"the correct saves' writes on {agent.host.name}")
        agent.wait_judged()
        for kind in ("collision", "hazard"):
            assert not [r for r in records(agent, job, kind) if r["path"] in correct], kind
