"""Which fix `ckptwatch report` (table and timeline) suggests for a collision, from who wrote
the path and from where. The texts themselves are ckptwatch/advice.py's, the one place the
warn policy's warning, lint and report all take them from.
"""
from __future__ import annotations

from ckptwatch.advice import (FIX, GUARD_FIX, GUARD_FIX_SITES, JOBS_FIX, LOCAL_RANK_NOTE,
                              OWN_PATH_FIX, PROCESS_FIX)
from monitor.detect.model import Collision

__all__ = ["FIX", "GUARD_FIX", "OWN_PATH_FIX", "suggest_fix"]


def suggest_fix(c: Collision) -> str:
    """What to change in the training code, from who wrote and from where."""
    writers = c.writers
    jobs = {w.job for w in writers}
    runs = {w.run_key for w in writers}
    if len(jobs) > 1 or (None not in runs and len(runs) > 1):
        return JOBS_FIX
    if any(w.rank is None for w in writers):
        return PROCESS_FIX
    sites = {w.site for w in c.writes}
    nodes = {w.node for w in writers}
    node_local = len(nodes) > 1 or (len(writers) > 1
                                    and all(w.local_rank == 0 for w in writers))
    guard = GUARD_FIX_SITES if len(sites) > 1 else GUARD_FIX
    if node_local:
        guard += " -- " + LOCAL_RANK_NOTE
    return f"{guard}; or {OWN_PATH_FIX}"
