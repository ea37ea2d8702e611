"""End to end, job scope at exit: ranks that save and exit while the job's store stalls exit
exactly as they would without ckptwatch (issue 17: 5 of 8 exits were SIGABRT, "terminate called
without an active exception", from job scope's thread returning from a blocked C++ store call
during interpreter shutdown).

Eight real rank processes of a simulated 2-node job (torch imported, ckptwatch installed, job
scope active through a StallProxy in front of a real TCPStore), no agent (their events are
dropped: what is under test is the process's exit)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import REPO_ROOT, short_tmpdir, remove_tree, wait_for
from stallproxy import StallProxy

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

RANKS = 8
STALL = 4.0     # how long the store stays silent after the saves: the fault, not a wait
PROGRAM = os.path.join(REPO_ROOT, "tests", "support", "jobrank.py")


def run_ranks(store_port: int, stall_port: int, proxy: StallProxy | None, workdir: str,
              pythonpath: str = REPO_ROOT, extra_env=None) -> list:
    """(returncode, stderr, seconds from the go to its exit) of each rank."""
    procs = []
    for rank in range(RANKS):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
                    "RANK": str(rank), "LOCAL_RANK": str(rank % 4), "WORLD_SIZE": str(RANKS),
                    "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": str(rank // 4),
                    "CKPTWATCH_NODE": f"node-{rank // 4}", "CKPTWATCH_JOB": "stall",
                    "CKPTWATCH_STORE_PORT": str(stall_port), "OMP_NUM_THREADS": "1",
                    "CKPTWATCH_SHARED_PATHS": workdir, "PYTHONPATH": pythonpath,
                    "CKPTWATCH_SOCKET": os.path.join(workdir, "no-agent.sock"),
                    **(extra_env or {})})
        procs.append(subprocess.Popen([sys.executable, PROGRAM,
                                       os.path.join(workdir, "last.pt")],
                                      env=env, cwd=workdir, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith("ready"), (line, p.stderr.read() if p.poll() else "")
        if proxy is not None:
            proxy.stall()
        go = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline().strip() == "saved"
        if proxy is not None:
            time.sleep(STALL)           # the store stays silent while the ranks exit
            proxy.resume()
        results = []
        for p in procs:
            _, err = p.communicate(timeout=120)
            results.append((p.returncode, err, time.monotonic() - go))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_store_that_stalls_and_recovers_while_ranks_exit_never_aborts_them(job_store):
    workdir = short_tmpdir("cwst")
    proxy = StallProxy(job_store.port)
    try:
        results = run_ranks(job_store.port, proxy.port, proxy, workdir)
    finally:
        proxy.close()
        remove_tree(workdir)
    codes = [code for code, _, _ in results]
    # Without ckptwatch each of them exits 0 (it saves and returns): so must it with it.
    assert codes == [0] * RANKS, [(c, e[-600:]) for c, e, _ in results]
    for _, err, _ in results:
        assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
    # Bounded: the exit waits at most CKPTWATCH_JOBSCOPE_EXIT_WAIT (10 s) for the others, and
    # each store operation has its own deadline.
    assert max(seconds for _, _, seconds in results) < STALL + 30
