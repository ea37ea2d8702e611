"""End to end, job scope: two simulated nodes on one host, one agent per node.

Each "node" is a `torchrun --nnodes 2 --node-rank N --nproc-per-node 2` (loopback master, one
rendezvous) under `ckptwatch run --socket <its agent>` with its own CKPTWATCH_NODE; all four
ranks save into one directory marked shared through CKPTWATCH_SHARED_PATHS. Neither agent
hears the other node's hooks: whatever it says about the other node came through the job's
store (ckptwatch/jobscope.py). One job serves the four saving-mode tests, each mode on its own
paths (the shared_job fixture); the scenarios that need a job configuration of their own have
their own job. Last, the store itself under 10,000 saves of JobScopes in this
process.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, free_port, wait_for
from jobstore import Rank
from twonodes import run_two_nodes as run_program_on_two_nodes
from twonodes import two_agents
from modesjob import mode_dir, program, under

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch



@pytest.fixture(scope="module")
def agents():
    # One agent per simulated node, named as that node's hooks name it.
    with two_agents() as started:
        yield started


def run_two_nodes(agents, mode: str, *, extra_env=None, extra_args=(), nproc: int = 2,
                  program=None, set_job: bool = True) -> tuple[str, str]:
    """Both nodes' torchruns at once; (job id, checkpoint directory) once both exit 0.
    program: the training program's arguments (default monitor.cli.demo_job --save mode)."""
    return run_program_on_two_nodes(
        agents, f"js-{mode}", program or ["-m", "monitor.cli.demo_job", "--save", mode],
        nproc=nproc, extra_env=extra_env, extra_args=extra_args, set_job=set_job)


def records(agent, job: str, kind: str) -> list[dict]:
    return [r for r in agent.journal_records() if r.get("type") == kind and r.get("job") == job]


def job_collisions(agent, job: str) -> list[dict]:
    return [c for c in records(agent, job, "collision") if c["scope"] == "job"]


def ranks_of(collision: dict) -> list:
    return sorted(w["rank"] for w in collision["writers"])


# One job for the four saving modes whose scenarios need not be alone in a job (issue 22: a
# two-node job costs ~20-25 s CPU, most of it fixed). Each rank saves once per mode, each mode
# into its own subdirectory (tests/support/modesjob.py), the local-rank0 guard first (its
# hazard is named from the job's first save, as before); each test asserts on its own path
# what it asserted on its own job, and test_one_job_many_paths_no_cross_talk that the paths
# of one job do not leak into each other.
MODES = ("local-rank0", "every-rank", "rank0", "per-rank")


@pytest.fixture(scope="module")
def shared_job(agents):
    """(job id, {mode: that mode's checkpoint directory}) once both agents journaled every
    write of the job: node-a 1 + 2 + 1 + 2, node-b 1 + 2 + 0 + 2 (global rank 0 is node-a's)."""
    job, out = run_two_nodes(agents, "shared", program=program(MODES),
                             extra_args=("--width", "2048"))
    dirs = {mode: mode_dir(out, mode) for mode in MODES}
    for node, agent in agents.items():
        expected = 6 if node == "node-a" else 5
        wait_for(lambda: len(records(agent, job, "write")) == expected, timeout=60,
                 message=f"{expected} writes on {node}\n{agent.log}")
    return job, dirs



