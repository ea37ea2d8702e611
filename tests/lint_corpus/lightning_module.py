"""PyTorch Lightning: a LightningModule with its own saves and callbacks that write files."""
import json
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from safetensors.torch import save_file


class LitClassifier(pl.LightningModule):
    def __init__(self, backbone, out_dir):
        super().__init__()
        self.backbone = backbone
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.backbone(x), y)

    def on_validation_epoch_end(self):
        # Runs on every rank: every rank writes the same file.
        torch.save(self.backbone.state_dict(), os.path.join(self.out_dir, "backbone.pt"))  # expect: CKW001
        if self.trainer.is_global_zero:
            torch.save(self.backbone.state_dict(), os.path.join(self.out_dir, "best.pt"))
        if self.global_rank == 0:
            save_file(self.backbone.state_dict(), os.path.join(self.out_dir, "best.safetensors"))
        if self.local_rank == 0:
            save_file(self.backbone.state_dict(), "node_copy.safetensors")  # expect: CKW002
        self._export_head()

    def on_train_end(self):
        if not self.trainer.is_global_zero:
            return
        torch.save(self.backbone.state_dict(), "final.pt")

    @rank_zero_only
    def _export_head(self):
        torch.save(self.backbone.head.state_dict(), "head.pt")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class MetricsWriter(Callback):
    """Callback hooks run on every rank."""

    def on_validation_end(self, trainer, pl_module):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if trainer.is_global_zero:
            with open("metrics.json", "w") as f:
                json.dump(metrics, f)
        with open("metrics_all.json", "w") as f:
            json.dump(metrics, f)  # expect: CKW001

    def on_train_epoch_end(self, trainer, pl_module):
        # Lightning's own checkpointing is collective: every rank must call it.
        trainer.save_checkpoint(f"epoch{trainer.current_epoch}.ckpt")
        if trainer.is_global_zero:
            trainer.save_checkpoint("guarded.ckpt")  # expect: CKW003

    def on_exception(self, trainer, pl_module, exception):
        self._dump(pl_module)

    @rank_zero_only
    def _dump(self, pl_module):
        torch.save(pl_module.state_dict(), "crash.pt")


def main():
    trainer = pl.Trainer(devices=4, strategy="ddp", callbacks=[MetricsWriter()])
    model = LitClassifier(torch.nn.Linear(8, 2), "out")
    trainer.fit(model)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), "after_fit.pt")
    torch.save(model.state_dict(), "after_fit_all.pt")  # expect: CKW001


if __name__ == "__main__":
    main()
