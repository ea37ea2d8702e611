"""What to change in the training code after a collision: the fix `ckptwatch report` prints
(table and timeline), from who wrote the path and from where.
"""
from __future__ import annotations

from monitor.detect.model import Collision

GUARD_FIX = ("guard this call site with a global-rank-0 check "
             "(torch.distributed.get_rank() == 0)")
LOCAL_RANK_NOTE = ("note LOCAL_RANK == 0 is one writer per node, still colliding on shared "
                   "storage")
OWN_PATH_FIX = "give each rank its own path"


def suggest_fix(c: Collision) -> str:
    """What to change in the training code, from who wrote and from where."""
    writers = c.writers
    jobs = {w.job for w in writers}
    runs = {w.run_key for w in writers}
    if len(jobs) > 1 or (None not in runs and len(runs) > 1):
        return ("different jobs (or restarts) write this path: give each job its own output "
                "directory")
    if any(w.rank is None for w in writers):
        return "make only one process write this path, or give each process its own path"
    sites = {w.site for w in c.writes}
    nodes = {w.node for w in writers}
    node_local = len(nodes) > 1 or (len(writers) > 1
                                    and all(w.local_rank == 0 for w in writers))
    if len(sites) > 1:
        guard = GUARD_FIX.replace("this call site", "each of these call sites")
    else:
        guard = GUARD_FIX
    if node_local:
        guard += " -- " + LOCAL_RANK_NOTE
    return f"{guard}; or {OWN_PATH_FIX}"

