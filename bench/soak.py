"""The combined hostile soak of issue 8 (tests/support/soak.py), with its figures printed: a real
agent under a 1,000,000-frame flood carrying 200,000 distinct label values, 1,024 connections
held from one process, a memo-bomb checkpoint in its watched directory and repeated scrapes,
while real collisions are timed from the second end to the journal.

    python bench/soak.py [--frames 1000000] [--values 200000]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

import soak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=soak.FRAMES)
    parser.add_argument("--values", type=int, default=soak.VALUES)
    parser.add_argument("--held", type=int, default=soak.HELD)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--rss-trace", action="store_true",
                        help="print the agent's sampled RSS over time")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="cws", dir="/tmp")
    started = time.monotonic()
    try:
        figures = soak.run_soak(workdir, frames=args.frames, values=args.values,
                                held=args.held,
                                progress=lambda m: print(f"[{time.monotonic() - started:5.1f}s] "
                                                         f"{m}", flush=True))
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(soak.describe(figures))
    if args.rss_trace:
        for t, rss in figures.rss_samples[::10]:
            print(f"{t:7.1f} s {rss / (1 << 20):6.1f} MiB")


if __name__ == "__main__":
    main()
