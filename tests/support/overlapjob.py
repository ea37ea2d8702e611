"""monitor.cli.demo_job with the writers of its save overlapping by construction, not by timing
luck: each writer's state dict holds a Together, which the pickler reaches inside torch.save
(after the hook's start, before the file is complete) and which waits there until OVERLAP_WRITERS
writers have reached it. Tests that must see a concurrent collision run this instead of
`-m monitor.cli.demo_job` (same arguments): with 8 MiB saves after a barrier, a rank descheduled
on a loaded machine could start after the other's save had ended, making a redundant chain,
reported only after the collision window (60 s), instead of a concurrent collision.

    OVERLAP_DIR=<empty dir shared by the writers> OVERLAP_WRITERS=<n> \
        torchrun ... tests/support/overlapjob.py --out DIR --save every-rank

One save per run (--saves 1): the marks are not reset between saves.
"""
from __future__ import annotations

import os
import sys
import time

from monitor.cli import demo_job

FOLDER = os.environ["OVERLAP_DIR"]
WRITERS = int(os.environ["OVERLAP_WRITERS"])
TIMEOUT = 120.0


class Together:
    """Pickled inside torch.save: marks this writer as inside its save, then waits until every
    writer is. Unpickles as 0."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        open(os.path.join(FOLDER, self.name), "w").close()
        deadline = time.monotonic() + TIMEOUT
        while len(os.listdir(FOLDER)) < WRITERS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"overlapjob: {len(os.listdir(FOLDER))} of {WRITERS} "
                                   f"writers inside their save after {TIMEOUT} s")
            time.sleep(0.001)
        return (int, ())


_save = demo_job.save_checkpoint


def save_checkpoint(state: dict, args, rank: int, local_rank: int) -> None:
    _save(dict(state, together=Together(f"rank{rank}")), args, rank, local_rank)


demo_job.save_checkpoint = save_checkpoint

if __name__ == "__main__":
    raise SystemExit(demo_job.main(sys.argv[1:]))
