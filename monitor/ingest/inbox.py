"""The one queue between the ingest thread and the agent's loop (watchdog's observers/api.py
has one queue type between producers and the dispatcher for the same reason): its depth is
what back-pressure (ingest stops reading) and health (the loop is behind) look at.

The loop waits here, in the agent's main thread, where SIGTERM's handler runs. The wait is a
threading.Condition's, not queue.SimpleQueue.get(timeout=...): on CPython 3.10.13, 3.11.7 and
3.12.1 (not 3.13.0) that get never returns, whatever its timeout, when a signal interrupts it
and the handler (or the wait for the GIL before it runs) ends past the deadline: it waits
again with the negative time left, which is no timeout (tests/unit/test_inbox.py). An idle
agent told to stop then waited for an event that never came, and was SIGKILLed (issue 22).
"""
from __future__ import annotations

import threading
import time
from collections import deque

BATCH = 4096                # events taken from the queue per turn


class Inbox:
    """Event batches from the ingest thread to the loop, with a count for back-pressure and
    the time each batch was queued, so health can tell a loop that is behind."""

    def __init__(self, clock=time.monotonic):
        self._ready = threading.Condition(threading.Lock())
        self._batches: deque = deque()
        self._pending = 0
        self._clock = clock
        self._queued_at: deque = deque()    # one time per batch, in queue order
        self._taken = 0                     # batches taken by the loop so far
        self._finished = 0                  # of those, batches the loop has finished

    def put(self, batch: list) -> None:
        with self._ready:
            self._pending += len(batch)
            self._queued_at.append(self._clock())
            self._batches.append(batch)
            self._ready.notify()

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
        """Up to about BATCH events; waits up to `timeout` for the first batch (returns
        within it, signals or not)."""
        with self._ready:
            if not self._batches:
                if not timeout:
                    return []
                self._ready.wait(timeout)
                if not self._batches:
                    return []
            batch = list(self._batches.popleft())
            taken = 1
            while len(batch) < BATCH and self._batches:
                batch.extend(self._batches.popleft())
                taken += 1
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
