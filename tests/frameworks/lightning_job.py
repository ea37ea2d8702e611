"""A tiny Lightning job for tests/e2e/test_frameworks.py: Trainer(accelerator="cpu", devices=2,
strategy="ddp"), launched as a plain `python lightning_job.py --out DIR` (Lightning starts
its own second process), with ModelCheckpoint saving every 2 steps plus last.ckpt.

--probe: each rank also torch.saves a small file of its own (probe-rank{N}.pt) at the end of
training, to show that every process Lightning started runs with the hook and knows its rank;
and, before trainer.fit, the launching process saves its own config.pt (user code often saves a
config or an initial snapshot before training starts).
"""
import argparse
import os

import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class TinyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Probe(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        torch.save({"rank": trainer.global_rank},
                   os.path.join(self.out, f"probe-rank{trainer.global_rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_last=True,
                                 every_n_train_steps=2, save_top_k=-1)]
    if args.probe:
        callbacks.append(Probe(args.out))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                        limit_train_batches=4, enable_progress_bar=False, logger=False,
                        enable_model_summary=False, callbacks=callbacks)
    module = TinyModule()
    if args.probe and not os.environ.get("LOCAL_RANK"):
        # Only the process the user started: Lightning re-executes this script for rank 1
        # with LOCAL_RANK set.
        torch.save({"hidden": 16}, os.path.join(args.out, "config.pt"))
    trainer.fit(module, loader)


if __name__ == "__main__":
    main()
