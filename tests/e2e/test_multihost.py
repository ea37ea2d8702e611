"""End to end on separate hosts: two compute hosts (network, mount, UTS and pid namespaces) and a
storage host serving a directory over sshfs, a real network filesystem, mounted at one path on
both (tests/support/hosts.py; docs/multihost.md). Each host has its own agent, named by its
hostname; jobs are real torchruns across the hosts over their network (gloo, rendezvous on
host0's address), and nothing sets a CKPTWATCH_* variable: the shared storage is known from
the mount (fuse.sshfs), the node from the hostname, the job from torchrun's --rdzv-id.

Cost: ~95 s on the 2-CPU build machine at load 5-7 (the cluster starts in 0.4 s; three
torchrun jobs across the hosts -- the save patterns, a save as the job's last act,
transformers' Trainer -- and single processes per host); skipped with the reason where the
kernel refuses namespaces or FUSE or a tool is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

import hosts
from helpers import REPO_ROOT, wait_for

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

AGENT_ARGS = ("--collision.settle", "0.5", "--collision.job-settle", "3",
              "--collision.window", "5", "--verify.quiet", "0.5")
HOSTJOB = os.path.join(REPO_ROOT, "tests", "support", "hostjob.py")
# Job scope orders cross-host writes by the store's tickets: an overlap or a gap shorter than
# this may be called either way (design.md, "ordering tolerance").
TOLERANCE = 0.05


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


def test_a_save_right_before_the_job_exits_is_one_job_collision_on_every_host(
        cluster, agents):
    """The local_rank == 0 guard as the job's last act: each host's rank saves and its
    process exits at once (no barrier after it). The exchange through the store must still
    reach both agents: one collision, one id, both writers."""
    job = f"mh-exit-{uuid.uuid4().hex[:8]}"
    out = os.path.join(cluster.shared, job)
    log = os.path.join(cluster.root, f"{job}-truth")
    os.makedirs(log)
    hosts.finish(cluster.torchrun([HOSTJOB, "--out", out, "--truth", log, "--patterns",
                                   "local-rank0", "--exit-after-save"], job=job,
                                  agents=agents))
    path = os.path.join(out, "guard", "last.pt")
    saves = []
    for name in os.listdir(log):
        with open(os.path.join(log, name)) as f:
            saves += [json.loads(line) for line in f]
    allowed = truth_kind([(s["start"], s["end"]) for s in saves])
    seen = {}
    for agent in agents:
        wait_for(lambda: on_path(agent, job, "collision", path), timeout=60,
                 message=f"the collision on {agent.host.name}\n{agent.log[-3000:]}")
        agent.wait_judged()
        seen[agent.host.name] = on_path(agent, job, "collision", path)
    for name, found in seen.items():
        assert len(found) == 1, (name, found)
        assert found[0]["scope"] == "job" and found[0]["kind"] in allowed
        assert writers(found[0]) == {("host0", 0), ("host1", 1)}, (name, found[0]["writers"])
    assert len({f[0]["id"] for f in seen.values()}) == 1, seen


# ---- transformers' save_on_each_node on shared storage ---------------------------------------

@pytest.fixture(scope="module")
def hf_job(cluster, agents):
    """transformers' Trainer with save_on_each_node=True, one rank per host, its output on
    the shared storage: (job, out). It saves checkpoint-2, trains on, saves checkpoint-4
    and exits."""
    pytest.importorskip("transformers")
    job = f"mh-hf-{uuid.uuid4().hex[:8]}"
    out = os.path.join(cluster.shared, job)
    script = os.path.join(REPO_ROOT, "tests", "frameworks", "hf_trainer.py")
    hosts.finish(cluster.torchrun([script, "--out", out, "--save-on-each-node"], job=job,
                                  agents=agents))
    return job, out


# What both hosts' local rank 0 torch.save in each checkpoint (model.safetensors goes through
# safetensors, rng_state_<rank>.pth names its rank).
HF_FILES = ("optimizer.pt", "scheduler.pt", "training_args.bin")


def check_hf_checkpoint(agents, job: str, directory: str) -> None:
    # Each agent: every file's job collision, then one wait_judged (everything it received
    # before is judged: no second collision on any of the files is still to come).
    seen = {name: {} for name in HF_FILES}
    for agent in agents:
        for name in HF_FILES:
            path = os.path.join(directory, name)
            wait_for(lambda: [c for c in on_path(agent, job, "collision", path)
                              if c["scope"] == "job"], timeout=60,
                     message=f"the collision on {name} on {agent.host.name}\n"
                             f"{agent.log[-3000:]}")
        agent.wait_judged()
        for name in HF_FILES:
            found = on_path(agent, job, "collision", os.path.join(directory, name))
            assert len(found) == 1, (agent.host.name, name, found)
            assert writers(found[0]) == {("host0", 0), ("host1", 1)}, found[0]["writers"]
            assert all("transformers" in w["site"] for w in found[0]["writers"])
            seen[name][agent.host.name] = found[0]
    for name, by_host in seen.items():
        assert len({c["id"] for c in by_host.values()}) == 1, (name, by_host)
        assert len({c["kind"] for c in by_host.values()}) == 1, (name, by_host)


def test_transformers_save_on_each_node_is_a_job_collision_on_every_host(agents, hf_job):
    """save_on_each_node=True is meant for node-local disks: on shared storage each host's
    local rank 0 writes the same checkpoint files."""
    job, out = hf_job
    check_hf_checkpoint(agents, job, os.path.join(out, "checkpoint-2"))
    optimizer = os.path.join(out, "checkpoint-2", "optimizer.pt")
    guard = wait_for(lambda: [h for h in on_path(agents[1], job, "hazard", optimizer)
                              if h["hazard"] == "local_rank_guard"], timeout=30,
                     message="local_rank_guard on host1")
    assert guard[0]["shared"] == "mount:fuse.sshfs"


def test_transformers_last_checkpoint_before_exit_is_a_job_collision_on_every_host(
        agents, hf_job):
    """checkpoint-4 is saved just before the job exits: its exchange through the store must
    still reach both agents."""
    job, out = hf_job
    check_hf_checkpoint(agents, job, os.path.join(out, "checkpoint-4"))


# ---- what the watcher sees, what covers the rest ----------------------------------------------

WRITE_CHECKPOINT = r'''
import io, sys, torch
buf = io.BytesIO()
torch.save({"w": torch.arange(100_000)}, buf)
data = bytearray(buf.getvalue())
if sys.argv[2] == "corrupt":
    data[len(data) // 2] ^= 0xFF        # a flipped byte in the tensor data: the CRC disagrees
with open(sys.argv[1], "wb") as f:       # a plain write: no hook sees it
    f.write(bytes(data))
'''

LOAD_CHECKPOINT = r'''
import sys, torch
state = torch.load(sys.argv[1])
print(len(state["w"]))
'''


@pytest.fixture(scope="module")
def watching_agent(cluster):
    """An agent on host0 that also watches a directory of the shared storage (inotify)."""
    watched = os.path.join(cluster.shared, "watched")
    # Made through host0's mount: made on the server, it could stay out of sight of host0
    # for sshfs' directory cache (20 s), and the watch would wait for it to appear.
    cluster.hosts[0].run(["mkdir", watched])
    agent = cluster.hosts[0].start_agent(
        os.path.join(cluster.hosts[0].dir, "watching"), "--collision.settle", "0.5",
        "--verify.quiet", "0.5", "--watch.path", watched, "--watch.mode", "inotify")
    return agent, watched


def verdicts(agent, path: str) -> list[str]:
    return [r["result"] for r in agent.journal_records()
            if r.get("type") == "verification" and r["path"] == path]


def test_the_watcher_on_one_host_is_blind_to_another_hosts_writes(cluster, watching_agent):
    """inotify reports what this kernel does: host1's write through its own sshfs mount
    never reaches host0's watcher, though the file is there for host0 to read. (Job scope
    carries a remote rank's saves; test_local_rank0_guard_... shows it.)"""
    agent, watched = watching_agent
    host0, host1 = cluster.hosts
    here, there = os.path.join(watched, "from-host0.pt"), os.path.join(watched, "from-host1.pt")
    host1.python(WRITE_CHECKPOINT, there, "whole")
    host0.python(WRITE_CHECKPOINT, here, "whole")
    # host0's own write: seen, and verified whole (an "ok" is counted, not journaled).
    wait_for(lambda: agent.metric("ckptwatch_checkpoint_verifications_total", result="ok"),
             timeout=30, message=f"host0's own write verified\n{agent.log[-3000:]}")
    agent.wait_judged()
    # Said in full when it fails: once, at load 10, a second verification was counted (not
    # reproduced alone; the journal and log tell whose and what).
    assert agent.metric("ckptwatch_checkpoint_verifications_total") == 1, (
        [r for r in agent.journal_records() if r.get("type") == "verification"],
        agent.log[-3000:])
    assert not [r for r in agent.journal_records() if r.get("path") == there]
    assert host0.run(["ls", watched]).stdout.split() == ["from-host0.pt", "from-host1.pt"]


