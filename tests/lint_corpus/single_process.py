"""A single-process script: no torch.distributed, no launcher, no rank anywhere. Nothing to flag."""
import json
import pickle

import numpy as np
import torch


def main():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        opt.step()
        torch.save(model.state_dict(), f"epoch{epoch}.pt")
    np.save("weights.npy", model.weight.detach().numpy())
    with open("meta.json", "w") as f:
        json.dump({"epochs": 3}, f)
    with open("opt.pkl", "wb") as f:
        pickle.dump(opt.state_dict(), f)


if __name__ == "__main__":
    main()
