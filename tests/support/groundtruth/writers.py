"""The writer processes of one simulated job: one per slot (node, local rank), each a real
Python under `ckptwatch run` (the bootstrap's hook) with its node's agent socket, its node name
and the environment torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT). A process whose save ended it is
replaced at once by a fresh one with the same rank, started in the background."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from helpers import REPO_ROOT, subprocess_env

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer.py")
READY_TIMEOUT = 120.0


class WriterProcess:
    def __init__(self, argv: list[str], env: dict, node: str, log_path: str):
        self.node = node
        self.log_path = log_path
        with open(log_path, "wb") as log:       # a file: a pipe nobody reads could fill up
            self.proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        self.ready = False
        self.job_scope = None       # job scope's state, as the writer said when ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        if self.ready:
            return
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                with open(self.log_path, errors="replace") as log:
                    err = log.read()
                raise AssertionError(f"writer {self.pid} on {self.node} not ready "
                                     f"(exit {self.proc.poll()}): {err[-2000:]}")
            readable, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if readable:
                words = self.proc.stdout.readline().split()
                if words and words[0] == "ready":
                    self.ready = True
                    self.job_scope = words[1]
                    return

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


class Writers:
    """Slot -> its current WriterProcess; replace() after a save that ends the process."""

    def __init__(self, profile, agents: dict, truth_log: str, job: str, master_port: int,
                 shared_dir: str, log_dir: str, slots=None):
        self._log_dir = log_dir
        self._spawned = 0
        self._profile = profile
        self._agents = agents
        self._truth_log = truth_log
        self._job = job
        self._port = master_port
        self._shared = shared_dir
        self.current: dict = {}
        self.retired: list[WriterProcess] = []
        for slot in profile.slots if slots is None else slots:
            self.current[slot] = self._spawn(slot)

    def _spawn(self, slot) -> WriterProcess:
        node, local = slot
        p = self._profile
        env = subprocess_env(
            CKPTWATCH_NODE=node, CKPTWATCH_JOB=self._job, CKPTWATCH_SHARED_PATHS=self._shared,
            CKPTWATCH_JOBSCOPE_WINDOW=p.window, MASTER_ADDR="127.0.0.1",
            MASTER_PORT=self._port, RANK=p.rank(slot), LOCAL_RANK=local,
            WORLD_SIZE=p.world_size, LOCAL_WORLD_SIZE=p.local_world,
            GROUP_RANK=p.nodes.index(node), TORCHELASTIC_RESTART_COUNT=0,
            OMP_NUM_THREADS=1)
        argv = [sys.executable, "-m", "monitor.cli", "run", "--socket",
                self._agents[node].socket, "--", sys.executable, WRITER, self._truth_log]
        self._spawned += 1
        log = os.path.join(self._log_dir, f"writer-{node}-{local}-{self._spawned}.log")
        return WriterProcess(argv, env, node, log)

    def get(self, slot) -> WriterProcess:
        writer = self.current[slot]
        writer.wait_ready()
        return writer

    def replace(self, slot, needed: bool = True) -> None:
        """The slot's process is ending (or ended): start its successor now, if a later save
        needs it (a torch import is most of what a trial costs)."""
        self.retired.append(self.current[slot])
        if needed:
            self.current[slot] = self._spawn(slot)
        else:
            del self.current[slot]

    def close(self) -> None:
        for writer in list(self.current.values()) + self.retired:
            writer.close()
