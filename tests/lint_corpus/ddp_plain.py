"""Plain DDP under torchrun, in the style of nanoGPT and the PyTorch examples."""
import json
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    master_process = ddp_rank == 0
else:
    ddp_rank = 0
    master_process = True

out_dir = "out"


def save_state(model, optimizer, step, path):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, path)


def log_metrics(metrics):
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f)


def dump_vocab(vocab):
    with open("vocab.pkl", "wb") as f:
        pickle.dump(vocab, f)  # expect: CKW001


def train(args, model, optimizer, loader):
    rank = dist.get_rank()
    model = DDP(model)
    for step, batch in enumerate(loader):
        loss = model(batch).mean()
        loss.backward()
        optimizer.step()

        torch.save(model.state_dict(), "last.pt")  # expect: CKW001

        if master_process:
            save_state(model, optimizer, step, os.path.join(out_dir, "ckpt.pt"))
            log_metrics({"step": step, "loss": loss.item()})

        if rank == 0 and step % args.save_every == 0:
            torch.save(model.module.state_dict(), f"{out_dir}/step{step}.pt")

        if rank == 0 or args.force_save:
            torch.save(model.module.state_dict(), f"{out_dir}/forced.pt")  # expect: CKW001

        if args.rank == 0:
            np.save(os.path.join(out_dir, "embeddings.npy"), model.module.emb.weight.numpy())

        if args.local_rank == 0:
            torch.save(model.module.state_dict(), "per_node_guard.pt")  # expect: CKW002

        if args.local_rank in (-1, 0):
            torch.save(optimizer.state_dict(), "optim.pt")  # expect: CKW002

        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            np.save("stats.npy", np.zeros(3))  # expect: CKW002

        if rank != 0:
            pass
        else:
            torch.save(model.module.state_dict(), "else_branch.pt")

        if dist.get_rank() != 0:
            torch.save(model.module.state_dict(), "others.pt")  # expect: CKW001

        # Per-rank files: every rank writes its own path.
        torch.save(optimizer.state_dict(), f"{out_dir}/optim_rank{rank}.pt")
        torch.save(optimizer.state_dict(), os.path.join(out_dir, "shard_" + str(dist.get_rank()) + ".pt"))
        torch.save(optimizer.state_dict(), "{}/rng_{}.pt".format(out_dir, ddp_rank))
        rng_path = "rng_state_{rank}.pt".format(rank=rank)
        torch.save(torch.get_rng_state(), rng_path)
        torch.save(loader.state_dict(), f"{out_dir}/loader_rank_{step % 8}.pt")
        # local rank alone is unique per node only.
        torch.save(loader.state_dict(), f"{out_dir}/loader_{ddp_local_rank}.pt")  # expect: CKW002
        torch.save(loader.state_dict(), f"{out_dir}/n{args.node_rank}_l{ddp_local_rank}.pt")

    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "final.pt")
    if torch.distributed.get_rank() == 0:
        torch.save(model.module.state_dict(), "final2.pt")
    if dist.get_world_size() == 1:
        torch.save(model.module.state_dict(), "single.pt")
    if args.node_rank == 0:
        torch.save(model.module.state_dict(), "node0.pt")  # expect: CKW001


def finish(model, rank):
    if rank != 0:
        return
    torch.save(model.state_dict(), "finished.pt")
    with open("done.json", "w") as f:
        json.dump({"ok": True}, f)


def finish_or_exit(model):
    if dist.get_rank() > 0:
        sys.exit(0)
    torch.save(model.state_dict(), "exit_guarded.pt")


def read_back():
    with open("done.json") as f:
        return json.load(f)


if __name__ == "__main__":
    dump_vocab({"a": 1})
