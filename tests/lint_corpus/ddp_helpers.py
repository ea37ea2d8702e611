"""DDP helpers: which helper is guarded depends on every call site in the module."""
import json
import os

import numpy as np
import torch
import torch.distributed as dist


def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def is_main():
    return get_rank() == 0


def atomic_save(obj, path):
    # Called only under a guard below, so it runs on rank 0 only.
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_metrics(metrics, path):
    # Called once under a guard and once without: unsafe.
    with open(path, "w") as f:
        json.dump(metrics, f)  # expect: CKW001


def save_embeddings(emb):
    np.save("emb.npy", emb)  # expect: CKW001


def save_on_node(obj):
    torch.save(obj, "node.pt")  # expect: CKW002


def inner_chain(obj):
    torch.save(obj, "chain.pt")


def outer_chain(obj):
    inner_chain(obj)


class Checkpointer:
    def __init__(self, rank, out):
        self.rank = rank
        self.out = out
        self.is_master = rank == 0

    def save(self, model):
        if self.is_master:
            torch.save(model.state_dict(), os.path.join(self.out, "model.pt"))
        if self.rank == 0:
            self._write_meta()
        self._write_shard(model)

    def _write_meta(self):
        with open(os.path.join(self.out, "meta.json"), "w") as f:
            json.dump({"rank": 0}, f)

    def _write_shard(self, model):
        torch.save(model.state_dict(), os.path.join(self.out, f"shard-{self.rank}.pt"))


def train(model, step, local_rank):
    rank = get_rank()
    if rank == 0:
        atomic_save(model.state_dict(), "model.pt")
        save_metrics({"step": step}, "metrics.json")
        outer_chain(model)
    if is_main():
        atomic_save(model.state_dict(), "model_b.pt")
    save_metrics({"step": step}, "metrics_all.json")
    save_embeddings(model.emb)
    if local_rank == 0:
        save_on_node(model)
    Checkpointer(rank, "out").save(model)
    assert rank == 0, "only the main process finalizes"
    torch.save(model, "finalized.pt")
