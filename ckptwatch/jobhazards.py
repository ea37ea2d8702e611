"""Job scope's hazard rules: a save that will collide, named before it does. Pure: judges a
write and the path's other writes as the store's log tells them (ckptwatch/jobkeys.py);
ckptwatch/jobscope.py reports what these rules find to the agent as "hazard" events.

Loaded into training processes: standard library only.
"""
from __future__ import annotations

from ckptwatch.events import SCHEMA_VERSION, WRITER_FIELDS
from ckptwatch.sharedfs import names_rank_or_node

HAZARD_LOCAL_RANK_GUARD = "local_rank_guard"
HAZARD_SHARED_MULTI_WRITER = "shared_storage_multi_writer"
MAX_REPORTED = 4096             # (kind, path) pairs remembered; beyond, no more hazards
MAX_LISTED = 64                 # ranks and nodes named in one hazard


def local_rank_guard(mine, path: str, shared, writes) -> bool:
    """The `local_rank == 0` bug: local rank 0 of a node other than the first writes a shared
    path named after neither its rank nor its node, and no other local rank of its node
    writes that path. Every node's local rank 0 does the same, so they overwrite each other.
    Named from the first save, whether or not another node's write is known yet. `mine` and
    `writes` are ckptwatch.jobkeys.LoggedWrite: the path's writes in the store's log (only
    `mine` when the store is out of reach). Where another local rank of the node writes the
    path too, every rank writes: that is not this bug (shared_multi_writer names it)."""
    if not (shared and mine.local_rank == 0 and mine.rank not in (None, 0)
            and not names_rank_or_node(path, mine.rank, mine.node)):
        return False
    return not any(w.node == mine.node and w.local_rank != 0 for w in writes)


def shared_multi_writer(shared, ranks) -> list | None:
    """Two or more ranks of the job write one path on shared storage: their ranks, or None."""
    known = {r for r in ranks if type(r) is int}
    return list(known) if shared and len(known) >= 2 else None


class Reported:
    """Which hazards this process has reported: each (kind, path) once, bounded."""

    def __init__(self):
        self._sent: set = set()

    def first(self, kind: str, path: str) -> bool:
        """True the first time (kind, path) is seen, while the memory is not full."""
        key = (kind, path)
        if key in self._sent or len(self._sent) >= MAX_REPORTED:
            return False
        self._sent.add(key)
        return True


def hazard_event(kind: str, ident: dict, seq: int, path: str, site, func, shared: str,
                 ranks, nodes, wall: float) -> dict:
    """The "hazard" event (ckptwatch/events.py) about our write `seq` of `path`. shared: why
    the path is shared storage -- this node's reason, or another node's ("node-b: mount:nfs4")
    when only that node sees it so (the event needs one: a hazard without it is refused)."""
    event = {"v": SCHEMA_VERSION, "type": "hazard", "kind": kind}
    event.update({name: ident.get(name) for name in WRITER_FIELDS})
    return {**event, "seq": seq, "path": path, "site": site, "func": func,
            "shared": shared, "ranks": sorted(set(ranks))[:MAX_LISTED],
            "nodes": sorted(set(nodes))[:MAX_LISTED], "wall": wall}
