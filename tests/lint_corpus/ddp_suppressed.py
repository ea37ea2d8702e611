"""Suppressions: a reviewed exception stays quiet, a wrong code does not hide a finding."""
import torch
import torch.distributed as dist


def save_scratch(model, scratch_dir):
    # Node-local scratch disk: one writer per node is what we want here.
    if int(__import__("os").environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(model.state_dict(), f"{scratch_dir}/model.pt")  # ckptwatch: ignore[CKW002]
    torch.save(model.state_dict(), f"{scratch_dir}/tmp.pt")  # ckptwatch: ignore
    torch.save(model.state_dict(), "shared.pt")  # ckptwatch: ignore[CKW002]  # expect: CKW001
    torch.save(model.state_dict(),
               "wrapped.pt")  # ckptwatch: ignore[CKW001]
    dist.barrier()
