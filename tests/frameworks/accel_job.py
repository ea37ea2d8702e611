"""A tiny accelerate job for tests/e2e/test_frameworks.py. Run under torch.distributed.run (CPU).

    --save state     accelerator.save_state(DIR/state) — correct: accelerate guards its saves
    --save unguarded every process calls torch.save(unwrap_model(model).state_dict(), DIR/model.pt)
                     without `if accelerator.is_main_process` — the classic bug
    --save state-each-node
                     ProjectConfiguration(save_on_each_node=True), then save_state: the local
                     main process of every node saves (meant for node-local storage)
    --save unguarded-safetensors
                     the same bug through safetensors.torch.save_file (which is what
                     transformers' save_pretrained and accelerate's save_model use)
"""
import argparse
import os

import torch
from accelerate import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", choices=("state", "state-each-node", "unguarded",
                                                   "unguarded-safetensors"), required=True)
    args = parser.parse_args()
    from accelerate.utils import ProjectConfiguration
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        save_on_each_node=args.save == "state-each-node"))
    # 16 MB of float32 weights: each save takes tens of ms, so after the barrier the two
    # ranks' writes of one file overlap even on a loaded machine.
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(16, 1024), torch.randn(16, 1024))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    if args.save in ("state", "state-each-node"):
        accelerator.save_state(os.path.join(args.out, "state"))
    elif args.save == "unguarded":
        torch.save(accelerator.unwrap_model(model).state_dict(),
                   os.path.join(args.out, "model.pt"))   # BUG: no is_main_process guard
    else:
        from safetensors.torch import save_file
        save_file(accelerator.unwrap_model(model).state_dict(),
                  os.path.join(args.out, "model.safetensors"))   # BUG: no guard either
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
