"""The resume guard's cost to a load (ckptwatch/resumeguard.py), side by side in one run.

    python bench/resume_guard.py [--rounds-small 200] [--rounds-large 10] [--dir DIR]

In one process, torch.load of a small (4 KiB) and a large (64 MiB) checkpoint, in rounds that
run every case once each, in an order that rotates every round:

  plain          the original torch.load (no guard)
  stored ok      guarded; the file carries a verdict (the user.ckptwatch.verdict xattr) about
                 its current version: one stat and one getxattr, no agent asked
  agent          guarded; no stored verdict, so the real agent (python agent.py, its own
                 process) is asked: connect, one query frame, its answer
  no agent       guarded; no stored verdict and no agent listening (the socket is absent)
  silent agent   guarded; no stored verdict, and a socket that accepts but never answers:
                 the load waits the whole bound (CKPTWATCH_LOAD_WAIT_MS, default 5 ms)

Every timed load follows an untimed plain load of another copy of the file, and the order of
the cases is shuffled each round (fixed seed), so that no case inherits the idle CPU another
case's wait left behind.

Reported: the median load time per case and its ratio to plain, and the median time the guard
itself took (resumeguard.judge() alone, same rounds). State the machine's load (uptime) with
the figures: ratios move with it.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CASES = ("plain", "stored ok", "agent", "no agent", "silent agent")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds-small", type=int, default=200)
    p.add_argument("--rounds-large", type=int, default=10)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)

    import torch

    from bench.common import Agent
    from ckptwatch import resumeguard, verdicts

    top = args.dir or tempfile.mkdtemp(prefix="cw-bench-guard-")
    os.makedirs(top, exist_ok=True)
    agent = Agent()
    silent_dir = tempfile.mkdtemp(prefix="cwsil")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(os.path.join(silent_dir, "agent.sock"))
    silent.listen(4096)
    sockets = {"agent": agent.socket, "no agent": os.path.join(top, "absent.sock"),
               "silent agent": os.path.join(silent_dir, "agent.sock")}
    try:
        print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
        print(f"bound: {resumeguard.DEFAULT_WAIT * 1000:.0f} ms; torch {torch.__version__}")
        plain_load = torch.load
        resumeguard.install(strict=False)
        guarded_load = torch.load
        assert guarded_load is not plain_load
        for label, rows, rounds in (("4 KiB", 1, args.rounds_small),
                                    ("64 MiB", 16384, args.rounds_large)):
            files = {}
            for case in CASES:
                path = os.path.join(top, f"{case.replace(' ', '-')}-{rows}.pt")
                torch.save({"w": torch.zeros(rows, 1024)}, path)     # rows x 4 KiB
                files[case] = path
            tagged = files["stored ok"]
            os.setxattr(tagged, verdicts.XATTR, verdicts.encode(verdicts.FileVerdict(
                verdicts.OK, identity=verdicts.identity_of(os.stat(tagged)))))
            size = os.path.getsize(files["plain"])
            loads = {c: [] for c in CASES}
            judged = {c: [] for c in CASES if c != "plain"}
            shuffle = random.Random(21).shuffle
            warm = os.path.join(top, f"warm-{rows}.pt")
            shutil.copyfile(files["plain"], warm)
            for r in range(rounds):
                order = list(CASES)
                shuffle(order)
                for case in order:
                    # Untimed, before every timed load: no case inherits the idle CPU (and
                    # cold caches) that another case's wait for the agent leaves behind.
                    plain_load(warm, weights_only=True)
                    if case in sockets:
                        os.environ["CKPTWATCH_SOCKET"] = sockets[case]
                    else:
                        os.environ.pop("CKPTWATCH_SOCKET", None)
                    load = plain_load if case == "plain" else guarded_load
                    started = time.perf_counter()
                    load(files[case], weights_only=True)
                    loads[case].append(time.perf_counter() - started)
                    if case != "plain":
                        started = time.perf_counter()
                        resumeguard.judge(files[case])
                        judged[case].append(time.perf_counter() - started)
            base = statistics.median(loads["plain"])
            print(f"\n{label} checkpoint ({size} bytes), {rounds} rounds, medians:")
            print(f"  {'case':<14} {'load':>10} {'ratio':>7} {'guard alone':>12} {'p90':>10}")
            for case in CASES:
                med = statistics.median(loads[case])
                alone = p90 = ""
                if case in judged:
                    alone = f"{statistics.median(judged[case]) * 1e3:9.3f} ms"
                    p90 = f"{sorted(judged[case])[int(len(judged[case]) * 0.9)] * 1e3:7.3f} ms"
                print(f"  {case:<14} {med * 1e3:7.3f} ms {med / base:6.2f}x {alone:>12} "
                      f"{p90:>10}")
        print(f"\nguard stats: {resumeguard.stats()}")
    finally:
        resumeguard.uninstall()
        silent.close()
        shutil.rmtree(silent_dir, ignore_errors=True)
        agent.stop()
        if not args.dir:
            shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