def test_local_rank0_guard_is_a_job_collision_on_both_agents_and_a_hazard(agents, shared_job):
    job, dirs = shared_job
    path = os.path.join(dirs["local-rank0"], "last.pt")
    found = {}
    for node, agent in agents.items():
        found[node] = wait_for(lambda: [c for c in job_collisions(agent, job)
                                        if c["path"] == path], timeout=60,
                               message=f"a job-scope collision on {node}'s agent\n{agent.log}")
        agent.wait_judged()
        # Exactly one collision on the path: not one per node's view of it.
        assert len([c for c in records(agent, job, "collision") if c["path"] == path]) == 1
        c = found[node][0]
        assert ranks_of(c) == [0, 2]
        assert {(w["node"], w["rank"], w["local_rank"]) for w in c["writers"]} == {
            ("node-a", 0, 0), ("node-b", 2, 0)}
        assert all(w["site"] and "demo_job.py:" in w["site"] for w in c["writers"])
        # The other node's write is labelled as learnt through the store, and by whom.
        remote = [w for w in c["writers"] if w["node"] != node]
        assert [w["source"] for w in remote] == ["job"] and remote[0]["reported_by"] > 0
        # Per job, the metric counts what is journaled (the shared job's other job-scope
        # collision is every-rank's: test_one_job_many_paths_no_cross_talk checks which
        # paths they are on; this test does not depend on how that race fell).
        wait_for(lambda: agent.metric("ckptwatch_collisions_total", training_job=job,
                                      scope="job") == len(job_collisions(agent, job)),
                 timeout=30, message="the metric counting the journal's job collisions")
        assert agent.metric("ckptwatch_job_scope_reports_total", training_job=job,
                            state="active") == 2
    # The same collision, the same id on both agents (so a merged report counts it once).
    assert found["node-a"][0]["id"] == found["node-b"][0]["id"]
    assert found["node-a"][0]["kind"] == found["node-b"][0]["kind"]
    # The local_rank == 0 bug is named from the first save of the job, by node-b's rank 2.
    guard = wait_for(lambda: [h for h in records(agents["node-b"], job, "hazard")
                              if h["hazard"] == "local_rank_guard"], timeout=30,
                     message="local_rank_guard hazard")
    assert [(h["path"], h["writers"][0]["rank"]) for h in guard] == [(path, 2)]
    assert agents["node-b"].metric("ckptwatch_hazards_total", training_job=job,
                                   kind="local_rank_guard") == 1
    assert not agents["node-a"].metric("ckptwatch_hazards_total", training_job=job,
                                       kind="local_rank_guard")
    for agent in agents.values():
        multi = wait_for(lambda: [h for h in records(agent, job, "hazard")
                                  if h["hazard"] == "shared_storage_multi_writer"
                                  and h["path"] == path],
                         timeout=30, message="shared_storage_multi_writer hazard")
        assert multi[0]["ranks"] == [0, 2]

    # One picture of the job: both journals merged, the collision counted once.
    report = subprocess.run([sys.executable, "-m", "monitor.cli", "report", "--format", "json",
                             "--journal", agents["node-a"].journal,
                             "--journal", agents["node-b"].journal],
                            capture_output=True, text=True, cwd=REPO_ROOT)
    assert report.returncode == 1, report.stderr      # collisions and hazards shown
    import json
    merged = json.loads(report.stdout)
    mine = [c for c in merged["collisions"] if c["job"] == job and c["path"] == path]
    assert len(mine) == 1 and ranks_of(mine[0]) == [0, 2]
    assert {h["hazard"] for h in merged["hazards"] if h["job"] == job and h["path"] == path} == {
        "local_rank_guard", "shared_storage_multi_writer"}


def test_every_rank_saving_is_a_job_collision_naming_all_four_ranks_on_both_agents(agents,
                                                                                  shared_job):
    job, dirs = shared_job
    path = os.path.join(dirs["every-rank"], "last.pt")
    ids = set()
    for node, agent in agents.items():
        found = wait_for(lambda: [c for c in job_collisions(agent, job) if c["path"] == path],
                         timeout=60,
                         message=f"a job-scope collision on {node}'s agent\n{agent.log}")
        agent.wait_judged()
        everything = [c for c in records(agent, job, "collision") if c["path"] == path]
        # Seen on the node and in the job: reported once, as the job-scope collision.
        assert len(everything) == 1, everything
        assert ranks_of(found[0]) == [0, 1, 2, 3]
        assert len({(w["node"], w["pid"]) for w in found[0]["writers"]}) == 4
        ids.add(found[0]["id"])
    assert len(ids) == 1


def test_global_rank0_guard_is_nothing_with_job_scope_active(agents, shared_job):
    job, dirs = shared_job
    for agent in agents.values():
        wait_for(lambda: agent.metric("ckptwatch_job_scope_reports_total", training_job=job,
                                      state="active") == 2, timeout=30,
                 message="job scope active in both ranks")
    written = wait_for(lambda: under(records(agents["node-a"], job, "write"),
                                     dirs["rank0"]), timeout=30, message="the write")
    assert [(w["path"], w["rank"]) for w in written] == [
        (os.path.join(dirs["rank0"], "last.pt"), 0)]
    for agent in agents.values():
        agent.wait_judged()
        assert under(records(agent, job, "collision"), dirs["rank0"]) == []
        assert under(records(agent, job, "hazard"), dirs["rank0"]) == []


