"""Job scope's hazard rules: a save that will collide, named before it does. Pure: judges a
write's record (ckptwatch/jobkeys.py, slot_record) and what the store said about its path;
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


def local_rank_guard(rec: dict, path: str) -> bool:
    """The `local_rank == 0` bug, from the first save: local rank 0 of a node other than
    the first writes a shared path named after neither its rank nor its node. Needs no
    store: every node's local rank 0 does the same, so they overwrite each other."""
    rank, local_rank = rec.get("rank"), rec.get("local_rank")
    return bool(rec["shared"] and local_rank == 0 and rank not in (None, 0)
                and not names_rank_or_node(path, rank, rec["node"]))


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


def hazard_event(kind: str, rec: dict, seq: int, path: str, ident: dict, ranks: list,
                 nodes: list, wall: float) -> dict:
    """The "hazard" event (ckptwatch/events.py) about our write `rec` of `path`."""
    event = {"v": SCHEMA_VERSION, "type": "hazard", "kind": kind}
    event.update({name: rec.get(name) for name in WRITER_FIELDS})
    event.update({"job": ident.get("job"), "master": ident.get("master"),
                  "restart": ident.get("restart")})
    return {**event, "seq": seq, "path": path, "site": rec["site"], "func": rec["func"],
            "shared": rec["shared"], "ranks": sorted(set(ranks))[:MAX_LISTED],
            "nodes": sorted(set(nodes))[:MAX_LISTED], "wall": wall}
