"""The truth log: every save's true interval on the host's one clock, as the writers logged it
(tests/support/groundtruth/writer.py) and, for a writer the harness SIGKILLed, when it was
seen dead.

One JSON line per event, appended by many processes to one file (O_APPEND: each line is one
write(), never interleaved): "start" right before the real torch.save, "end" right after it,
"killed" (by the harness, after waitpid) for a process killed while it wrote.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

OK = "ok"
LOST = "lost"       # the save never returned: its process was killed while it wrote


@dataclass(frozen=True)
class TrueWrite:
    """One save as it really happened. `end` is when it returned or, for a save whose
    process was killed while it wrote (outcome LOST), when the process was seen dead."""

    save: str
    node: str
    pid: int
    rank: int
    path: str
    start: float                # seconds (time.time_ns / 1e9)
    end: float
    outcome: str

    @property
    def writer(self) -> tuple[str, int]:
        return (self.node, self.pid)


class TruthLog:
    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        os.close(self._fd)

    def killed(self, pid: int, node: str) -> None:
        """Log that `pid` (SIGKILLed while it wrote) is dead now."""
        line = json.dumps({"ev": "killed", "pid": pid, "node": node, "t": time.time_ns()})
        os.write(self._fd, (line + "\n").encode())

    def events(self) -> list[dict]:
        with open(self.path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def ended(self, save: str) -> bool:
        """Has save `save` ended (returned, or its process logged killed)?"""
        return self.find(save, "end") is not None

    def find(self, save: str, ev: str) -> dict | None:
        for e in self.events():
            if e.get("save") == save and e["ev"] == ev:
                return e
        return None

    def writes(self) -> list[TrueWrite]:
        """Every save with its true interval, in start order."""
        events = self.events()
        killed = {(e["node"], e["pid"]): e["t"] for e in events if e["ev"] == "killed"}
        ends = {e["save"]: e for e in events if e["ev"] == "end"}
        out = []
        for s in (e for e in events if e["ev"] == "start"):
            end = ends.get(s["save"])
            if end is not None:
                t_end, outcome = end["t"], end["outcome"]
            elif (s["node"], s["pid"]) in killed:
                t_end, outcome = killed[(s["node"], s["pid"])], LOST
            else:
                raise AssertionError(f"save {s['save']} neither ended nor was killed")
            out.append(TrueWrite(s["save"], s["node"], s["pid"], s["rank"], s["path"],
                                 s["t"] / 1e9, t_end / 1e9, outcome))
        return sorted(out, key=lambda w: w.start)