def test_per_rank_file_names_are_nothing(agents, shared_job):
    job, dirs = shared_job
    for agent in agents.values():
        wait_for(lambda: len(under(records(agent, job, "write"), dirs["per-rank"])) == 2,
                 timeout=30, message="two writes per node")
        agent.wait_judged()
        assert under(records(agent, job, "collision"), dirs["per-rank"]) == []
        assert under(records(agent, job, "hazard"), dirs["per-rank"]) == []
        assert agent.metric("ckptwatch_job_scope_reports_total", training_job=job,
                            state="active") == 2
    assert {w["path"] for a in agents.values()
            for w in under(records(a, job, "write"), dirs["per-rank"])} == {
        os.path.join(dirs["per-rank"], f"last-rank{r}.pt") for r in range(4)}


def test_one_job_many_paths_no_cross_talk(agents, shared_job):
    """What the shared job adds: one job's paths do not leak into each other. Each agent has
    exactly the two job-scope collisions (local-rank0's and every-rank's paths) and the hazards
    of those paths only: local_rank_guard on the local-rank0 path (node-b's agent only),
    shared_storage_multi_writer on both colliding paths with their own ranks."""
    job, dirs = shared_job
    guarded = os.path.join(dirs["local-rank0"], "last.pt")
    every = os.path.join(dirs["every-rank"], "last.pt")
    for node, agent in agents.items():
        wait_for(lambda: len(job_collisions(agent, job)) == 2, timeout=60,
                 message=f"two job-scope collisions on {node}\n{agent.log}")
        agent.wait_judged()
        assert {(c["path"], c["scope"], tuple(ranks_of(c)))
                for c in records(agent, job, "collision")} == {
            (guarded, "job", (0, 2)), (every, "job", (0, 1, 2, 3))}
        assert len(records(agent, job, "collision")) == 2
        hazards = wait_for(lambda: [h for h in records(agent, job, "hazard")
                                    if h["hazard"] == "shared_storage_multi_writer"
                                    and h["path"] == every], timeout=30,
                           message=f"every-rank's shared_storage_multi_writer on {node}")
        assert hazards[0]["ranks"] == [0, 1, 2, 3]
        expected = {(guarded, "shared_storage_multi_writer"),
                    (every, "shared_storage_multi_writer")}
        if node == "node-b":
            expected.add((guarded, "local_rank_guard"))
        assert {(h["path"], h["hazard"]) for h in records(agent, job, "hazard")} == expected
        assert agent.metric("ckptwatch_collisions_total", training_job=job) == 2


def test_store_unreachable_training_runs_node_scope_works_job_scope_disabled(agents):
    """Our client's port points nowhere: the job trains and exits 0, each node still sees its
    own two ranks collide, and each agent shows job scope disabled for both ranks."""
    nowhere = free_port()
    job, out = run_two_nodes(agents, "every-rank", extra_args=("--width", "2048"),
                             extra_env={"CKPTWATCH_STORE_PORT": str(nowhere),
                                        "CKPTWATCH_JOBSCOPE_CONNECT_TIMEOUT": "1"})
    for node, agent in agents.items():
        found = wait_for(lambda: records(agent, job, "collision"), timeout=30,
                         message=f"node-scope collision on {node}")
        assert [c["scope"] for c in found] == ["node"]
        assert {w["node"] for w in found[0]["writers"]} == {node}
        wait_for(lambda: agent.metric("ckptwatch_job_scope_reports_total", training_job=job,
                                      state="disabled") == 2, timeout=30,
                 message=f"job scope disabled on {node}")
        assert not agent.metric("ckptwatch_job_scope_reports_total", training_job=job,
                                state="active")
    # Every rank writes (no guard at all): node-b's local rank 0 must not be told about a
    # LOCAL_RANK == 0 guard, store or no store (issue 16). Its hook judged on its own write;
    # the agent saw local rank 1 write the path too.
    for agent in agents.values():
        agent.wait_judged()
        assert not agent.metric("ckptwatch_hazards_total", training_job=job,
                                kind="local_rank_guard")
        assert records(agent, job, "hazard") == []


