"""End to end: CKPTWATCH_POLICY=warn in real 2-rank torchrun jobs (gloo, CPU) with a real agent.

The unguarded job (--save every-rank, two saves from one call site) must print the warning
once per call site in each rank, naming the site, the other rank and the fix; the guarded job
(--save rank0) prints nothing. The ranks keep running a moment after each save (--pause), as
training does: the agent's verdict comes `settle` after the saves end.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentproc import start_agent
from helpers import REPO_ROOT, remove_tree, short_tmpdir

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

SITE = os.path.join(REPO_ROOT, "monitor", "cli", "demo_job.py") + ":"


@pytest.fixture(scope="module")
def agent():
    workdir = short_tmpdir("cwe")
    with start_agent(workdir, "--collision.settle", "0.3") as proc:
        yield proc
    remove_tree(workdir)


def run_job(agent, mode: str) -> str:
    out = short_tmpdir("cwo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update({"CKPTWATCH_POLICY": "warn", "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "monitor.cli.demo_job", "--out", out,
           "--save", mode, "--saves", "2", "--steps", "1", "--width", "512", "--pause", "2"]
    try:
        result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=300)
    finally:
        remove_tree(out)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def test_an_unguarded_job_warns_once_per_call_site_in_each_rank(agent):
    output = run_job(agent, "every-rank")
    warnings = [line for line in output.splitlines() if "CheckpointCollisionWarning" in line]
    # Two ranks, one call site each, two saves: one warning per rank, not one per save.
    assert len(warnings) == 2, output[-4000:]
    for line in warnings:
        assert line.startswith(SITE) and "last.pt" in line
        assert "rank 0" in line or "rank 1" in line
        assert "dist.get_rank() == 0" in line
    assert {("rank 1" in w) for w in warnings} == {True, False}   # each names the other
    # The log line (logging's last-resort handler, no logging configured) says the same.
    logged = [line for line in output.splitlines() if line.startswith("unsafe checkpoint save")]
    assert len(logged) == 2
    assert "Traceback" not in output


def test_a_guarded_job_prints_nothing(agent):
    output = run_job(agent, "rank0")
    assert "CheckpointCollisionWarning" not in output and "unsafe checkpoint" not in output
