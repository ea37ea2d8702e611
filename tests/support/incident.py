"""A realistic incident journal for the timeline: 4 ranks on 2 nodes, every rank saving one path.

Records are built by the agent's own model (to_record) and written by the real Journal, so they
have the shape the agent writes. `python -m tests.support.incident JOURNAL` writes one (the
README's docs/timeline.png is rendered from it: see docs/decisions.md).
"""
from __future__ import annotations

import sys

from exporters.journal import Journal
from monitor.detect.model import (FINDING_SIZE_FLUCTUATION, Collision, Finding, Write,
                                  Writer)

WALL0 = 1_764_457_487.0          # 2025-11-29 23:04:47 UTC
LAST = "/mnt/shared/llama-7b/run-0412/ckpt/last.pt"
STEP = "/mnt/shared/llama-7b/run-0412/ckpt/step_001000.pt"
OPTIM = "/mnt/shared/llama-7b/run-0412/ckpt/optimizer.pt"
JOB = "llama-7b-0412"
SITE = "/workspace/train.py:212"
SIZE = 3_370_000_000

# (rank, node, pid, local_rank): two nodes, two ranks each.
RANKS = [(0, "gpu-a17", 40211, 0), (1, "gpu-a17", 40212, 1),
         (2, "gpu-b03", 51877, 0), (3, "gpu-b03", 51878, 1)]


def writer(rank: int) -> Writer:
    _, node, pid, local = RANKS[rank]
    return Writer(node=node, pid=pid, rank=rank, local_rank=local, world_size=4,
                  local_world_size=2, node_rank=0 if node == "gpu-a17" else 1, job=JOB,
                  master="gpu-a17:29500", restart=0)


def write(rank: int, path: str, start: float, duration: float, seq: int = 1,
          size: int = SIZE, outcome: str = "ok", site: str = SITE) -> Write:
    return Write(writer=writer(rank), path=path, seq=seq, start_wall=WALL0 + start,
                 start_mono=start, end_wall=WALL0 + start + duration,
                 end_mono=start + duration, bytes=size, outcome=outcome, site=site,
                 func="save_checkpoint")


# Every rank saves last.pt at once (seconds after WALL0, durations): the concurrent collision.
LAST_WRITES = [(0, 0.00, 2.41), (1, 0.12, 2.05), (2, 0.31, 2.62), (3, 0.47, 1.88)]


def incident_items() -> list:
    """The writes, collisions and findings of the incident, in journal order."""
    items: list = []
    # A clean save by rank 0 alone, a minute earlier: what the fix looks like.
    items.append(write(0, OPTIM, -60.0, 1.2, size=6_740_000_000))
    last = [write(r, LAST, s, d, seq=2) for r, s, d in LAST_WRITES]
    items += sorted(last, key=lambda w: w.end_wall)
    items.append(Collision(path=LAST, kind="concurrent", writes=tuple(last),
                           detected_wall=WALL0 + 3.6, id="c7e1a0f4b2d95e38"))
    items.append(Finding(FINDING_SIZE_FLUCTUATION, LAST, JOB, WALL0 + 3.1, "gpu-b03", "hook",
                         ({"pid": 51878, "rank": 3, "node": "gpu-b03", "bytes": SIZE,
                           "site": SITE},
                          {"pid": 51877, "rank": 2, "node": "gpu-b03", "bytes": SIZE - 4096,
                           "site": SITE}),
                         {"v": 1, "rule": "finished sizes differ", "size_before": SIZE,
                          "size_after": SIZE - 4096}))
    items.append({"type": "verification", "path": LAST, "result": "corrupt",
                  "format": "torch-zip", "reason": "record last/data.pkl: the CRC written after "
                  "its data differs from the central directory: torn, parts come from "
                  "different saves", "cause": "torn", "deep": True, "bytes": SIZE - 4096,
                  "seconds": 0.004, "job": JOB, "collision_id": "c7e1a0f4b2d95e38",
                  "wall": WALL0 + 4.2})
    # The local-rank-0 guard: one writer per node, one after the other on shared storage.
    step = [write(0, STEP, 20.0, 2.3, site="/workspace/train.py:230"),
            write(2, STEP, 23.1, 2.5, site="/workspace/train.py:230")]
    items += step
    items.append(Collision(path=STEP, kind="redundant", writes=tuple(step),
                           detected_wall=WALL0 + 30.0, id="5d0b7c21e9a4f613"))
    # A job-scope hazard, as the agent journals it (monitor/agent/jobreports.py).
    items.append({"type": "hazard", "path": LAST, "node": "gpu-a17", "source": "hook",
                  "job": JOB, "wall": WALL0 + 40.0,
                  "writers": [{"node": "gpu-a17", "pid": 40211, "rank": 0, "local_rank": 0,
                               "job": JOB, "seq": 3, "site": "/workspace/train.py:212",
                               "func": "save_checkpoint"}],
                  "hazard": "shared_storage_multi_writer", "shared": "mount:nfs4",
                  "ranks": [0, 1, 2, 3], "nodes": ["gpu-a17", "gpu-b03"],
                  "reported_by": 40211})
    return items


def write_incident_journal(path: str, items: list | None = None) -> list:
    items = incident_items() if items is None else items
    with Journal(str(path)) as journal:
        for item in items:
            journal.write(item)       # a Write, Collision, Finding or a typed dict
    return items


if __name__ == "__main__":
    write_incident_journal(sys.argv[1])
