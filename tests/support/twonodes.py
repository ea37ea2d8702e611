"""Two simulated nodes on one host: one agent per node, one torchrun per node (loopback
master, one rendezvous), each under `ckptwatch run --socket <its agent>` with its own
CKPTWATCH_NODE, saving into one directory marked shared (CKPTWATCH_SHARED_PATHS). Neither
agent hears the other node's hooks: what it knows of the other node came through the job's
store (ckptwatch/jobscope.py)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid

from agentproc import start_agent
from helpers import REPO_ROOT, free_port, remove_tree, short_tmpdir

NODES = ("node-a", "node-b")
AGENT_ARGS = ("--collision.settle", "0.5", "--collision.job-settle", "3",
              "--collision.window", "5", "--verify.enabled", "false")


@contextlib.contextmanager
def two_agents(*extra):
    """{node name: AgentProcess} for NODES, stopped and removed on exit."""
    workdirs = [short_tmpdir("cw2n") for _ in NODES]
    started = []
    try:
        for workdir, node in zip(workdirs, NODES):
            started.append(start_agent(workdir, *AGENT_ARGS, *extra,
                                       "--node.name", node).__enter__())
        yield dict(zip(NODES, started))
    finally:
        for agent in started:
            agent.__exit__(None, None, None)
        for workdir in workdirs:
            remove_tree(workdir)


def run_two_nodes(agents, name: str, program: list, *, nproc: int = 1,
                  extra_env=None, extra_args=(), set_job: bool = True,
                  timeout: float = 400) -> tuple[str, str]:
    """Both nodes' torchruns of `program` (+ --out DIR + extra_args) at once; (job id, DIR)
    once both exited 0. DIR is inside the shared root. set_job=False leaves CKPTWATCH_JOB
    unset (the hook then takes the launcher's run id)."""
    job = f"{name}-{uuid.uuid4().hex[:8]}"
    root = short_tmpdir("cw2s")
    out = os.path.join(root, "out")
    port = free_port()
    procs = []
    for node_rank, node in enumerate(NODES):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
        env.update({"CKPTWATCH_NODE": node, "OMP_NUM_THREADS": "1",
                    "CKPTWATCH_SHARED_PATHS": root, "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"},
                   **(extra_env or {}))
        if set_job:
            env["CKPTWATCH_JOB"] = job
        cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agents[node].socket,
               "--", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               *program, "--out", out, *extra_args]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        output, _ = p.communicate(timeout=timeout)
        outputs.append(output)
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-4000:]
    return job, out
