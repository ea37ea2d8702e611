"""End to end: CKPTWATCH_POLICY=atomic under real 4-rank torchrun races (gloo, CPU).

Every rank saves its own state (monitor.cli.demo_job's) to one path at once, after a barrier,
in 20 rounds with a path per round (tests/support/corpus.py's race worker), under `ckptwatch
run` with a real agent. With the atomic policy every checkpoint must load and be exactly one rank's
state, no temporary file may be left, and the agent must still report the collisions: the
guard is still missing, only the damage is gone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from agentproc import start_agent
from helpers import REPO_ROOT, remove_tree, short_tmpdir

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

RUNS = 20           # rounds: each a race of NPROC ranks saving one path
NPROC = 4
WIDTH = "256"       # 0.5 MiB per save: small, yet big enough to overlap


@pytest.fixture(scope="module")
def agent():
    workdir = short_tmpdir("cwe")
    with start_agent(workdir, "--collision.settle", "0.5", "--verify.quiet", "0.5") as proc:
        yield proc
    remove_tree(workdir)


def race(agent, job: str, out: str) -> None:
    """One torchrun job, RUNS rounds. (It was RUNS jobs of one save each: a torchrun start
    costs ~10 s of CPU, a round ~0.1 s, and a fresh job per race proved nothing more.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update({"CKPTWATCH_JOB": job, "CKPTWATCH_POLICY": "atomic", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": REPO_ROOT + (os.pathsep + env["PYTHONPATH"]
                                           if env.get("PYTHONPATH") else "")})
    cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(NPROC), os.path.join(REPO_ROOT, "tests", "support", "corpus.py"),
           "--out", out, "--rounds", str(RUNS), "--width", WIDTH]
    result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_atomic_races_leave_one_whole_rank_state_and_are_still_reported(agent):
    from corpus import single_rank_output

    out = short_tmpdir("cwo")
    job = f"e2e-atomic-{uuid.uuid4().hex[:6]}"
    races = [os.path.join(out, f"race-{i}.pt") for i in range(RUNS)]
    try:
        race(agent, job, out)
        # Each raced file is exactly one rank's save (demo_job.consistency() and every tensor
        # equal to that rank's own reference save), and no temporary file is left.
        assert {path: single_rank_output(path, out) is not None for path in races} == \
            {path: True for path in races}
        assert sorted(os.listdir(out)) == sorted(
            [f"ref-rank{r}.pt" for r in range(NPROC)] + [os.path.basename(p) for p in races])
        agent.wait_judged()
        records = [r for r in agent.journal_records() if r.get("job") == job]
        collided = {r["path"] for r in records if r.get("type") == "collision"}
        writes = [r for r in records if r.get("type") == "write" and r["path"] in races]
        assert len(writes) == RUNS * NPROC
        assert all(w["outcome"] == "ok" for w in writes)
        # Whether four saves of 0.5 MiB overlap is up to the scheduler; over 20 rounds they do
        # most of the time, and every overlap is still a concurrent collision.
        assert len(collided & set(races)) >= RUNS // 2, collided
        assert not [r for r in records if r.get("type") == "verification"
                    and r.get("result") == "corrupt"]
    finally:
        remove_tree(out)
