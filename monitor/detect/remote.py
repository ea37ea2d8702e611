"""Remote anchoring: other nodes' writes of a path, as local processes' job scope reports them.

A "remote" event (ckptwatch/events.py) is another node's write of a path, reported by the
local process (event node, pid) whose own write `seq` of that path this agent tracks. Nothing
in it can be checked, so what it can do is bounded: it is taken only while the reporter's own
write of that path is held here (a sender can add writes only to paths it wrote itself, never
create one), never about a writer on the reporter's own node (local_writer: a local
process's writes are its own to report), at most MAX_REMOTE_PER_PATH per path and
MAX_REMOTE_HELD in all, each remote write once; it is never a Write of this node (no write metrics) and its collision says scope "job"
and who reported it (monitor.detect.grouping).
"""
from __future__ import annotations

from collections import OrderedDict
from monitor.detect.model import REMOTE_REJECT_REASONS, SOURCE_JOB, Writer, writer_kind_of
from monitor.detect.tracked import Entry, PathState

# Remote writes held per path and in all, and how many remote write keys are remembered so a
# write reported again (by every local rank that wrote the path, or by later polls) counts
# once.
MAX_REMOTE_PER_PATH = 64
MAX_REMOTE_HELD = 8192
_REMOTE_SEEN_CAP = 65536


class RemoteWrites:
    """Which remote events may add a write (admit); counts what it refused (`rejected`) and
    what it took in (`admitted`)."""

    def __init__(self):
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self.rejected = {reason: 0 for reason in REMOTE_REJECT_REASONS}
        self.admitted = 0

    def admit(self, event: dict, state: PathState | None, held: int) -> bool:
        """May this validated remote event add its write to its path's `state`? False when
        refused (counted) or already seen. `held`: remote writes the detector holds now."""
        w = event["writer"]
        if w["node"] == event["node"]:
            # A process of this node: the agent hears of its writes from it, never from a
            # report. The event's node is the agent's own by now (the agent stamps it on
            # everything its socket receives) while the sender checked the writer's node
            # against the node it claimed: a local process could otherwise name any local pid
            # as a writer (and, under the warn policy, have the agent send that process a
            # notice).
            self.rejected["local_writer"] += 1
            return False
        anchor = (event["node"], event["pid"], event["seq"])
        if state is None or not any(e.key == anchor for e in state.entries):
            self.rejected["unanchored"] += 1
            return False
        key = (w["node"], w["pid"], event["wseq"])
        if key in self._seen or any(e.key == key for e in state.entries):
            return False
        if sum(1 for e in state.entries if e.source == SOURCE_JOB) >= MAX_REMOTE_PER_PATH:
            self.rejected["path_full"] += 1
            return False
        if held >= MAX_REMOTE_HELD:
            self.rejected["held_full"] += 1
            return False
        self._seen[key] = None
        if len(self._seen) > _REMOTE_SEEN_CAP:
            self._seen.popitem(last=False)
        self.admitted += 1
        return True


def remote_entry(event: dict, writer: Writer, order: int, now: float) -> Entry:
    """The finished Entry of an admitted remote event's write, attributed to its reporter."""
    entry = Entry(writer, event["path"], event["wseq"], event["start_wall"], event["start_mono"],
                  event.get("site"), event.get("func"), order, now, SOURCE_JOB)
    entry.reporter = event["pid"]
    entry.writer_kind = writer_kind_of(event, "writer_kind")   # the remote writer's library
    entry.finish(event["end_wall"], event["end_mono"], event.get("bytes"), event["outcome"],
                 now)
    return entry