def test_a_corrupt_file_from_another_host_is_verified_when_this_host_reads_it(
        cluster, watching_agent):
    """host1 writes a checkpoint whose tensor data is damaged (torch.load does not check
    CRCs: it loads); host0's watcher never saw the write, but sees host0's process read it
    and verifies that version once."""
    agent, watched = watching_agent
    host0, host1 = cluster.hosts
    path = os.path.join(watched, "damaged.pt")
    host1.python(WRITE_CHECKPOINT, path, "corrupt")
    agent.wait_judged()
    assert verdicts(agent, path) == []              # nothing here wrote it
    assert host0.python(LOAD_CHECKPOINT, path).stdout.split() == ["100000"]
    wait_for(lambda: verdicts(agent, path), timeout=30,
             message=f"the verification of the file host0 read\n{agent.log[-3000:]}")
    # Read again (and read by the verifier itself): the same version is not verified again.
    host0.python(LOAD_CHECKPOINT, path)
    agent.wait_judged()
    assert verdicts(agent, path) == ["corrupt"]


# ---- the atomic policy on sshfs --------------------------------------------------------------

ATOMIC_SAVER = r'''
import json, os, socket, sys, time
import torch
from ckptwatch import atomic
path, writers, saves, truth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
me = socket.gethostname()
gen = torch.Generator().manual_seed(len(me))
state = {"writer": me, "w": torch.rand(1024, 1024, generator=gen)}
# Start together, however long each host took to get here (a loaded machine can take many
# seconds to import torch): each says it is ready, then waits until every writer is.
open(f"{truth}.ready.{me}", "w").close()
ready = os.path.dirname(truth) or "."
deadline = time.monotonic() + 120
while sum(n.startswith(os.path.basename(truth) + ".ready.") for n in os.listdir(ready)) < writers:
    if time.monotonic() > deadline:
        sys.exit("the other writers never became ready")
    time.sleep(0.005)
with open(truth, "a") as log:
    for i in range(saves):
        state["i"] = i
        start = time.time()
        torch.save(state, path)
        log.write(json.dumps({"node": me, "start": start, "end": time.time()}) + "\n")
print(json.dumps(atomic.stats()))
'''


