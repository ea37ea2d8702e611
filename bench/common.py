"""Helpers shared by the benchmarks: a real agent subprocess on a private socket and port."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """The real agent (python agent.py), started on a private socket, port and journal."""

    def __init__(self, *extra: str):
        self.dir = tempfile.mkdtemp(prefix="cwb", dir="/tmp")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(self.dir, "agent.log"), "w")
        cmd = [sys.executable, os.path.join(REPO, "agent.py"), "--ingest.socket", self.socket,
               "--web.listen-address", f"127.0.0.1:{self.port}", "--journal.path",
               os.path.join(self.dir, "journal.jsonl"), "--log.level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("agent did not start; log: " + self.dir)
                time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Sum of every sample per metric name (labels folded), from a real scrape."""
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        return sums

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
