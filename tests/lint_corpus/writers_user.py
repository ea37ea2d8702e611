"""User-style code around the writers other than torch.save (issue 18): Lightning's checkpoint
IO called directly, torch.distributed.checkpoint with no_dist, safetensors, and the guards
frameworks expose (accelerate's process_index / local_process_index, transformers'
is_world_process_zero and should_save)."""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from safetensors.torch import save_file


def export_lightning(trainer, module, out):
    checkpoint = {"state_dict": module.state_dict()}
    if trainer.local_rank == 0:
        trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, os.path.join(out, "final.ckpt"))  # expect: CKW002
    if trainer.global_rank == 0:
        trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, os.path.join(out, "best.ckpt"))
    if trainer.is_global_zero:
        trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, os.path.join(out, "last.ckpt"))


def save_sharded(state, out):
    # A user whose collective save hung reaches for no_dist: every rank writes the same set.
    dcp.save(state, checkpoint_id=os.path.join(out, "dcp"), no_dist=True)  # expect: CKW001
    if dist.get_rank() == 0:
        dcp.save(state, checkpoint_id=os.path.join(out, "rank0-dcp"), no_dist=True)
    # Each rank its own set: per-rank directories.
    dcp.save(state, checkpoint_id=os.path.join(out, f"dcp-rank{dist.get_rank()}"), no_dist=True)
    dcp.save(state, checkpoint_id=os.path.join(out, "dcp-collective"))   # collective: correct
    dcp.async_save(state, checkpoint_id=os.path.join(out, "dcp-async"))  # collective: correct


def save_weights(accelerator: Accelerator, model, out):
    weights = accelerator.unwrap_model(model).state_dict()
    if accelerator.process_index == 0:
        save_file(weights, os.path.join(out, "model.safetensors"))
    if accelerator.local_process_index == 0:
        save_file(weights, os.path.join(out, "node.safetensors"))  # expect: CKW002
    if accelerator.is_local_main_process:
        save_file(weights, os.path.join(out, "local.safetensors"))  # expect: CKW002
    save_file(weights, os.path.join(out, "every.safetensors"))  # expect: CKW001


def save_from_trainer(trainer, out):
    if trainer.is_world_process_zero():
        torch.save(trainer.state, os.path.join(out, "trainer_state.pt"))
    if trainer.args.should_save:
        save_file(trainer.model.state_dict(), os.path.join(out, "hf.safetensors"))


def save_pretrained_like(model, out, save_on_this_rank):
    if save_on_this_rank:
        save_file(model.state_dict(), os.path.join(out, "pretrained.safetensors"))
