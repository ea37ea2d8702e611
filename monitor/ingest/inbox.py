"""The one queue between the ingest thread and the agent's loop (watchdog's observers/api.py
has one queue type between producers and the dispatcher for the same reason): its depth is
what back-pressure (ingest stops reading) and health (the loop is behind) look at."""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

BATCH = 4096                # events taken from the queue per turn


class Inbox:
    """Event batches from the ingest thread to the loop, with a count for back-pressure and
    the time each batch was queued, so health can tell a loop that is behind."""

    def __init__(self, clock=time.monotonic):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._clock = clock
        self._queued_at: deque = deque()    # one time per batch, in queue order
        self._taken = 0                     # batches taken by the loop so far
        self._finished = 0                  # of those, batches the loop has finished

    def put(self, batch: list) -> None:
        with self._lock:
            self._pending += len(batch)
            self._queued_at.append(self._clock())
            self._queue.put(batch)          # under the lock: times stay in queue order

    def backlog(self) -> int:
        """Events waiting for the loop."""
        return self._pending

    def oldest_wait(self) -> float:
        """Seconds the oldest batch still queued has waited (0 when none is)."""
        try:
            return max(0.0, self._clock() - self._queued_at[0])
        except IndexError:
            return 0.0

    def take(self, timeout: float) -> list[dict]:
        """Up to about BATCH events; waits up to `timeout` for the first batch."""
        try:
            batch = list(self._queue.get(timeout=timeout)) if timeout else \
                list(self._queue.get_nowait())
        except queue.Empty:
            return []
        taken = 1
        while len(batch) < BATCH:
            try:
                batch.extend(self._queue.get_nowait())
            except queue.Empty:
                break
            taken += 1
        with self._lock:
            self._pending -= len(batch)
            for _ in range(taken):
                self._queued_at.popleft()
        self._taken += taken
        return batch

    def done(self) -> None:
        """The loop has finished everything it took (see finished())."""
        self._finished = self._taken

    def finished(self) -> int:
        """Batches put and finished by the loop: ingest acknowledges their frames to the
        hooks (monitor.ingest.server, "Acknowledgements"). Batches are numbered in put order."""
        return self._finished
