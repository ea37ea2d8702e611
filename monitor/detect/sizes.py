"""Size fluctuation between finished writes: pure, injected times.

design.md: "finished writes of the same path within the window differ in size". When ranks
that should not all save do, each one's save ends with a different file size (each saw the
file as the others left it). Only writes by *different* processes are compared: one process
whose checkpoints change size (the first save before the optimizer has state, a growing
replay buffer) is normal. The shrink-while-open rule lives in monitor.fs.watch.
"""
from __future__ import annotations

from collections import OrderedDict

from monitor.detect.model import FINDING_SIZE_FLUCTUATION, Finding, Write


class SizeHistory:
    def __init__(self, window: float = 60.0, tolerance: float = 0.01, max_paths: int = 10000):
        self.window = window
        self.tolerance = tolerance
        self.max_paths = max_paths
        # path -> (end_mono, bytes, writer, site, end_wall) of its last finished write: what a finding
        # names of it, not the Write (one per path, up to max_paths of them).
        self._last: OrderedDict = OrderedDict()

    def finished(self, write: Write) -> Finding | None:
        """Record a finished write; a size_fluctuation Finding if its size departs from the previous
        finished write of the path by another process within the window."""
        if write.outcome != "ok" or write.bytes is None or write.end_mono is None:
            return None
        previous = self._last.get(write.path)
        current = (write.end_mono, write.bytes, write.writer, write.site, write.end_wall)
        if previous is None or write.end_mono >= previous[0]:
            self._last[write.path] = current
        self._last.move_to_end(write.path)
        if len(self._last) > self.max_paths:
            self._last.popitem(last=False)
        if previous is None:
            return None
        # Ends of different processes arrive on different connections, read in no fixed
        # order: compare in the order the writes ended, not the order they came in.
        before, after = (previous, current) if write.end_mono >= previous[0] else \
            (current, previous)
        first, second = before[2], after[2]
        # The same Writer object first: the detector hands out one per identity, so the same
        # process saving again (the usual case) is told without building the two keys.
        if (first is second or first.key == second.key
                or after[0] - before[0] > self.window):
            return None
        largest = max(before[1], after[1], 1)
        if abs(before[1] - after[1]) / largest <= self.tolerance:
            return None
        jobs = sorted({first.job_label, second.job_label})
        return Finding(FINDING_SIZE_FLUCTUATION, write.path,
                       jobs[0] if len(jobs) == 1 else ",".join(jobs), after[4],
                       second.node, write.source,
                       tuple({"pid": w.pid, "rank": w.rank, "node": w.node, "bytes": nbytes,
                              "site": where} for _, nbytes, w, where, _ in (before, after)),
                       {"v": 1, "rule": "finished sizes differ", "size_before": before[1],
                        "size_after": after[1]})
