"""A small DDP training job (CPU, gloo) used by `ckptwatch demo`, the end-to-end tests and the
benchmarks. Run it under torchrun:

    torchrun --standalone --nproc-per-node 4 -m monitor.cli.demo_job --out DIR --save every-rank

--save every-rank   the bug: every rank calls torch.save on the same path
--save rank0        the fix: only global rank 0 saves
--save local-rank0  the node-local guard: one writer per node (collides across nodes)
--save per-rank     each rank writes its own file (no collision)

Each rank's checkpoint also holds per-rank state (its data-loader position and RNG state), as
real checkpoints do, so colliding writes carry different bytes.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory")
    p.add_argument("--save", default="every-rank",
                   choices=["every-rank", "rank0", "local-rank0", "per-rank"])
    p.add_argument("--steps", type=int, default=3, help="training steps before the save")
    p.add_argument("--saves", type=int, default=1, help="checkpoints to save (one per epoch)")
    p.add_argument("--width", type=int, default=1024,
                   help="hidden width; the model has ~2*width^2 parameters (1024 -> 8 MiB)")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds each rank keeps running after each save (as training goes on)")
    return p.parse_args(argv)


def sampler_indices(rank: int) -> "torch.Tensor":
    """This rank's data-loader position: a different length per rank, as uneven shards give."""
    return torch.arange(rank * 1000, rank * 1000 + 5000 + 997 * rank)


def consistency(state: dict) -> str | None:
    """None if a loaded demo checkpoint is one rank's own, else what is mixed up."""
    rank = state.get("writer_rank")
    if not isinstance(rank, int) or not torch.equal(state.get("sampler_indices"),
                                                    sampler_indices(rank)):
        return (f"the metadata says rank {rank} wrote it, but the data-loader\n    "
                "tensor is another rank's or garbage")
    return None


def save_checkpoint(state: dict, args, rank: int, local_rank: int) -> None:
    if args.save == "per-rank":
        torch.save(state, os.path.join(args.out, f"last-rank{rank}.pt"))
    elif args.save == "rank0":
        if rank == 0:
            torch.save(state, os.path.join(args.out, "last.pt"))
    elif args.save == "local-rank0":
        if local_rank == 0:
            torch.save(state, os.path.join(args.out, "last.pt"))
    else:
        torch.save(state, os.path.join(args.out, "last.pt"))


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(1000 + rank)
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.saves):
        for _ in range(args.steps):
            x = torch.randn(8, args.width)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        # Per-rank state of different sizes, as an uneven data shard gives.
        state = {"epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict(),
                 "rng": torch.get_rng_state(),
                 "sampler_indices": sampler_indices(rank), "writer_rank": rank}
        dist.barrier()
        save_checkpoint(state, args, rank, local_rank)
        dist.barrier()
        if args.pause:
            time.sleep(args.pause)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
