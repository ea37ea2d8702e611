"""Hugging Face accelerate, in the style of the `*_no_trainer.py` examples."""
import json
import os

import torch
from accelerate import Accelerator, PartialState
from safetensors.torch import save_file, save_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

accelerator = Accelerator()
state = PartialState()


def save_all(model, tokenizer, output_dir):
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    # The documented idiom: save_pretrained writes on the main process only.
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    unwrapped.save_pretrained(os.path.join(output_dir, "copy"))  # expect: CKW001
    tokenizer.save_pretrained(output_dir, is_main_process=accelerator.is_local_main_process)  # expect: CKW002


def train(args):
    model = AutoModelForSequenceClassification.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    for epoch in range(args.epochs):
        # accelerator.save writes on the main process only: safe on every rank.
        accelerator.save(accelerator.get_state_dict(model), f"{args.output_dir}/epoch{epoch}.bin")
        accelerator.save_model(model, args.output_dir)
        # save_state is collective (every process saves its part).
        accelerator.save_state(os.path.join(args.output_dir, f"state_{epoch}"))
        if accelerator.is_main_process:
            accelerator.save_state("main_only_state")  # expect: CKW003
            save_file(accelerator.unwrap_model(model).state_dict(), "model.safetensors")
        if accelerator.is_local_main_process:
            save_model(accelerator.unwrap_model(model), "node.safetensors")  # expect: CKW002
        save_file(accelerator.unwrap_model(model).state_dict(), "every.safetensors")  # expect: CKW001
        if state.is_main_process:
            torch.save(optimizer.state_dict(), "optimizer.pt")
        if accelerator.process_index == 0:
            torch.save(optimizer.state_dict(), "optimizer_idx.pt")
        if accelerator.local_process_index == 0:
            torch.save(optimizer.state_dict(), "optimizer_local.pt")  # expect: CKW002
        torch.save(optimizer.state_dict(), f"optimizer_{accelerator.process_index}.pt")
    write_summary(args)
    save_all(model, tokenizer, args.output_dir)
    accelerator.end_training()


def write_summary(args):
    if not accelerator.is_main_process:
        return
    with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
        json.dump({"epochs": args.epochs}, f)


@accelerator.on_main_process
def push_card(output_dir):
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        json.dump({"card": True}, f)


def is_main_process():
    return accelerator.is_main_process


def export(model):
    if is_main_process():
        torch.save(model.state_dict(), "export.pt")
