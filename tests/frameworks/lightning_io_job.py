"""Lightning's checkpoint IO called directly, for tests/e2e/test_frameworks.py: one process per
node under torch.distributed.run (Trainer(devices=1, num_nodes=2), CPU, gloo).

    --guard local    `if trainer.local_rank == 0: checkpoint_io.save_checkpoint(...)` -- one
                     writer per node, so on shared storage the nodes collide (the bug);
                     writes local.ckpt
    --guard global   `if trainer.global_rank == 0:` -- correct; writes global.ckpt

Both guards may be given: one job then saves each guard's file in turn (the tests share one
two-node job between the bug and the fix; each asserts on its own path).
"""
import argparse
import os
import warnings

import torch
import lightning as L


class TinyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(256, 256)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--guard", choices=("local", "global"), action="append", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    data = torch.utils.data.TensorDataset(torch.randn(8, 256), torch.randn(8, 256))
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp",
                        max_epochs=1, limit_train_batches=2, enable_progress_bar=False,
                        logger=False, enable_model_summary=False, enable_checkpointing=False)
    module = TinyModule()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    os.makedirs(args.out, exist_ok=True)
    # Several MB, saved a few times: the two nodes' writes overlap even on a loaded machine.
    checkpoint = {"state_dict": module.state_dict(),
                  "extra": [torch.randn(512, 512) for _ in range(8)]}
    for guard in args.guard:
        path = os.path.join(args.out, f"{guard}.ckpt")
        trainer.strategy.barrier()
        rank = trainer.local_rank if guard == "local" else trainer.global_rank
        if rank == 0:
            for _ in range(3):
                trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, path)   # SAVE
        trainer.strategy.barrier()


if __name__ == "__main__":
    main()
