"""torch.distributed.checkpoint under torch.distributed.run (CPU, gloo), for
tests/e2e/test_frameworks.py.

    --save no-dist   every rank calls dcp.save(..., no_dist=True) into one directory: each
                     rank writes the same __0_0.distcp and .metadata -- the bug (no_dist is
                     for one process; a user reaches for it when the collective save hangs)
    --save dist      dcp.save across the process group: each rank its own shard, the
                     coordinator the .metadata -- correct
    --save async     dcp.async_save across the process group (thread executor), waited for
                     -- correct
"""
import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter


def rendezvous(folder: str, name: str, count: int) -> None:
    """Mark `name` in `folder`, then wait until `count` marks are there."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, name), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rendezvous {folder}: {len(os.listdir(folder))} of {count}")
        time.sleep(0.001)


class Together:
    """Pickled inside the shard's write (DCP saves a non-tensor value with torch.save into the
    open shard stream): waits there until every rank is inside its shard write. Loads as 0."""

    def __init__(self, folder: str, rank: int, count: int):
        self.folder, self.rank, self.count = folder, rank, count

    def __reduce__(self):
        rendezvous(self.folder, f"rank{self.rank}", self.count)
        return (int, ())


class TogetherFileSystem(FileSystem):
    """DCP's own file system, except that the rename of .metadata.tmp onto .metadata (inside
    FileSystemWriter.finish, the .metadata write) waits until every rank is there."""

    def __init__(self, folder: str, rank: int, count: int):
        super().__init__()
        self.folder, self.rank, self.count, self.renames = folder, rank, count, 0

    def rename(self, path, new_path) -> None:
        self.renames += 1
        rendezvous(os.path.join(self.folder, f"rename{self.renames}"), f"rank{self.rank}",
                   self.count)
        super().rename(path, new_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", choices=("no-dist", "dist", "async"), required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Per-rank values: in a correct DCP save each rank's shard holds its own.
    state = {f"layer{i}": torch.full((256, 256), float(rank)) for i in range(8)}
    path = os.path.join(args.out, "dcp")
    dist.barrier()
    if args.save == "no-dist":
        # Both ranks' writes of each file overlap by construction (a shard holds a Together;
        # the .metadata rename waits for the other rank): left to timing, the two tiny
        # .metadata writes fell apart on a loaded machine (4 busy loops: 1 run in 3), a
        # redundant chain reported only after the 60 s collision window.
        sync = os.path.join(args.out, "sync")     # not a DCP file: plain marks
        world = dist.get_world_size()
        writer = FileSystemWriter(path)
        writer.fs = TogetherFileSystem(sync, rank, world)
        for round_ in range(2):     # repeated, as a training loop would
            together = Together(os.path.join(sync, f"shard{round_}"), rank, world)
            try:
                dcp.save(dict(state, together=together), storage_writer=writer,   # BUG: every
                         no_dist=True)                                              # rank, one set
            except CheckpointException as exc:   # around a FileNotFoundError
                # The ranks race on .metadata.tmp too: one's rename finds the file gone (the
                # same with or without ckptwatch). The job goes on, as a resilient loop would.
                print(f"rank {rank}: dcp.save failed: {type(exc).__name__}", flush=True)
    elif args.save == "dist":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.async_save(state, checkpoint_id=path).result()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
