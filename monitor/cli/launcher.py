"""A private agent in a child process: `ckptwatch demo`, `check`, the benchmarks and the tests.

One launcher for every caller that needs a real agent of its own: a private socket directory
(short, under /tmp: AF_UNIX paths are limited to 108 bytes), a free loopback port, a journal
and a log file, extra flags as given. start() returns once /healthz answers and the socket
exists; stop() sends SIGTERM (the agent finalises collisions and flushes its journal) and
removes the private socket directory.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# agent.py beside the packages in a checkout; an installed ckptwatch has the console entry.
_AGENT_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "agent.py")


def free_port() -> int:
    """A loopback TCP port free right now (the agent binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(*args: str) -> list[str]:
    """The command that runs the agent with args, from a checkout or an installed package."""
    if os.path.exists(_AGENT_SCRIPT):
        return [sys.executable, _AGENT_SCRIPT, *args]
    return [sys.executable, "-m", "monitor.cli", "agent", *args]


_PR_SET_PDEATHSIG = 1


def _death_signal_setter():
    """A function for the child, between fork and exec, that asks the kernel for SIGTERM when
    the parent dies (prctl PR_SET_PDEATHSIG); None where there is no prctl. Looked up here,
    in the parent: the child should do as little as possible before exec."""
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):     # not Linux
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class AgentProcess:
    """A real agent subprocess with its own socket, port, journal and log.

    workdir holds the journal and the log (a fresh temporary directory when None, removed by
    close()); `socket` and `port` default to private ones; `journal` defaults to
    workdir/journal.jsonl; `extra` are more agent flags. die_with_parent: the kernel sends the
    agent SIGTERM if the thread that started it dies (even by SIGKILL; Linux only), so a
    killed `ckptwatch check` leaves no agent behind; and the agent gets a process group of its
    own, so a Ctrl-C meant for the job does not stop it before the job's last events are in.
    """

    def __init__(self, workdir: str | None = None, *extra: str, socket: str | None = None,
                 port: int | None = None, log_level: str = "debug",
                 log_name: str = "agent.log", env: dict | None = None,
                 journal: str | None = None, die_with_parent: bool = False):
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="ckptwatch-agent-")
        self._sockdir = tempfile.mkdtemp(prefix="cwa", dir="/tmp")
        self.socket = socket or os.path.join(self._sockdir, "agent.sock")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.journal = journal or os.path.join(self.workdir, "journal.jsonl")
        self.log_path = os.path.join(self.workdir, log_name)
        self.args = ["--ingest.socket", self.socket,
                     "--web.listen-address", f"127.0.0.1:{self.port}",
                     "--journal.path", self.journal, "--log.level", log_level, *extra]
        self._env = env
        self._die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None

    # ---- life cycle --------------------------------------------------------------------

    def launch(self) -> "AgentProcess":
        """Start the process without waiting for it (tests of failing starts use this)."""
        tied = {}
        if self._die_with_parent:
            tied = {"process_group": 0, "preexec_fn": _death_signal_setter()}
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(agent_command(*self.args), stdin=subprocess.DEVNULL,
                                         stdout=log_file, stderr=log_file, env=self._env,
                                         cwd=self.workdir,
                                         **tied)
        return self

    def start(self, timeout: float = 30.0) -> "AgentProcess":
        """Launch and wait until /healthz answers 200 and the socket exists."""
        self.launch()
        deadline = time.monotonic() + timeout
        try:
            while not self.ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the agent did not become healthy within {timeout:g}s; "
                                       f"log:\n{self.log[-3000:]}")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def ready(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"the agent exited with code {self.proc.returncode}; "
                               f"log:\n{self.log[-3000:]}")
        try:
            return self.get("/healthz", timeout=1)[0] == 200 and os.path.exists(self.socket)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Send sig, wait for exit (SIGKILL after timeout); the exit code."""
        return self._terminate(sig, timeout)

    def _terminate(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        """Stop the agent, remove the private socket directory (and a workdir we made)."""
        self._terminate()
        shutil.rmtree(self._sockdir, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "AgentProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- looking at it -----------------------------------------------------------------

    @property
    def log(self) -> str:
        """Everything the agent wrote to stderr so far."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    def get(self, route: str, timeout: float = 5.0) -> tuple[int, str]:
        """(HTTP status, body) of a GET on the agent's web server."""
        try:
            with urllib.request.urlopen(self.url + route, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def scrape(self) -> str:
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {body[:500]}")
        return body

    def samples(self) -> list:
        """Every sample of a real scrape (prometheus_client's parser)."""
        from prometheus_client.parser import text_string_to_metric_families
        return [s for family in text_string_to_metric_families(self.scrape())
                for s in family.samples]

    def metric(self, name: str, **labels) -> float | None:
        """The value of the sample `name` whose labels include `labels`, summed over matches;
        None if no sample matches. `name` is the sample name, e.g. ..._total or ..._bucket."""
        values = [s.value for s in self.samples()
                  if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())]
        return sum(values) if values else None

    def metrics(self) -> dict[str, float]:
        """Sum of every sample per name (labels folded)."""
        sums: dict[str, float] = {}
        for s in self.samples():
            sums[s.name] = sums.get(s.name, 0.0) + s.value
        return sums

    def journal_records(self) -> list[dict]:
        """Every journal record so far (rotated files first)."""
        from exporters.journal import read_records
        if not os.path.exists(self.journal):
            return []
        return list(read_records(self.journal))

    def idle(self) -> bool:
        """One look at whether the agent holds nothing of anyone's: no hook connected, no
        event queued, no write in flight, no verification to come (as read by the scrape)."""
        sums = self.metrics()
        return (sums.get("ckptwatch_ingest_connections", 0) == 0
                and sums.get("ckptwatch_loop_lag_seconds", 0) == 0
                and sums.get("ckptwatch_active_writes", 0) == 0
                and sums.get("ckptwatch_verifications_pending", 0) == 0)

    def wait_settled(self, quiet: float = 1.0, timeout: float = 60.0,
                     interval: float = 0.1, cancelled=lambda: False) -> bool:
        """Wait until idle() has held for `quiet` seconds without a break; False when
        `timeout` passes first (or cancelled() turns true). Call it once the writers are gone.

        `quiet` spans more than one of the agent's ticks (0.2 s), so an event that arrived
        between two gauges of a tick is seen at the next one; and it covers what reaches the
        agent late: the file watcher hands on events up to ~0.5 s after they happen, the
        source merger holds them up to 0.25 s more."""
        deadline = time.monotonic() + timeout
        idle_since = None
        while not cancelled():
            now = time.monotonic()
            try:
                idle = self.idle()
            except (OSError, RuntimeError):
                idle = False
            if not idle:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= quiet:
                return True
            if now > deadline:
                return False
            if not self.alive():
                return False
            time.sleep(interval)
        return False

    def collisions(self) -> list[dict]:
        return [r for r in self.journal_records() if r.get("type") == "collision"]
