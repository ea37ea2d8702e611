"""One rank of a simulated multi-node job, for job-scope tests: installs ckptwatch (job scope
starts from the environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_WORLD_SIZE),
prints "ready" once job scope is active, saves PATH when it reads a line on stdin, prints
"saved" and returns -- a normal exit, through atexit (the exit path under test).

usage: python jobrank.py PATH"""
from __future__ import annotations

import sys
import time

import torch

import ckptwatch

ckptwatch.install()
from ckptwatch import jobscope  # noqa: E402  (after install: job scope started by it)

deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    scope = jobscope.instance()
    if scope is not None and scope.state != "connecting":
        break
    time.sleep(0.02)
print("ready", getattr(jobscope.instance(), "state", None), flush=True)
sys.stdin.readline()
torch.save({"w": torch.zeros(64)}, sys.argv[1])
print("saved", flush=True)
