"""Verify checkpoints once their writers are done, off the agent's loop.

Two parts with one responsibility each:
- VerifySchedule (pure, injected clock): which paths are due. A finished write makes its path
  due `quiet` seconds later; another write on the path pushes that back. Verifying earlier
  would read a file that a colliding writer is still writing and blame the wrong moment.
  A collision on the path is remembered so the verdict can name the collision that made it.
- Verifier (a worker thread with a bounded queue): runs monitor.verify.integrity.verify on due paths
  and hands each Verification back through an outbox the agent's loop drains, so exporters
  stay on the loop's thread. A full queue skips the path (counted): verification is a check
  on top, never a reason to fall behind.

Deep checks (CRC32 of every byte) run for files up to `deep_max_bytes`, at most `max_rate`
bytes/s, so a node's disks stay the training job's.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from monitor.verify import integrity

log = logging.getLogger("ckptwatch.verifier")

RESULT_GONE = "gone"        # the file was renamed or deleted before it could be verified
RESULTS = (integrity.OK, integrity.CORRUPT, integrity.UNVERIFIABLE, RESULT_GONE)
MAX_REMEMBERED = 10000      # files whose last verified (size, mtime, inode) is kept


@dataclass(frozen=True)
class Verification:
    """One verified file: the journal's "verification" record and the metrics' input."""

    path: str
    result: str                       # one of RESULTS
    format: str = ""
    reason: str = ""
    cause: str = ""                   # integrity.CAUSES when corrupt: a bounded label value
    deep: bool = False
    bytes: int | None = None
    seconds: float = 0.0
    job: str = ""
    collision_id: str = ""            # the collision that wrote this path, if one did
    wall: float = 0.0

    def to_record(self) -> dict:
        return {"type": "verification", "path": self.path, "result": self.result,
                "format": self.format, "reason": self.reason, "cause": self.cause,
                "deep": self.deep, "bytes": self.bytes, "seconds": self.seconds,
                "job": self.job, "collision_id": self.collision_id, "wall": self.wall}


@dataclass
class _Due:
    at: float
    job: str = ""
    collision_id: str = ""


@dataclass
class VerifySchedule:
    """Pure: which paths are quiet enough to verify now."""

    quiet: float = 1.0
    max_paths: int = 10000
    _due: dict = field(default_factory=dict)

    def write_finished(self, path: str, job: str, now: float) -> None:
        entry = self._due.pop(path, None) or _Due(now, job)
        entry.at = now + self.quiet
        entry.job = job or entry.job
        self._due[path] = entry           # re-inserted: dict order = due order
        if len(self._due) > self.max_paths:
            self._due.pop(next(iter(self._due)))

    def write_started(self, path: str, now: float) -> None:
        """A new write on a due path: not quiet any more, wait for its end."""
        entry = self._due.get(path)
        if entry is not None:
            entry.at = float("inf")

    def collided(self, path: str, collision_id: str, now: float) -> None:
        entry = self._due.get(path)
        if entry is None:
            entry = self._due[path] = _Due(now + self.quiet)
        entry.collision_id = collision_id

    def due(self, now: float) -> list[tuple[str, str, str]]:
        """(path, job, collision_id) of every path quiet since `quiet` seconds; removed."""
        ready = [(p, e.job, e.collision_id) for p, e in self._due.items() if e.at <= now]
        for path, _, _ in ready:
            del self._due[path]
        return ready

    def __len__(self) -> int:
        return len(self._due)


class Verifier:
    """Runs verifications in one worker thread; results come back through drain()."""

    def __init__(self, deep_max_bytes: int = 256 << 20, max_rate: float | None = 200e6,
                 max_queue: int = 1024, wall_clock=time.time):
        self.deep_max_bytes = deep_max_bytes
        self.max_rate = max_rate
        self._inbox: queue.Queue = queue.Queue(maxsize=max_queue)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wall = wall_clock
        self._thread: threading.Thread | None = None
        self.skipped_total = 0            # paths not verified because the queue was full
        # path -> (size, mtime_ns, inode) last verified: the same bytes are not verified (and
        # reported) twice when several signals say one file is finished (polling, hook+fs).
        self._verified: OrderedDict = OrderedDict()
        self.unchanged_total = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptwatch-verifier",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the file being verified; queued paths are dropped."""
        if self._thread is None:
            return
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        self._inbox.put(None)
        self._thread.join(timeout)
        self._thread = None

    def submit(self, path: str, job: str = "", collision_id: str = "") -> bool:
        try:
            self._inbox.put_nowait((path, job, collision_id))
            return True
        except queue.Full:
            self.skipped_total += 1
            return False

    def drain(self) -> list[Verification]:
        out = []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def verify(self, path: str, job: str = "", collision_id: str = "") -> Verification | None:
        """Verify one file now (the worker's step; also usable directly). None when the file
        is unchanged since it was last verified."""
        started = time.monotonic()
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return Verification(path, RESULT_GONE, job=job, collision_id=collision_id,
                                wall=self._wall())
        except OSError:
            st = None
        size = st.st_size if st is not None else None
        if st is not None:
            signature = (st.st_size, st.st_mtime_ns, st.st_ino)
            if self._verified.get(path) == signature:
                self.unchanged_total += 1
                return None
            self._verified[path] = signature
            self._verified.move_to_end(path)
            if len(self._verified) > MAX_REMEMBERED:
                self._verified.popitem(last=False)
        deep = size is not None and size <= self.deep_max_bytes
        verdict = integrity.verify(path, deep=deep, max_bytes_per_second=self.max_rate)
        cause = ""
        if verdict.status == integrity.CORRUPT:
            cause = verdict.details.get("cause") or integrity.corrupt_cause(verdict.reason)
        return Verification(path, verdict.status, verdict.format, verdict.reason, cause, deep,
                            size, time.monotonic() - started, job, collision_id, self._wall())

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            try:
                result = self.verify(*item)
                if result is not None:
                    self._outbox.put(result)
            except Exception:       # a verifier bug must not kill the thread
                log.exception("verification of %r failed", item[0])
