"""The real agent as a subprocess, for end-to-end tests.

    with start_agent(workdir, window=5) as agent:
        ... send events to agent.socket ...
        collision = agent.wait_for_collision()
        assert agent.metric("ckptwatch_collisions_total", kind="concurrent") == 1

The agent runs `python agent.py` on a short private socket path, a free loopback port and a
journal in workdir, at debug log level with stderr captured to a file (agent.log).
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

from helpers import subprocess_env, wait_for
from monitor.cli import launcher


# wait_judged() sends its sentinel collisions as this job, on paths under SENTINEL_DIR next to
# the journal (never created).
SENTINEL_JOB = "ckptwatch-test-sentinel"
SENTINEL_DIR = "sentinel"


class AgentProcess(launcher.AgentProcess):
    """monitor.cli.launcher's agent with what tests wait for; wait_judged()'s sentinels are left
    out of what it shows."""

    def metric(self, name: str, **labels) -> float | None:
        """The value of the sample `name` whose labels include `labels`, summed over matches;
        None if no sample matches. `name` is the sample name, e.g. ..._total or ..._bucket.
        Samples of wait_judged()'s SENTINEL_JOB are left out."""
        values = [s.value for s in self.samples()
                  if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())
                  and s.labels.get("training_job") != SENTINEL_JOB]
        return sum(values) if values else None

    def journal_records(self) -> list[dict]:
        """Every journal record so far (rotated files first), wait_judged()'s sentinels left
        out."""
        sentinels = os.path.join(os.path.dirname(self.journal), SENTINEL_DIR) + os.sep
        return [r for r in super().journal_records()
                if not str(r.get("path", "")).startswith(sentinels)]

    def _all_records(self) -> list[dict]:
        return super().journal_records()

    def popen(self, argv, **kwargs) -> subprocess.Popen:
        """A process beside the agent (wait_judged()'s senders); tests/support/hosts.py's
        agents run theirs inside their host."""
        return subprocess.Popen(argv, **kwargs)

    def wait_for_collision(self, timeout: float = 15.0, count: int = 1) -> dict:
        """Wait until the journal holds `count` collision records; return the last one."""
        found = wait_for(lambda: len(self.collisions()) >= count and self.collisions(),
                         timeout=timeout, message=f"{count} collision(s) in {self.journal}; "
                                                  f"agent log:\n{self.log}")
        return found[count - 1]

    def wait_judged(self, timeout: float = 30.0) -> None:
        """Wait until the agent has judged everything it received before this call: the
        positive signal that proves an absence (no collision, no second collision).

        A sentinel collision -- two processes of SENTINEL_JOB overlapping on a path of its
        own, sent now -- is final `settle` after its last end, like any concurrent group. The
        detector finalizes in due order and the journal is flushed every tick, so once the
        sentinel is journaled, every group whose writes ended before it was sent is final and
        in the journal and the metrics. (A write record would not do: writes are journaled
        when they end, their collisions only after `settle`.) journal_records(), collisions()
        and metric() leave the sentinel out; job-less metrics (events received, tracked
        paths) and verifications of job "" count it."""
        path = os.path.join(os.path.dirname(self.journal), SENTINEL_DIR, uuid.uuid4().hex)
        with EventSender(self.socket, path, rank=0, job=SENTINEL_JOB, popen=self.popen) as a, \
                EventSender(self.socket, path, rank=1, job=SENTINEL_JOB, popen=self.popen) as b:
            a.start()
            b.start()
            a.end()
            b.end()
            # Both stay alive until it is judged: a dead writer's open write would be "lost".
            wait_for(lambda: any(r.get("type") == "collision" and r.get("path") == path
                                 for r in self._all_records()),
                     timeout=timeout, message=f"the sentinel collision; agent log:\n{self.log}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until the detector holds nothing (ckptwatch_tracked_paths 0: every group and
        chain final and forgotten, every write ended), then until that last tick's findings are
        journaled (wait_judged). With a short --collision.window this proves that no redundant
        chain is still open; with the default 60 s window it would wait a minute."""
        wait_for(lambda: self.metric("ckptwatch_tracked_paths") == 0
                 and not self.metric("ckptwatch_active_writes"),
                 timeout=timeout, message=f"the detector idle; agent log:\n{self.log}")
        self.wait_judged()


def _agent(workdir: str, extra_args, window, socket, port, log_name) -> AgentProcess:
    extra = list(extra_args)
    if window is not None:
        extra += ["--collision.window", str(window)]
    return AgentProcess(workdir, *extra, socket=socket, port=port, log_name=log_name,
                        env=subprocess_env())


def launch_agent(workdir: str, *extra_args: str, window: float | None = None,
                 socket: str | None = None, port: int | None = None,
                 log_name: str = "agent.log") -> AgentProcess:
    """Start the agent without waiting for it (for tests of failing starts)."""
    return _agent(workdir, extra_args, window, socket, port, log_name).launch()


def start_agent(workdir: str, *extra_args: str, window: float | None = None,
                socket: str | None = None, port: int | None = None,
                timeout: float = 30.0) -> AgentProcess:
    """Start the real agent and wait until /healthz answers 200 and its socket exists."""
    agent = _agent(workdir, extra_args, window, socket, port, "agent.log")
    try:
        return agent.start(timeout=timeout)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


# --- a scripted event sender in its own process ------------------------------------------

_SENDER = r'''
import os, socket, sys, time
from ckptwatch import events
path, node, rank, job, ckpt = sys.argv[1:6]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(path)
base = {"v": 1, "node": node, "pid": os.getpid(), "rank": int(rank), "local_rank": int(rank),
        "world_size": 2, "job": job or None, "path": ckpt, "site": f"train.py:{10 + int(rank)}",
        "func": "save_checkpoint"}
seq, started = 0, None
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "start":
        seq += 1
        started = (time.time(), time.monotonic())
        sock.sendall(events.encode({**base, "type": "start", "seq": seq,
                                    "wall": started[0], "mono": started[1]}))
    elif cmd == "end":
        sock.sendall(events.encode({**base, "type": "end", "seq": seq, "wall": time.time(),
                                    "mono": time.monotonic(), "start_wall": started[0],
                                    "start_mono": started[1], "bytes": int(arg or 1234),
                                    "outcome": "ok"}))
    elif cmd == "raw":
        sock.sendall(bytes.fromhex(arg))
    elif cmd == "close":
        sock.close()
    print("ok", flush=True)
'''


class EventSender:
    """A separate Python process connected to the agent, sending hand-built events on command:
    start() / end() of a write of `path`, raw(bytes). Each call returns once the bytes are sent.
    """

    def __init__(self, socket: str, path: str, rank: int = 0, job: str = "job-e2e",
                 node: str = "test-node", popen=subprocess.Popen):
        self.proc = popen(
            [sys.executable, "-c", _SENDER, socket, node, str(rank), job, path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _do(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply.strip() == "ok", f"sender failed on {command!r} (exit {self.proc.poll()})"

    def start(self) -> None:
        self._do("start")

    def end(self, nbytes: int = 1234) -> None:
        self._do(f"end {nbytes}")

    def raw(self, data: bytes) -> None:
        self._do("raw " + data.hex())

    def close(self) -> int:
        """Close stdin (the sender exits, closing its connection); return its exit code."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> "EventSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Settle quickly so a collision is final ~0.2 s after its last write ends.
FAST = ("--collision.settle", "0.2")


def overlapping_writes(agent, path: str, job: str = "job-e2e") -> tuple[int, int]:
    """Rank 0 and rank 1, each its own process, write `path` with overlapping intervals."""
    with EventSender(agent.socket, path, rank=0, job=job) as a, \
            EventSender(agent.socket, path, rank=1, job=job) as b:
        a.start()
        b.start()
        a.end()
        b.end()
        # Keep both alive until the agent has both ends: a dead writer's open write is "lost".
        wait_for(lambda: (agent.metric("ckptwatch_writes_total", training_job=job) or 0) >= 2,
                 message="both writes finished")
        return a.pid, b.pid
