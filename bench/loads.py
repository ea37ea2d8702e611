"""The events of bench/ingest_throughput.py's loads, encoded as a hook sends them. Its own module,
importing nothing of the project but the tree's ckptwatch.events, so bench/loop_instructions.py
can build the same load inside an old checkout."""
from __future__ import annotations

import time

from ckptwatch import events


def make_frames(kind: str, n_events: int, index: int, pid: int, paths: int) -> list[bytes]:
    """n_events encoded frames of `kind` from sender `index` (pid): saves over `paths` paths."""
    frames = []
    now_wall, now_mono = time.time(), time.monotonic()
    per_save = 2 if kind == "pairs" else 1
    for i in range(n_events // per_save):
        path = f"/bench/sender{index}/ckpt{i % paths}.pt"
        # Every writer field, as the hook sends them (ckptwatch/events.py).
        base = {"v": 1, "node": "bench", "pid": pid, "seq": i, "rank": index,
                "local_rank": index, "world_size": 8, "local_world_size": 8, "node_rank": 0,
                "job": "bench", "master": None, "restart": 0, "path": path,
                "site": "bench.py:1", "func": "sender"}
        t = now_mono + i * 1e-6
        end = {**base, "type": "end", "wall": now_wall, "mono": t + 5e-7,
               "start_wall": now_wall, "start_mono": t, "bytes": 4096, "outcome": "ok"}
        if kind == "pairs":
            frames.append(events.encode({**base, "type": "start", "wall": now_wall, "mono": t}))
            frames.append(events.encode(end))
        elif kind == "ends":
            frames.append(events.encode(end))
        elif kind == "dropped":
            frames.append(events.encode({"v": 1, "type": "dropped", "node": "bench", "pid": pid,
                                         "count": 1}))
        elif kind == "hazard":
            frames.append(events.encode({**base, "type": "hazard", "kind": "local_rank_guard",
                                         "shared": "mount:nfs4", "wall": now_wall,
                                         "ranks": [0, 8], "nodes": ["bench", "other"]}))
        else:
            frames.append(events.encode({
                "v": 1, "type": "remote", "node": "bench", "pid": pid, "seq": i, "path": path,
                "wall": now_wall, "wseq": i, "start_wall": now_wall, "end_wall": now_wall,
                "start_mono": t, "end_mono": t + 5e-7, "outcome": "ok", "bytes": 4096,
                "writer": {"node": "other", "pid": 1000 + index, "rank": 8 + index,
                           "job": "bench"}}))
    return frames
