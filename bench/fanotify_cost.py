"""What does a fanotify mount mark cost the agent for files it does not watch?

    python bench/fanotify_cost.py [--files 6000] [--rounds 5]   (root: fanotify needs it)

A mount mark reports every open, write and close on the mount, and the agent reads and drops
the events for files outside its watched roots (monitor/fs/fanotify.py). Side by side in one run:

  1. the cost, in the generating process, of what makes the events: create and write a small
     file, then open and read it back (the kernel merges these into as few as one event per
     file while unread: same file, name and pid);
  2. the agent's cost to read, name and drop those events: Fanotify.read() +
     FanotifyWatcher._handle(), the reader thread's whole job, timed over the queued events.

Printed: microseconds per event for each, and the ratio (agent CPU per unrelated file
operation, relative to the operation itself).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from monitor.fs import fanotify# noqa: E402


def one_round(files: int, workdir: str) -> tuple[float, float, int]:
    watched = os.path.join(workdir, "ckpt")             # the root: nothing happens in it
    other = os.path.join(workdir, "other")              # same mount, unwatched
    os.makedirs(watched, exist_ok=True)
    os.makedirs(other, exist_ok=True)
    fan = fanotify.Fanotify()
    try:
        fan.mark_mount(watched)
        drop = fanotify.FanotifyWatcher([watched], on_event=lambda e: None,
                                        on_overflow=lambda: None)
        started = time.perf_counter()
        for i in range(files):
            path = os.path.join(other, f"f{i}.dat")
            with open(path, "wb") as f:
                f.write(b"x" * 64)
            with open(path, "rb") as f:
                f.read()
        produce = time.perf_counter() - started
        n = 0
        started = time.perf_counter()
        while batch := fan.read():
            drop._handle(batch)
            n += len(batch)
        consume = time.perf_counter() - started
    finally:
        fan.close()
        shutil.rmtree(other, ignore_errors=True)
    return produce, consume, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=6000,
                    help="files per round (1-2 events each; stay under the 16384-event queue)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    ok, why = fanotify.available(tempfile.gettempdir())
    if not ok:
        print(f"fanotify is not usable here: {why}")
        return 1
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    workdir = tempfile.mkdtemp(prefix="cwfan")
    try:
        rows = [one_round(args.files, workdir) for _ in range(args.rounds)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    per_event_produce = statistics.median(p / n for p, _, n in rows if n)
    per_event_consume = statistics.median(c / n for _, c, n in rows if n)
    events = statistics.median(n for _, _, n in rows)
    print(f"events per round: {events:.0f} ({args.files} files written and read back)")
    print(f"making them (open/write/close + open/read/close): "
          f"{per_event_produce * 1e6:6.2f} us per event")
    print(f"agent reading, naming, dropping them:              "
          f"{per_event_consume * 1e6:6.2f} us per event")
    print(f"ratio agent/producer: {per_event_consume / per_event_produce:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
