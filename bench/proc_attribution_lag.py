"""inotify + /proc attribution of short saves: what a scan costs and how late it runs.

    python bench/proc_attribution_lag.py [TREE] [--saves 20] [--hold 0.2] [--holders 0]

Starts an FsSource (inotify, `--watch.attribution proc`) on a fresh directory with TREE
(default: this checkout) first on sys.path. With --holders N, N idle Python processes each
hold --files open files first (what makes a /proc walk slow). A child then saves --saves
files: open, write 4 KiB, hold the file --hold seconds, close; it reports the monotonic
time of each open and close. Per save this prints the lags from the child's open to the
watcher's event, to the attribution thread taking it, to the scan's start and end, and
whether the writer was named (a "start" event with the child's pid). Then the scan figures:
CPU (thread time) and wall per scan, processes and fds on the node.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_CHILD = """
import os, sys, time
root, n, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(0.5)
for i in range(n):
    path = root + "/save-%d.pt" % i
    t0 = time.monotonic()
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        time.sleep(hold)
    t1 = time.monotonic()
    print(path, t0, t1, flush=True)
    time.sleep(0.3)
"""

_HOLDER = """
import sys, tempfile
d = tempfile.mkdtemp(prefix="cwhold")
fs = [open("%s/f%d" % (d, i), "w") for i in range(int(sys.argv[1]))]
print("ready", flush=True)
sys.stdin.read()
"""


def node_fds() -> tuple[int, int]:
    procs = fds = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            procs += 1
            try:
                fds += len(os.listdir(f"/proc/{name}/fd"))
            except OSError:
                pass
    return procs, fds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", nargs="?", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--hold", type=float, default=0.2)
    ap.add_argument("--holders", type=int, default=0)
    ap.add_argument("--files", type=int, default=300)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.tree))
    from monitor.fs import tracker as fstracker
    from monitor.fs.source import FsSource

    holders = []
    for _ in range(args.holders):
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(args.files)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holders.append(p)
    for p in holders:
        assert p.stdout.readline().strip() == "ready"

    root = os.path.realpath(tempfile.mkdtemp(prefix="cwlag"))
    items, lock = [], threading.Lock()
    taken: dict = {}         # path -> mono the attribution thread took its open
    scans: list = []         # (path, start mono, end mono, thread cpu s)

    def deliver(batch):
        with lock:
            items.extend(batch)

    src = FsSource([root], ["*.pt"], "inotify", 1.0, "n1", deliver, attribution="proc")
    real_attribute = fstracker.attribute
    real_holders_of = src.scanner.holders_of

    current = {}

    def attribute(ev, tracker, scanner, **kw):
        taken.setdefault(ev.path, (ev.mono, time.monotonic()))
        current["kind"] = ev.kind
        return real_attribute(ev, tracker, scanner, **kw)

    def holders_of(path, *a, **kw):
        c0, t0 = time.thread_time(), time.monotonic()
        try:
            return real_holders_of(path, *a, **kw)
        finally:
            scans.append((path, t0, time.monotonic(), time.thread_time() - c0,
                          current.get("kind")))

    fstracker.attribute = attribute
    src.scanner.holders_of = holders_of
    src.start()
    try:
        child = subprocess.run([sys.executable, "-c", _CHILD, root, str(args.saves),
                                str(args.hold)], check=True, capture_output=True, text=True)
        time.sleep(1.0)
        procs, fds = node_fds()
        st = src.scanner.stats()
    finally:
        src.stop()
        for p in holders:
            p.stdin.close()
            p.wait()
    with lock:
        starts = {(i["path"], i["pid"]) for i in items
                  if isinstance(i, dict) and i.get("type") == "start"}
    rows = []
    for line in child.stdout.split("\n"):
        if not line:
            continue
        path, t0, t1 = line.split()
        t0, t1 = float(t0), float(t1)
        ev_mono, take = taken.get(path, (None, None))
        first = next(((s, e, c) for p, s, e, c, _ in scans if p == path), None)
        named = any(p == path for p, _ in starts)
        rows.append((path, t0, t1, ev_mono, take, first, named))
    print(f"{args.tree}: saves of {args.hold * 1e3:.0f} ms, {args.holders} holders x "
          f"{args.files} files; node {procs} processes, {fds} fds; load "
          f"{os.getloadavg()[0]:.1f}")
    print("  open->event  open->taken(first event)  open->scan-start  open->scan-end  (ms)  named")
    for path, t0, t1, ev_mono, take, first, named in rows:
        def ms(x):
            return f"{(x - t0) * 1e3:8.1f}" if x is not None else "       -"
        print(f"  {ms(ev_mono)}  {ms(take)}  {ms(first[0] if first else None)}  "
              f"{ms(first[1] if first else None)}        {'yes' if named else 'NO'}")
    walls = [e - s for _, s, e, _, _ in scans]
    cpus = [c for _, _, _, c, _ in scans]
    for kind in sorted({k for *_, k in scans}, key=str):
        w = [(e - s) * 1e3 for _, s, e, _, k in scans if k == kind]
        c = [c * 1e3 for _, _, _, c, k in scans if k == kind]
        print(f"  scans on {kind}: {len(w)}, wall median {statistics.median(w):.1f} ms max "
              f"{max(w):.1f}, cpu median {statistics.median(c):.1f} ms max {max(c):.1f}")
    print(f"named {sum(r[-1] for r in rows)}/{len(rows)}; {len(scans)} scans: wall median "
          f"{statistics.median(walls) * 1e3:.1f} ms max {max(walls) * 1e3:.1f} ms; cpu median "
          f"{statistics.median(cpus) * 1e3:.1f} ms max {max(cpus) * 1e3:.1f} ms; "
          f"full scans {st['full_scans']}, candidates {st['candidates']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