def test_transformers_save_on_each_node_on_shared_storage_is_caught(agents):
    """transformers' TrainingArguments(save_on_each_node=True) on two nodes (one rank each)
    whose output directory is shared: each node's local rank 0 writes the same checkpoint
    files (optimizer.pt, scheduler.pt, training_args.bin)."""
    pytest.importorskip("transformers")
    script = os.path.join(REPO_ROOT, "tests", "frameworks", "hf_trainer.py")
    job, out = run_two_nodes(agents, "hf", nproc=1, program=[script],
                             extra_args=("--save-on-each-node",))
    optimizer = os.path.join(out, "checkpoint-2", "optimizer.pt")
    for node, agent in agents.items():
        found = wait_for(lambda: [c for c in job_collisions(agent, job)
                                  if c["path"] == optimizer], timeout=60,
                         message=f"a job-scope collision on optimizer.pt on {node}\n{agent.log}")
        assert ranks_of(found[0]) == [0, 1]
        assert all("transformers" in w["site"] for w in found[0]["writers"])
    guards = wait_for(lambda: {h["path"] for h in records(agents["node-b"], job, "hazard")
                               if h["hazard"] == "local_rank_guard"}, timeout=30,
                      message="local_rank_guard hazards on node-b")
    assert optimizer in guards
    # rng_state_1.pth names its rank: not a hazard, and each rank writes its own.
    assert not [p for p in guards if os.path.basename(p).startswith("rng_state")]


def test_static_rendezvous_run_id_none_is_told_apart_by_the_master_address(agents):
    """Without CKPTWATCH_JOB, torchrun's static rendezvous gives every job
    TORCHELASTIC_RUN_ID=none: job scope keys the run by MASTER_ADDR:MASTER_PORT too."""
    _, out = run_two_nodes(agents, "local-rank0", set_job=False,
                           extra_args=("--width", "2048"))
    path = os.path.join(out, "last.pt")
    for node, agent in agents.items():
        found = wait_for(lambda: [c for c in agent.journal_records()
                                  if c.get("type") == "collision" and c["path"] == path],
                         timeout=60, message=f"the collision on {node}\n{agent.log}")
        assert found[0]["scope"] == "job" and ranks_of(found[0]) == [0, 2]
        assert {w["job"] for w in found[0]["writers"]} == {"none"}
        assert len({w["master"] for w in found[0]["writers"]}) == 1


# ---- the store itself, under many saves (JobScopes in this process, no agent) ----------

def test_store_keys_do_not_grow_with_the_number_of_saves(job_store):
    """10,000 saves by two ranks of two nodes (5,000 each, on 8 paths), a 0.25 s window (the
    run lasts many windows): logs are deleted while it runs, and once the last windows have
    passed the store holds what it held before (one key per path written within the last
    windows at most, no counter of ours)."""
    window = 0.25
    a = Rank(job_store.port, "node-a", 0, 0, window=window)
    b = Rank(job_store.port, "node-b", 2, 0, window=window)
    wait_for(lambda: a.active() and b.active(), message="connected")
    before = job_store.num_keys()
    paths = [os.path.join("/tmp/private", f"p{i}.pt") for i in range(8)]
    peak = 0
    for i in range(5000):
        for rank in (a, b):
            rank.save(paths[i % len(paths)])
        if i % 500 == 0:
            wait_for(lambda: a.idle() and b.idle(), timeout=60)
            peak = max(peak, job_store.num_keys())
    wait_for(lambda: a.scope.counters["announced"] + a.scope.counters["dropped"] >= 10000
             and b.scope.counters["announced"] + b.scope.counters["dropped"] >= 10000,
             timeout=120, message="every start and end announced or dropped")
    wait_for(lambda: job_store.num_keys() <= before, timeout=60,
             message=f"keys back to {before} (now {job_store.num_keys()})")
    assert peak <= before + len(paths), peak     # one log per path, whatever the saves
    assert a.scope.state == "active" and b.scope.state == "active"
    assert a.scope.counters["errors"] == 0 and a.scope.counters["deleted"] > 0
