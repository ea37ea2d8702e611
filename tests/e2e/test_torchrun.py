"""End to end: a real agent process and real torchrun jobs (gloo, CPU) under `ckptwatch run`.

One agent serves every job of this module; each job gets its own CKPTWATCH_JOB so the metric
and journal assertions of one job are not disturbed by another. One job serves the three
single-node saving-mode tests, each mode on its own paths (the shared_job fixture).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from agentproc import start_agent
from helpers import REPO_ROOT, overlapping, remove_tree, short_tmpdir, wait_for
from modesjob import mode_dir, program, under

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

NPROC = 4
SETTLE = 0.5


@pytest.fixture(scope="module")
def agent():
    workdir = short_tmpdir("cwe")
    with start_agent(workdir, "--collision.settle", str(SETTLE), "--verify.quiet", "0.5") as proc:
        yield proc
    remove_tree(workdir)


def run_job(agent, mode: str, *, nproc: int = NPROC, extra_env=None, extra_args=(),
            overlap: bool = False, program=None) -> tuple[str, str]:
    """Run monitor.cli.demo_job under `ckptwatch run` (the real CLI); return (job id, out dir).
    overlap: every writer's save overlaps every other's (each rank writes: nproc writers).
    program: another training program taking demo_job's arguments but --save (`mode` then
    only names the job)."""
    job = f"e2e-{mode}-{uuid.uuid4().hex[:8]}"
    out = os.path.join(short_tmpdir("cwo"), "ckpt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update({"CKPTWATCH_JOB": job, "OMP_NUM_THREADS": "1"}, **(extra_env or {}))
    save = ["--save", mode] if program is None else []
    program = program or ["-m", "monitor.cli.demo_job"]
    if overlap:
        program, overlap_env = overlapping(nproc)
        env.update(overlap_env)
    cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *program, "--out", out, *save, *extra_args]
    result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return job, out


def writes_of(agent, job: str) -> list[dict]:
    return [r for r in agent.journal_records() if r.get("type") == "write" and r.get("job") == job]


def collisions_of(agent, job: str) -> list[dict]:
    return [r for r in agent.journal_records()
            if r.get("type") == "collision" and r.get("job") == job]


# One job for the three single-node saving modes (issue 22: a 4-rank job costs ~17-20 s CPU,
# most of it fixed): each rank saves once per mode, each mode into its own subdirectory
# (tests/support/modesjob.py), every-rank first (its collision comes from the job's first
# save, as before). Each test asserts on its own paths what it asserted on its own job;
# test_one_job_many_paths_no_cross_talk that the paths of one job do not leak into each other.
MODES = ("every-rank", "rank0", "per-rank")


@pytest.fixture(scope="module")
def shared_job(agent):
    """(job id, {mode: that mode's checkpoint directory}) once every write of the job is
    journaled: 4 (every-rank) + 1 (rank0) + 4 (per-rank)."""
    job, out = run_job(agent, "shared", program=program(MODES),
                       extra_args=("--width", "2048"))
    wait_for(lambda: len(writes_of(agent, job)) == 2 * NPROC + 1, timeout=30,
             message=f"{2 * NPROC + 1} write records")
    return job, {mode: mode_dir(out, mode) for mode in MODES}



def test_every_rank_saving_one_path_is_one_concurrent_collision_naming_all_ranks(agent,
                                                                                shared_job):
    # 32 MiB per save (width 2048): with 4 ranks on 2 CPUs, an 8 MiB save was once over
    # before the last rank's began (CI), and that rank was rightly not part of the overlap.
    job, dirs = shared_job
    path = os.path.join(dirs["every-rank"], "last.pt")
    wait_for(lambda: len(under(writes_of(agent, job), dirs["every-rank"])) == NPROC,
             timeout=30, message="4 write records")
    found = wait_for(lambda: collisions_of(agent, job), timeout=30, message="collision record")
    agent.wait_judged()
    # The job's only collision: on this path (the job's other paths are the correct modes).
    found = collisions_of(agent, job)
    assert len(found) == 1, found
    c = found[0]
    assert c["path"] == path and c["kind"] == "concurrent" and c["scope"] == "node"
    assert sorted(w["rank"] for w in c["writers"]) == [0, 1, 2, 3]
    assert len({w["pid"] for w in c["writers"]}) == NPROC
    # The call site is the user's line in demo_job.py, not torch's or ours.
    assert all(w["site"].startswith(os.path.join(REPO_ROOT, "monitor", "cli", "demo_job.py") + ":")
               for w in c["writers"]), [w["site"] for w in c["writers"]]
    assert all(w["func"] == "save_checkpoint" for w in c["writers"])
    assert c["first"]["rank"] in (0, 1, 2, 3) and c["last"]["rank"] in (0, 1, 2, 3)

    # The agent verifies the file once the writers are done, and links the verdict to the
    # collision. Whether this particular race tore the file is up to the scheduler, so the
    # test's own deep check decides which outcome to expect.
    from monitor.verify.integrity import verify
    truth = verify(path, deep=True)
    if truth.status == "corrupt":
        record = wait_for(lambda: [r for r in agent.journal_records()
                                   if r.get("type") == "verification" and r["path"] == path],
                          timeout=30, message="verification record")[0]
        assert record["result"] == "corrupt" and record["collision_id"] == c["id"]
    else:
        # Whole: the verdict on a collision's file is journaled too (a restarted agent
        # restores it for the alert's text: monitor/agent/resume.py).
        record = wait_for(lambda: [r for r in agent.journal_records()
                                   if r.get("type") == "verification" and r["path"] == path],
                          timeout=30, message="verification record")[0]
        assert record["result"] == "ok" and record["collision_id"] == c["id"]

    # Prometheus: one concurrent collision for this job; per rank, one finished write on this
    # path (the counter is per job: rank 0 also wrote the rank0 and per-rank paths, the
    # others the per-rank path).
    assert agent.metric("ckptwatch_collisions_total", training_job=job, kind="concurrent",
                        scope="node") == 1
    assert agent.metric("ckptwatch_collisions_total", training_job=job) == 1
    for rank in range(NPROC):
        assert agent.metric("ckptwatch_writes_total", training_job=job,
                            rank=str(rank)) == (3 if rank == 0 else 2)
    assert sorted(w["rank"] for w in under(writes_of(agent, job), dirs["every-rank"])) == [
        0, 1, 2, 3]
    assert agent.metric("ckptwatch_last_collision_timestamp_seconds", training_job=job) > 0

    # The human report names every rank, the call site and the fix.
    report = subprocess.run([sys.executable, "-m", "monitor.cli", "report", "--journal",
                             agent.journal], capture_output=True, text=True, cwd=REPO_ROOT)
    assert report.returncode == 1, report.stderr          # it shows a collision
    for rank in range(NPROC):
        assert f"rank{rank}@" in report.stdout
    assert "demo_job.py:" in report.stdout
    assert "rank" in report.stdout.lower() and "0" in report.stdout
    assert all(len(line) <= 80 for line in report.stdout.splitlines()), report.stdout
    as_json = subprocess.run([sys.executable, "-m", "monitor.cli", "report", "--journal",
                              agent.journal, "--format", "json"], capture_output=True,
                             text=True, cwd=REPO_ROOT)
    assert as_json.returncode == 1
    assert path in as_json.stdout and json.loads(as_json.stdout)


def test_global_rank0_guard_is_not_a_collision(agent, shared_job):
    job, dirs = shared_job
    wait_for(lambda: len(under(writes_of(agent, job), dirs["rank0"])) == 1, timeout=30,
             message="1 write record")
    w = under(writes_of(agent, job), dirs["rank0"])[0]
    assert w["rank"] == 0 and w["path"] == os.path.join(dirs["rank0"], "last.pt")
    assert w["outcome"] == "ok" and w["bytes"] == os.path.getsize(w["path"])
    # Wait until the agent has judged the job: it would have (wrongly) reported by now.
    agent.wait_judged()
    assert under(collisions_of(agent, job), dirs["rank0"]) == []
    # Per job: the job's collisions are every-rank's only (not this path's; how many the
    # every-rank race makes is its own test's to say), and the metric counts what is journaled.
    assert {c["path"] for c in collisions_of(agent, job)} <= {
        os.path.join(dirs["every-rank"], "last.pt")}
    wait_for(lambda: agent.metric("ckptwatch_collisions_total", training_job=job,
                                  kind="concurrent", scope="node") == len(
        [c for c in collisions_of(agent, job) if (c["kind"], c["scope"]) ==
         ("concurrent", "node")]), timeout=30, message="the metric counting the journal's")
    torch.load(w["path"], weights_only=False)  # and the file is sound


def test_each_rank_its_own_path_is_not_a_collision(agent, shared_job):
    job, dirs = shared_job
    wait_for(lambda: len(under(writes_of(agent, job), dirs["per-rank"])) == NPROC, timeout=30,
             message="4 write records")
    paths = {w["path"] for w in under(writes_of(agent, job), dirs["per-rank"])}
    assert paths == {os.path.join(dirs["per-rank"], f"last-rank{r}.pt") for r in range(NPROC)}
    agent.wait_judged()
    assert under(collisions_of(agent, job), dirs["per-rank"]) == []


def test_one_job_many_paths_no_cross_talk(agent, shared_job):
    """What the shared job adds: one job's paths do not leak into each other. Each path's
    write records name exactly its own writers (every-rank: ranks 0-3; rank0: rank 0; per-rank:
    rank r on last-rank{r}.pt), and the job's only collision is every-rank's."""
    job, dirs = shared_job
    agent.wait_judged()
    by_dir = {mode: sorted((os.path.basename(w["path"]), w["rank"])
                           for w in under(writes_of(agent, job), d))
              for mode, d in dirs.items()}
    assert by_dir == {"every-rank": [("last.pt", r) for r in range(NPROC)],
                      "rank0": [("last.pt", 0)],
                      "per-rank": [(f"last-rank{r}.pt", r) for r in range(NPROC)]}
    assert len(writes_of(agent, job)) == 2 * NPROC + 1
    assert [(c["path"], sorted(w["rank"] for w in c["writers"]))
            for c in collisions_of(agent, job)] == [
        (os.path.join(dirs["every-rank"], "last.pt"), [0, 1, 2, 3])]


def test_two_nodes_with_local_rank0_guard_collide_on_shared_storage(agent):
    """Variant 2 of design.md: `local_rank == 0` guards one writer per node; two simulated
    nodes (two torchrun invocations, --nnodes 2, loopback master) share the directory."""
    job = f"e2e-2node-{uuid.uuid4().hex[:8]}"
    out = os.path.join(short_tmpdir("cwo"), "ckpt")
    from helpers import free_port
    port = free_port()
    # The two writers (local rank 0 of each node) overlap by construction: two 8 MiB saves
    # after a barrier did not always overlap on a loaded machine, and back-to-back writes are
    # a redundant chain, reported only after the 60 s collision window.
    program, overlap_env = overlapping(2)
    procs = []
    for node_rank, node in enumerate(("node-a", "node-b")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
        # Node scope only: one agent sees both "nodes"' processes on this host (job scope,
        # which would add each node's view of the other, has tests/e2e/test_jobscope.py).
        env.update({"CKPTWATCH_JOB": job, "CKPTWATCH_NODE": node, "OMP_NUM_THREADS": "1",
                    "CKPTWATCH_JOBSCOPE": "0"}, **overlap_env)
        cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--",
               sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node_rank), "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               *program, "--out", out, "--save", "local-rank0"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output[-3000:]
    wait_for(lambda: len(writes_of(agent, job)) == 2, timeout=30, message="2 write records")
    found = wait_for(lambda: collisions_of(agent, job), timeout=30, message="collision")
    c = found[0]
    # One agent: both "nodes" are its node (it stamps its own --node.name on hook events;
    # CKPTWATCH_NODE is only the hook's claim). Different processes still collide.
    assert {(w["rank"], w["local_rank"]) for w in c["writers"]} == {(0, 0), (2, 0)}
    assert len({w["node"] for w in c["writers"]}) == 1
    assert c["kind"] == "concurrent"


def test_real_prometheus_scrapes_the_agent_and_the_collision_alert_goes_pending(agent):
    """The fleet path: a real Prometheus with the shipped scrape settings and alert rules,
    scraping the real agent after a real 2-rank collision."""
    from prom import start_prometheus, wait_for_query
    # The two ranks' saves overlap by construction (an 8 MiB save could end before the other
    # rank's began on a loaded machine: a redundant chain, reported only after the 60 s window).
    job, out = run_job(agent, "every-rank", nproc=2, overlap=True)
    wait_for(lambda: collisions_of(agent, job), timeout=30, message="collision record")
    rules = os.path.join(REPO_ROOT, "deploy", "prometheus", "ckptwatch-rules.yml")
    target = agent.url.split("//", 1)[1].rstrip("/")
    with start_prometheus([target], rule_files=[rules]) as prom:
        result = wait_for_query(
            prom, f'ckptwatch_collisions_total{{training_job="{job}",kind="concurrent"}}')
        assert [r["value"][1] for r in result] == ["1"]
        assert result[0]["metric"]["scope"] == "node"
        ranks = prom.query(f'ckptwatch_writes_total{{training_job="{job}"}}')
        assert sorted(r["metric"]["rank"] for r in ranks) == ["0", "1"]
        alerts = wait_for_query(
            prom, f'ALERTS{{alertname="CkptwatchConcurrentWriteCollision",training_job="{job}"}}')
        assert alerts[0]["metric"]["severity"] == "critical"
