"""Helpers shared by the benchmarks: a real agent subprocess on a private socket and port."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from monitor.cli.launcher import AgentProcess, free_port  # noqa: E402

__all__ = ["REPO", "Agent", "free_port", "tree_python", "valgrind_instructions"]


def tree_python(tree: str) -> str:
    """The interpreter that runs a checkout: its own .venv when it has one (a baseline
    worktree measured side by side), else this one."""
    own = os.path.join(tree, ".venv", "bin", "python")
    return own if os.path.exists(own) else sys.executable


def valgrind_instructions(args: list, label: str, env=None) -> int:
    """Instructions a Python run of `args` (this interpreter) takes, user space, every thread:
    valgrind's cachegrind without cache simulation (bench/hook_instructions.py,
    bench/loop_instructions.py -- a count that does not move with the machine's load)."""
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
           sys.executable, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stderr
    for line in out.splitlines():
        if "I   refs:" in line or "I refs:" in line:
            return int(line.split(":")[1].replace(",", "").split()[0])
    raise SystemExit(f"no instruction count from valgrind for {label}:\n{out[-2000:]}")


class Agent(AgentProcess):
    """The real agent (python agent.py) on a private socket, port and journal, started at
    once; quiet (warning level) so its log costs the measurement nothing. `tree`: run the
    agent.py of that checkout (with its own venv) instead of this one's, to measure an old
    release side by side with the same load."""

    def __init__(self, *extra: str, tree: str | None = None):
        super().__init__(None, *extra, log_level="warning")
        self.tree = os.path.abspath(tree) if tree else REPO
        self.start(timeout=20)

    def launch(self) -> "Agent":
        if self.tree == REPO:
            return super().launch()
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [tree_python(self.tree), os.path.join(self.tree, "agent.py"), *self.args],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                cwd=self.workdir)
        return self

    def stop(self) -> None:
        """Benchmarks are done with the agent: stop it and remove its directories."""
        self.close()
