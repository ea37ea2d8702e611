"""The agent's side of job scope: hazard and job-scope state events from local hooks.

"remote" events go straight to the detector (Detector.observe_remote); this module turns
"hazard" events into Findings, once per (job run, path, kind), and logs job-scope state
changes. Every event here came from a local process speaking about its own write (its pid was
checked by ingest); a hazard is that process's word about its path, and is labelled with who
reported it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from ckptwatch.events import WRITER_FIELDS
from ckptwatch.jobrun import job_run
from monitor.detect.model import FINDING_HAZARD, SOURCE_HOOK, Finding

log = logging.getLogger("ckptwatch.agent")

MAX_HAZARD_KEYS = 4096      # (run, path, kind) remembered for deduplication


class JobScopeEvents:
    """Hazard deduplication and state bookkeeping; runs on the agent loop's thread."""

    def __init__(self, max_keys: int = MAX_HAZARD_KEYS):
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._max_keys = max_keys
        self.remote_received = 0
        self.guard_contradicted = 0
        self.disabled_logged = 0

    def not_this_bug(self, event: dict, local_writers) -> bool:
        """Is a local_rank_guard hazard contradicted by what this node saw? The rule is "local
        rank 0 alone writes the path on its node"; a hook that could not read the job's store
        judges on its own write, and if another local rank of the same run writes the path
        too, every rank writes: no LOCAL_RANK == 0 guard to fix (issue 16). Counted."""
        if event["kind"] != "local_rank_guard":
            return False
        run = job_run(event.get("job"), event.get("master"), event.get("restart"))
        for w in local_writers:
            if w.pid != event["pid"] and w.local_rank != 0 and run is not None \
                    and w.run_key == run:
                self.guard_contradicted += 1
                return True
        return False

    def hazard(self, event: dict) -> Finding | None:
        """The Finding for a hazard event, or None if this run's path already had it."""
        # A run without a name is no other process's run: its hazards count per reporter.
        run = (job_run(event.get("job"), event.get("master"), event.get("restart"))
               or (event["node"], event["pid"]))
        key = (run, event["path"], event["kind"])
        if key in self._seen:
            self._seen.move_to_end(key)
            return None
        self._seen[key] = None
        if len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        # seq: the reporter's own write the hazard is about (its notice goes to the
        # connection that made that write: monitor.ingest.notices).
        writer = {name: event.get(name) for name in WRITER_FIELDS + ("seq", "site", "func")}
        return Finding(kind=FINDING_HAZARD, path=event["path"], job=event.get("job") or "",
                       wall=event["wall"], node=event["node"], source=SOURCE_HOOK,
                       writers=(writer,),
                       details={"hazard": event["kind"], "shared": event["shared"],
                                "ranks": list(event.get("ranks") or []),
                                "nodes": list(event.get("nodes") or []),
                                "reported_by": event["pid"]})

    def state_reported(self, event: dict) -> None:
        if event["state"] == "disabled":
            self.disabled_logged += 1
            log.warning("job scope disabled; node-scope detection goes on", extra={"fields": {
                "pid": event["pid"], "node": _bounded(event["node"]),
                "training_job": _bounded(event.get("job") or ""),
                "reason": _bounded(event.get("reason") or "?")}})
        else:
            log.info("job scope active", extra={"fields": {
                "pid": event["pid"], "node": _bounded(event["node"]),
                "training_job": _bounded(event.get("job") or "")}})


def _bounded(text) -> str:
    # A sender's words, cut: the log formatter escapes them (monitor.agent.logformat).
    return str(text)[:256]
