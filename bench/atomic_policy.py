"""CKPTWATCH_POLICY=atomic: what it prevents, and what it costs.

    python bench/atomic_policy.py [--runs 20] [--width 1024] [--rounds-small 400]
                                  [--rounds-large 8] [--dir DIR] [--skip-race] [--skip-cost]

Race: `--runs` times per policy (observe, atomic), a real 4-rank torchrun job (gloo, CPU,
monitor.cli.demo_job --save every-rank: every rank saves its own state to one path at once)
under `ckptwatch run`, without an agent (the hook's events go nowhere; the policy alone acts).
Each resulting last.pt is loaded with torch.load and checked with demo_job.consistency():
"torn" = does not load, "mixed" = loads but is not exactly one rank's state. Target: 0 of
`--runs` with atomic.

Cost: in one process, plain torch.save and the atomic save (ckptwatch.atomic.save around the
same torch.save) of a 4 KiB and a 64 MiB state dict into `--dir` (default: a directory under
/tmp; fsync is only meaningful on a real disk, not tmpfs), each round every kind once, in an
order rotated every round: the default (temporary file + rename), the durable mode
(CKPTWATCH_ATOMIC_DURABLE=1: file fsync, rename, directory fsync) and the durable mode
without the directory fsync (CKPTWATCH_ATOMIC_DIR_FSYNC=0). Reported: medians, the ratio of
medians to plain, and the median of per-round ratios. Target (issue 22): the default <= 1.3x
at 4 KiB; the durable mode is a documented choice with its own cost.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def race(policy: str, runs: int, width: int, top: str) -> dict:
    import torch
    from monitor.cli.demo_job import consistency

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update({"CKPTWATCH_POLICY": policy, "OMP_NUM_THREADS": "1",
                "CKPTWATCH_SOCKET": os.path.join(top, "no-agent.sock"),
                "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", "")})
    counts = {"runs": 0, "torn": 0, "mixed": 0, "whole": 0, "leftovers": 0}
    for run in range(runs):
        out = os.path.join(top, f"{policy}-{run}")
        cmd = [sys.executable, "-m", "monitor.cli", "run", "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "-m", "monitor.cli.demo_job", "--out", out,
               "--save", "every-rank", "--steps", "1", "--width", str(width)]
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            sys.exit(f"run failed:\n{done.stderr[-3000:]}")
        counts["runs"] += 1
        counts["leftovers"] += len([n for n in os.listdir(out) if n != "last.pt"])
        try:
            state = torch.load(os.path.join(out, "last.pt"), weights_only=False)
        except Exception:
            counts["torn"] += 1
            continue
        counts["mixed" if consistency(state) is not None else "whole"] += 1
        shutil.rmtree(out, ignore_errors=True)
    return counts


def cost(directory: str, rounds_small: int, rounds_large: int) -> list[tuple]:
    import torch
    from ckptwatch import atomic

    def atomic_with(settings: dict):
        def save(obj, path):
            atomic.configure(settings)
            atomic.save(torch.save, (obj, path), {})
        return save

    savers = {"plain": torch.save, "atomic": atomic_with({}),
              "atomic, durable": atomic_with({atomic.DURABLE_ENV: "1"}),
              "atomic, durable no dir": atomic_with({atomic.DURABLE_ENV: "1",
                                                     atomic.DIR_FSYNC_ENV: "0"})}
    rows = []
    for label, state, rounds in (
            ("4 KiB", {"w": torch.zeros(1024)}, rounds_small),
            ("64 MiB", {"w": torch.zeros(16 * 1024 * 1024)}, rounds_large)):
        times = {name: [] for name in savers}
        names = list(savers)
        for i in range(rounds):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                path = os.path.join(directory, f"{name.replace(',', '').replace(' ', '-')}.pt")
                t0 = time.perf_counter()
                savers[name](state, path)
                times[name].append(time.perf_counter() - t0)
        plain = statistics.median(times["plain"])
        for name in names:
            median = statistics.median(times[name])
            per_round = statistics.median(t / p for t, p in zip(times[name], times["plain"]))
            rows.append((label, name, median, median / plain, per_round))
    atomic.configure()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--width", type=int, default=1024, help="demo_job width (1024: 8 MiB)")
    p.add_argument("--rounds-small", type=int, default=400)
    p.add_argument("--rounds-large", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the cost rounds save (default /tmp)")
    p.add_argument("--skip-race", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    args = p.parse_args(argv)
    top = tempfile.mkdtemp(prefix="cw-atomic-", dir=args.dir)
    try:
        if not args.skip_race:
            print(f"4-rank race, --save every-rank, width {args.width}, {args.runs} runs each")
            print(f"{'policy':8} {'torn':>5} {'mixed':>6} {'whole':>6} {'left-over files':>16}")
            for policy in ("observe", "atomic"):
                c = race(policy, args.runs, args.width, top)
                print(f"{policy:8} {c['torn']:>5} {c['mixed']:>6} {c['whole']:>6} "
                      f"{c['leftovers']:>16}", flush=True)
        if not args.skip_cost:
            print(f"\nsave cost in {top} (medians; load {os.getloadavg()[0]:.1f})")
            print(f"{'size':7} {'save':24} {'median':>10} {'x plain':>8} {'per round':>10}")
            for label, name, median, ratio, per_round in cost(top, args.rounds_small,
                                                              args.rounds_large):
                print(f"{label:7} {name:24} {median * 1e3:>8.3f}ms {ratio:>8.2f} "
                      f"{per_round:>10.2f}", flush=True)
            print(f"load after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
