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
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException


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
        for _ in range(3):     # repeated, as a training loop would: the overlap is sure
            try:
                dcp.save(state, checkpoint_id=path, no_dist=True)   # BUG: every rank, one set
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
