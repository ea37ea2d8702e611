"""A torchrun program for tests/e2e/test_multihost.py: the save patterns of a multi-node job in
turn, each on its own path under --out, every rank logging the true interval of each of its
saves (--truth DIR: one JSON line per save, wall clock; the test hosts share one clock).

    local-rank0  guard/last.pt        if local_rank == 0: one writer per node (the bug across
                                      nodes on shared storage)
    every-rank   every/last.pt        every rank (the bug)
    rank0        rank0/last.pt        if rank == 0 (correct)
    per-rank     per-rank/rank{r}.pt  each rank its own file (correct)

Every save starts right after a barrier, so the writers of one path save at the same time;
its state holds the writer's rank, so colliding writes carry different bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

PATTERNS = ("local-rank0", "every-rank", "rank0", "per-rank")


def target(pattern: str, out: str, rank: int, local_rank: int) -> str | None:
    """The path this rank saves for `pattern`, or None when it does not save."""
    if pattern == "local-rank0":
        return os.path.join(out, "guard", "last.pt") if local_rank == 0 else None
    if pattern == "every-rank":
        return os.path.join(out, "every", "last.pt")
    if pattern == "rank0":
        return os.path.join(out, "rank0", "last.pt") if rank == 0 else None
    return os.path.join(out, "per-rank", f"rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="checkpoint directory (shared storage)")
    parser.add_argument("--truth", required=True, help="directory for the true intervals")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--width", type=int, default=1024, help="8 * width^2 bytes per save")
    parser.add_argument("--exit-after-save", action="store_true",
                        help="after the last save, exit at once (no barrier, no teardown), "
                             "as a job whose last act is its checkpoint")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    gen = torch.Generator().manual_seed(rank)
    state = {"rank": rank, "a": torch.rand(args.width, args.width, generator=gen),
             "b": torch.rand(args.width, args.width, generator=gen)}
    log = os.path.join(args.truth, f"rank{rank}.jsonl")
    patterns = args.patterns.split(",")
    for n, pattern in enumerate(patterns, start=1):
        path = target(pattern, args.out, rank, local_rank)
        if rank == 0:
            for p in PATTERNS:
                os.makedirs(os.path.dirname(target(p, args.out, 0, 0)), exist_ok=True)
        dist.barrier()
        if path is not None:
            start = time.time()
            torch.save(state, path)
            end = time.time()
            with open(log, "a") as f:
                f.write(json.dumps({"pattern": pattern, "path": path, "rank": rank,
                                    "node": socket.gethostname(), "start": start,
                                    "end": end}) + "\n")
        if n == len(patterns) and args.exit_after_save:
            return          # the interpreter exits normally (atexit runs), nothing waits
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
