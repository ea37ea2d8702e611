"""The ground-truth checker over many seeds (tests/support/groundtruth): precision and recall of
every agent, per kind (concurrent, redundant), on node-local paths and on shared storage,
quiet and under CPU load (busy processes at twice the core count).

    python bench/groundtruth.py [--seeds 0-9] [--load quiet|loaded|both] [--rounds 12]
                                [--nodes 2] [--ranks 2] [--shared 0.5] [--show N]

Each seed is one trial: a fresh store, one agent per simulated node, the writers, `--rounds`
rounds of make_schedule(seed). Prints, per load: the trials, their mismatches (the first
--show of each trial), and a table of precision / recall per agent, kind and storage. Exit 1
when any trial had a mismatch.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

from groundtruth.compare import Score  # noqa: E402
from groundtruth.expect import KINDS, TOLERANCE  # noqa: E402
from groundtruth.load import cpu_load  # noqa: E402
from groundtruth.schedule import Profile, make_schedule  # noqa: E402
from groundtruth.trial import run_trial  # noqa: E402
from helpers import remove_tree, short_tmpdir  # noqa: E402


def seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run_batch(args, profile: Profile, loaded: bool) -> tuple[dict, int]:
    totals: dict = {}
    failed = 0
    with (cpu_load(2) if loaded else contextlib.nullcontext(0)) as busy:
        print(f"\n== {'loaded' if loaded else 'quiet'}: {busy} busy processes, "
              f"load {os.getloadavg()[0]:.1f} at start", flush=True)
        for seed in seeds(args.seeds):
            workdir = short_tmpdir("cwgb")
            try:
                result = run_trial(make_schedule(seed, profile), workdir)
            finally:
                remove_tree(workdir)
            v = result.verdict
            failed += bool(v.mismatches)
            saves = len(result.truth)
            print(f"seed {seed}: {saves} saves, {len(v.mismatches)} mismatches, "
                  f"{result.seconds:.0f}s, load {os.getloadavg()[0]:.1f}", flush=True)
            for text in v.mismatches[:args.show]:
                print("   ", text)
            for key, score in v.scores_by_storage.items():
                totals.setdefault(key, Score()).add(score)
    return totals, failed


def table(totals: dict) -> None:
    print(f"{'agent':8} {'kind':11} {'storage':7} {'tp':>4} {'fn':>4} {'fp':>4} "
          f"{'precision':>9} {'recall':>7}")
    for (node, kind, storage), s in sorted(totals.items()):
        print(f"{node:8} {kind:11} {storage:7} {s.tp:4} {s.fn:4} {s.fp:4} "
              f"{s.precision:9.3f} {s.recall:7.3f}")
    for kind in KINDS:
        s = Score()
        for (_, k, _), score in totals.items():
            if k == kind:
                s.add(score)
        print(f"{'all':8} {kind:11} {'both':7} {s.tp:4} {s.fn:4} {s.fp:4} "
              f"{s.precision:9.3f} {s.recall:7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 1,4,7-9")
    parser.add_argument("--load", choices=("quiet", "loaded", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node")
    parser.add_argument("--shared", type=float, default=0.5,
                        help="share of rounds on shared storage (0: node-local paths only)")
    parser.add_argument("--show", type=int, default=5, help="mismatches shown per trial")
    args = parser.parse_args()
    # SIGTERM (a `kill`, a timeout) unwinds like Ctrl-C: the busy processes and the agents
    # are stopped by their context managers instead of being left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    profile = Profile(nodes=tuple(f"node-{chr(97 + i)}" for i in range(args.nodes)),
                      local_world=args.ranks, rounds=args.rounds, p_shared=args.shared)
    print(f"bench/groundtruth.py: seeds {args.seeds}, {args.rounds} rounds, {args.nodes} "
          f"node(s) x {args.ranks} ranks, shared {args.shared}, window {profile.window}s, "
          f"tolerance {TOLERANCE * 1000:.0f} ms; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    failed = 0
    began = time.monotonic()
    for loaded in {"quiet": (False,), "loaded": (True,), "both": (False, True)}[args.load]:
        totals, bad = run_batch(args, profile, loaded)
        failed += bad
        print(f"-- {'loaded' if loaded else 'quiet'}: {bad} trial(s) with mismatches")
        table(totals)
    print(f"\n{time.monotonic() - began:.0f}s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
