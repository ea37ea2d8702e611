"""/proc scans per save when fanotify names every writer (issue 22): one tree, one run.

    python bench/attribution_scans.py [TREE] [--saves 200]

Starts an FsSource (inotify observation, `--watch.attribution fanotify`; needs CAP_SYS_ADMIN)
on a fresh directory, with TREE (default: this checkout) first on sys.path, and a child that
writes --saves files (8 names, 4 KiB each, each read back once, 20 ms apart). Waits until a
marker written afterwards is delivered, then prints the attributed ends and the /proc scans
the scanner counted. Run it once per tree to compare (same interpreter, so the same watchdog).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

_CHILD = """
import sys, time
for i in range(int(sys.argv[2])):
    path = sys.argv[1] + "/rank-%d.pt" % (i % 8)
    open(path, "wb").write(b"x" * 4096)
    open(path, "rb").read()
    time.sleep(0.02)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", nargs="?", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    ap.add_argument("--saves", type=int, default=200)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.tree))
    from monitor.fs.source import FsSource
    root = os.path.realpath(tempfile.mkdtemp(prefix="cwscans"))
    items, lock = [], threading.Lock()

    def deliver(batch):
        with lock:
            items.extend(batch)
    src = FsSource([root], ["*.pt"], "inotify", 1.0, "n1", deliver, attribution="fanotify")
    src.start()
    try:
        subprocess.run([sys.executable, "-c", _CHILD, root, str(args.saves)], check=True)
        marker = os.path.join(root, "marker.pt")
        with open(marker, "wb") as f:
            f.write(b"m")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                getattr(i, "path", None) == marker for i in list(items)):
            time.sleep(0.05)
        ends = sum(1 for i in list(items) if isinstance(i, dict) and i.get("type") == "end")
        st = src.scanner.stats()
    finally:
        src.stop()
    print(f"{args.tree}: {args.saves} saves (each read back once) -> {ends} attributed ends, "
          f"{st['scans']} /proc scans ({st['scans'] / args.saves:.2f} per save, "
          f"{st['total_seconds'] * 1e3:.0f} ms); load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
