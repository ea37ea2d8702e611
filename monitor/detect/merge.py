"""One write, two witnesses: keep the hook's report and note that the filesystem saw it too.

The filesystem watcher (monitor.fs.watch) reports every write it sees as start/end events with
"source": "fs", including the saves the hook reports itself. Fed to the detector as they
are, each hooked save would count twice. This pure stage sits between the watcher and the
detector:

- it holds each fs event for `delay` seconds: inotify reports an open at once, while the
  hook's events come through the trainer's sender thread a few milliseconds later;
- an fs write by a pid whose hook write on the same path overlaps it is the same write: it is
  not passed on, and the hook write is marked as seen by "fs" (Detector.mark_source), so a
  collision of such writes is one collision with both sources;
- any other fs write (a writer the hook cannot see: safetensors, C++, an uninstrumented job)
  goes to the detector, with the identity the hook reported for that pid if it ever did
  (one node name, one rank, whichever source saw the process first).

Injected clock; no threads.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque

from monitor.detect.model import Writer

# Slack for comparing the hook's and the watcher's readings of one write: the hook reads the
# clock just before open() and after close(); the watcher handles inotify's events a moment
# (under load, many milliseconds) later. Generous on purpose: only writes by the same pid to
# the same path are ever merged, so a loose match merges a process's save with its own.
SLACK = 1.0
EXPIRE_EVERY = 1.0
# Hook writes remembered per (pid, path): a process saves one file at a time, so the latest
# few are all a held fs event can match. A sender's starts that never end would otherwise pile
# up under one key (they never expire: no end).
MAX_WRITES_PER_KEY = 8


class SourceMerger:
    def __init__(self, delay: float = 0.25, window: float = 60.0, max_paths: int = 10000,
                 clock=time.monotonic):
        self.delay = delay
        self.window = window
        self.max_paths = max_paths
        self._clock = clock
        self._held: deque = deque()                     # (due, fs event)
        self._hook_writes: OrderedDict = OrderedDict()  # (pid, path) -> {seq: [start, end, key]}
        self._identity: OrderedDict = OrderedDict()     # pid -> Writer the hook reported
        self._merged: dict = {}                         # fs (pid, seq) -> hook key
        # Hook writes held in _hook_writes, in all: at most max_paths (the oldest (pid, path)
        # goes first), so no sender can grow the merger or its once-a-second sweep.
        self.remembered = 0
        self.merged_total = 0
        self._next_expiry = 0.0

    def hook_event(self, event: dict) -> None:
        """Remember a hook start/end (call for every hook event, before the detector)."""
        pid, path = event["pid"], event["path"]
        self._identity[pid] = Writer.from_event(event)
        self._identity.move_to_end(pid)
        writes = self._hook_writes.get((pid, path))
        if writes is None:
            writes = self._hook_writes[(pid, path)] = {}
        self._hook_writes.move_to_end((pid, path))
        key = (event["node"], pid, event["seq"])
        entry = writes.get(event["seq"])
        if entry is None:
            start = event["mono"] if event["type"] == "start" else event["start_mono"]
            entry = writes[event["seq"]] = [start, None, key]
            self.remembered += 1
            if len(writes) > MAX_WRITES_PER_KEY:
                del writes[next(iter(writes))]
                self.remembered -= 1
        if event["type"] == "end":
            entry[1] = event["mono"]
        while len(self._hook_writes) > self.max_paths or self.remembered > self.max_paths:
            _, dropped = self._hook_writes.popitem(last=False)
            self.remembered -= len(dropped)
        while len(self._identity) > self.max_paths:
            self._identity.popitem(last=False)

    def fs_event(self, event: dict) -> None:
        """Hold an fs start/end for `delay` seconds before deciding what it is."""
        self._held.append((self._clock() + self.delay, event))

    def due(self) -> tuple[list[dict], list[tuple[str, tuple]]]:
        """(fs events for the detector, (path, hook key) pairs the fs also saw)."""
        now = self._clock()
        forward: list[dict] = []
        seen: list[tuple[str, tuple]] = []
        while self._held and self._held[0][0] <= now:
            _, event = self._held.popleft()
            pid, path, seq = event["pid"], event["path"], event["seq"]
            if event["type"] == "end" and (pid, seq) in self._merged:
                self._merged.pop((pid, seq))
                continue
            start = event["mono"] if event["type"] == "start" else event["start_mono"]
            end = None if event["type"] == "start" else event["mono"]
            key = self._matching_hook_write(pid, path, start, end)
            if key is not None:
                self.merged_total += 1
                seen.append((path, key))
                if event["type"] == "start":
                    self._merged[(pid, seq)] = key
                    if len(self._merged) > self.max_paths:
                        self._merged.pop(next(iter(self._merged)))
                continue
            known = self._identity.get(pid)
            if known is not None:
                event = {**event, **known.to_record()}
            forward.append(event)
        self._expire(now)
        return forward, seen

    def _matching_hook_write(self, pid, path, start, end):
        for hook_start, hook_end, key in self._hook_writes.get((pid, path), {}).values():
            if start < hook_start - SLACK:
                continue            # the file was opened before the save began: another write
            if hook_end is not None and start > hook_end + SLACK:
                continue            # opened after the save ended: a later write
            return key
        return None

    def _expire(self, now: float) -> None:
        # Hook writes that ended long ago can no longer match a held fs event. Swept once a
        # second, not per call: due() runs on every turn of the agent's loop.
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRE_EVERY
        horizon = now - self.window - self.delay - SLACK
        for k in list(self._hook_writes):
            writes = self._hook_writes[k]
            for seq in [s for s, (_, end, _) in writes.items()
                        if end is not None and end < horizon]:
                del writes[seq]
                self.remembered -= 1
            if not writes:
                del self._hook_writes[k]
