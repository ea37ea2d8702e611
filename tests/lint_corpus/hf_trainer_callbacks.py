"""transformers Trainer with callbacks that write their own files."""
import json
import os
import pickle

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


class EMACallback(TrainerCallback):
    """Keeps an EMA of the weights and saves it next to each checkpoint."""

    def __init__(self):
        self.ema = None

    def on_save(self, args, state, control, model=None, **kwargs):
        ckpt_dir = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        # on_save runs on every process.
        torch.save(self.ema, os.path.join(ckpt_dir, "ema.pt"))  # expect: CKW001
        if state.is_world_process_zero:
            torch.save(self.ema, os.path.join(ckpt_dir, "ema_main.pt"))
        if args.should_save:
            torch.save(self.ema, os.path.join(ckpt_dir, "ema_should_save.pt"))
        if state.is_local_process_zero:
            torch.save(self.ema, os.path.join(ckpt_dir, "ema_local.pt"))  # expect: CKW002

    def on_step_end(self, args, state, control, **kwargs):
        # control.should_save says "save at this step" - it is true on every rank.
        if control.should_save:
            torch.save(self.ema, "ema_step.pt")  # expect: CKW001
        if control.should_save and state.is_world_process_zero:
            torch.save(self.ema, "ema_step_main.pt")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if args.local_rank in [-1, 0]:
            with open(os.path.join(args.output_dir, "log.jsonl"), "a") as f:  # append on each node
                json.dump(logs, f)  # expect: CKW002
        if args.process_index == 0:
            with open(os.path.join(args.output_dir, "log_main.jsonl"), "a") as f:
                json.dump(logs, f)


class HistoryCallback(TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, "history.pkl"), "wb") as f:
            pickle.dump(state.log_history, f)  # expect: CKW001


def main(model, train_ds, eval_ds, tokenizer):
    args = TrainingArguments(output_dir="out", save_steps=500, per_device_train_batch_size=8)
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      callbacks=[EMACallback(), HistoryCallback()])
    trainer.train()
    # Trainer.save_model decides per process itself.
    trainer.save_model("out/final")
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained("out/final")
        with open("out/final/extra.json", "w") as f:
            json.dump({"done": True}, f)
    tokenizer.save_pretrained("out/final_tok")  # expect: CKW001
    if args.should_save:
        torch.save(trainer.state.log_history, "out/history.pt")
    if args.local_rank <= 0:
        torch.save(trainer.state.log_history, "out/history_local.pt")  # expect: CKW002
