"""Events as the hook puts them on the agent's socket, a client socket to send them, and a
Recorder of what the agent's IngestServer hands on: one definition for every test that talks
to an ingest server or an emitter."""
from __future__ import annotations

import os
import socket
import threading
import time


def start_event(seq: int = 1, pid: int | None = None, path: str = "/ckpt/last.pt",
                **extra) -> dict:
    """A valid start event from this process (or `pid`), stamped now; `extra` adds or
    overrides fields. seq comes first: the emitter builds (start_event, seq) itself."""
    event = {"v": 1, "type": "start", "node": "n1", "pid": os.getpid() if pid is None else pid,
             "seq": seq, "rank": 0, "path": path, "site": "train.py:10", "func": "save",
             "wall": time.time(), "mono": time.monotonic()}
    event.update(extra)
    return event


def end_event(seq: int = 1, pid: int | None = None, path: str = "/ckpt/last.pt",
              **extra) -> dict:
    """The end of start_event's write, stamped now (a zero-length write: start = end)."""
    event = start_event(seq, pid, path)
    event.update(type="end", start_wall=event["wall"], start_mono=event["mono"], bytes=1,
                 outcome="ok")
    event.update(extra)
    return event


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


class Recorder:
    """An IngestServer's on_events and on_reject: what it delivered (event by event, batches
    flattened) and rejected, in order (called from the server thread, read by the test)."""

    def __init__(self):
        self.events, self.rejects = [], []
        self.lock = threading.Lock()

    def on_events(self, batch):
        with self.lock:
            self.events.extend(batch)

    def on_reject(self, reason):
        with self.lock:
            self.rejects.append(reason)


def hold(path: str, n: int) -> list[socket.socket]:
    """n connections to path from this process, kept open (the caller closes them)."""
    return [connect(path) for _ in range(n)]