def test_atomic_policy_leaves_one_whole_file_on_sshfs(cluster, agents):
    """CKPTWATCH_POLICY=atomic on both hosts, the same path saved 4 times by each at the same
    moments: sshfs renames through OpenSSH's posix-rename (rename(2) on the server), so the
    last rename wins whole; no temporary file is left behind."""
    name = f"atomic-{uuid.uuid4().hex[:8]}"
    path = os.path.join(cluster.shared, name, "last.pt")
    os.makedirs(os.path.join(cluster.export, name))
    truth = os.path.join(cluster.root, f"{name}.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update({"CKPTWATCH_POLICY": "atomic", "OMP_NUM_THREADS": "1"})
    procs = [host.popen([sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket,
                         "--", sys.executable, "-c", ATOMIC_SAVER, path, str(len(cluster.hosts)), "4",
                         truth], env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for host, agent in zip(cluster.hosts, agents)]
    outputs = hosts.finish(procs, timeout=120)
    for out in outputs:
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["atomic"] == 4 and not any(v for k, v in stats.items()
                                                if k.startswith("fallback")), stats
    with open(truth) as f:
        saves = [json.loads(line) for line in f]
    spans = {n: [(s["start"], s["end"]) for s in saves if s["node"] == n]
             for n in ("host0", "host1")}
    # The schedule did collide: some save of host0 overlapped some save of host1.
    assert any(min(a[1], b[1]) > max(a[0], b[0])
               for a in spans["host0"] for b in spans["host1"]), spans
    state = torch.load(os.path.join(cluster.export, name, "last.pt"))
    gen = torch.Generator().manual_seed(len(state["writer"]))
    assert state["i"] == 3 and torch.equal(state["w"], torch.rand(1024, 1024, generator=gen))
    assert os.listdir(os.path.join(cluster.export, name)) == ["last.pt"]
