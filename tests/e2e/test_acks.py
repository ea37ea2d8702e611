"""Issue 8, item 9: saves a killed agent had not taken in reach the agent that replaces it.

The real hook in a real training-like process, real agents as subprocesses on one socket path:
the first agent is stopped (SIGSTOP) so the hook's frames wait unread in its socket, then
killed (SIGKILL); a second agent starts on the same socket. Without acknowledgements those
saves were lost without a trace (the hook had written them; the kernel dropped them with the
dead agent's socket).
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from agentproc import start_agent
from helpers import subprocess_env, wait_for

pytestmark = pytest.mark.torch

FAST = ("--collision.window", "0.2", "--collision.settle", "0.2", "--verify.enabled=false")

TRAINER = r"""
import json, os, sys
import torch, ckptwatch
from ckptwatch.emitter import get_emitter
ckptwatch.install()
out = sys.argv[1]
state = {"w": torch.zeros(4)}
step = 0
for line in sys.stdin:
    command, _, arg = line.strip().partition(" ")
    if command == "save":
        for _ in range(int(arg)):
            step += 1
            torch.save(state, os.path.join(out, f"step{step}.pt"))
    print(json.dumps(get_emitter().stats()), flush=True)
"""


def test_saves_unread_by_a_killed_agent_reach_the_next_agent(tmp_path, sockdir):
    sock = os.path.join(sockdir, "agent.sock")
    out = tmp_path / "ckpt"
    out.mkdir()
    first_dir, second_dir = tmp_path / "a1", tmp_path / "a2"
    first_dir.mkdir()
    second_dir.mkdir()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(out)], text=True, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=subprocess_env(CKPTWATCH_SOCKET=sock,
                                                   CKPTWATCH_JOB="acks", RANK="0"))

    def command(line: str) -> dict:
        trainer.stdin.write(line + "\n")
        trainer.stdin.flush()
        return json.loads(trainer.stdout.readline())

    def written(path: str) -> set:
        return {os.path.basename(r["path"]) for r in path.journal_records()
                if r.get("type") == "write"}

    try:
        first = start_agent(str(first_dir), *FAST, socket=sock)
        try:
            command("save 5")
            wait_for(lambda: first.metric("ckptwatch_writes_total", training_job="acks") == 5,
                     message="the first agent took steps 1-5")
            wait_for(lambda: command("stats")["unacked"] == 0, timeout=15,
                     message="steps 1-5 acknowledged")
            os.kill(first.pid, signal.SIGSTOP)          # alive, reading nothing
            command("save 20")
            wait_for(lambda: command("stats")["sent"] >= 25, message="steps 6-25 written")
            assert command("stats")["unacked"] >= 20
            os.kill(first.pid, signal.SIGKILL)
            first.proc.wait(10)
        finally:
            first.close()
        assert written(first) == {f"step{i}.pt" for i in range(1, 6)}
        with start_agent(str(second_dir), *FAST, socket=sock) as second:
            # No further save is needed: the hook notices the dead connection by itself.
            wait_for(lambda: written(second) >= {f"step{i}.pt" for i in range(6, 26)},
                     timeout=20, message="steps 6-25 in the second agent's journal")
            stats = command("stats")
            assert stats["resent"] >= 20 and stats["dropped"] == 0
            command("save 1")
            wait_for(lambda: "step26.pt" in written(second), message="step 26")
            assert written(second) == {f"step{i}.pt" for i in range(6, 27)}
    finally:
        trainer.stdin.close()
        assert trainer.wait(timeout=30) == 0
