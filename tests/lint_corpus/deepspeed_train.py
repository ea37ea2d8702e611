"""DeepSpeed: the engine's save_checkpoint is collective; client extras go through rank 0."""
import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--save_dir", default="ckpt")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse()
    deepspeed.init_distributed()
    net = torch.nn.Linear(16, 16)
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net,
                                                         model_parameters=net.parameters())
    for step in range(100):
        loss = model_engine(torch.randn(4, 16)).sum()
        model_engine.backward(loss)
        model_engine.step()
        if step % 10 == 0:
            # Every rank must call it: each writes its own ZeRO shard.
            model_engine.save_checkpoint(args.save_dir, tag=f"step{step}",
                                         client_state={"step": step})
            if dist.get_rank() == 0:
                torch.save({"step": step, "args": vars(args)},
                           os.path.join(args.save_dir, "client_state.pt"))
            if dist.get_rank() == 0:
                model_engine.save_checkpoint(args.save_dir, tag="rank0")  # expect: CKW003
            if args.local_rank == 0:
                model_engine.save_checkpoint(args.save_dir, tag="local0")  # expect: CKW003
            torch.save(model_engine.optimizer.state_dict(),  # expect: CKW001
                       os.path.join(args.save_dir, "optimizer.pt"))
            torch.save(model_engine.optimizer.state_dict(),
                       os.path.join(args.save_dir, f"zero_pp_rank_{dist.get_rank()}_optim.pt"))
            if int(os.environ["LOCAL_RANK"]) == 0:
                torch.save({"step": step}, os.path.join(args.save_dir, "latest_step.pt"))  # expect: CKW002
    # Distributed checkpoint (DCP) is collective as well.
    dcp.save({"model": net.state_dict()}, checkpoint_id="dcp_ckpt")
    if torch.distributed.get_rank() == 0:
        torch.distributed.checkpoint.save({"model": net.state_dict()}, checkpoint_id="bad")  # expect: CKW003
        torch.save(net.state_dict(), "consolidated.pt")


if __name__ == "__main__":
    main()
