"""End to end: CKPTWATCH_POLICY=atomic under real 4-rank torchrun races (gloo, CPU).

Every rank of monitor.cli.demo_job saves its own state to one path at once (--save
every-rank), 20 times, under `ckptwatch run` with a real agent. With the atomic policy every
checkpoint must load and be exactly one rank's state, no temporary file may be left, and the
agent must still report the collision: the guard is still missing, only the damage is gone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from agentproc import start_agent
from helpers import REPO_ROOT, remove_tree, short_tmpdir, wait_for

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

RUNS = 20
NPROC = 4
WIDTH = "256"       # 0.5 MiB per save: small enough for 20 runs, big enough to overlap


@pytest.fixture(scope="module")
def agent():
    workdir = short_tmpdir("cwe")
    with start_agent(workdir, "--collision.settle", "0.5", "--verify.quiet", "0.5") as proc:
        yield proc
    remove_tree(workdir)


def race(agent, job: str, out: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update({"CKPTWATCH_JOB": job, "CKPTWATCH_POLICY": "atomic", "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(NPROC), "-m", "monitor.cli.demo_job", "--out", out,
           "--save", "every-rank", "--steps", "1", "--width", WIDTH]
    result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_atomic_races_leave_one_whole_rank_state_and_are_still_reported(agent):
    from monitor.cli.demo_job import consistency

    top = short_tmpdir("cwo")
    jobs = []
    try:
        for run in range(RUNS):
            job = f"e2e-atomic-{run}-{uuid.uuid4().hex[:6]}"
            out = os.path.join(top, f"run{run}")
            race(agent, job, out)
            jobs.append(job)
            state = torch.load(os.path.join(out, "last.pt"), weights_only=False)
            assert consistency(state) is None, f"run {run}: {consistency(state)}"
            assert sorted(os.listdir(out)) == ["last.pt"], f"run {run}: {os.listdir(out)}"
        agent.wait_judged()
        records = agent.journal_records()
        collided = {r["job"] for r in records if r.get("type") == "collision"}
        writes = [r for r in records if r.get("type") == "write" and r.get("job") in jobs]
        assert len(writes) == RUNS * NPROC
        assert all(w["outcome"] == "ok" for w in writes)
        # Whether four saves of 0.5 MiB overlap is up to the scheduler; over 20 runs they do
        # most of the time, and every overlap is still a concurrent collision.
        assert len(collided & set(jobs)) >= RUNS // 2, collided
        assert not [r for r in records if r.get("type") == "verification"
                    and r.get("result") == "corrupt" and r.get("job") in jobs]
    finally:
        remove_tree(top)
