"""What 200,000 distinct training_job / rank values do to /metrics (issue 8, defect 4).

Feeds the hostile flood of tests/unit/test_prometheus_limits.py (half the writes a new job, half a
new rank of one job, plus collisions, findings and in-flight writes of new jobs) into a
MetricsState with the default label limits, then scrapes a real MetricsServer over HTTP, plain
and gzip-compressed, and prints the body sizes, one scrape's time and the process's peak RSS.

    python bench/label_flood.py [--values 200000]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

from exporters.metrics.collector import build_registry  # noqa: E402
from exporters.metrics.server import MetricsServer  # noqa: E402
from exporters.metrics.state import MetricsState  # noqa: E402
from labelflood import flood  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=200_000)
    args = parser.parse_args()
    state = MetricsState()
    started = time.perf_counter()
    flood(state, args.values)
    print(f"fed {args.values:,} distinct values in {time.perf_counter() - started:.1f} s")
    server = MetricsServer("127.0.0.1:0", build_registry(state))
    server.start()
    try:
        for encoding in ("identity", "gzip"):
            req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics",
                                         headers={"Accept-Encoding": encoding})
            started = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as resp:
                body = resp.read()
            took = time.perf_counter() - started
            print(f"/metrics {encoding}: {len(body):,} bytes, scrape {took * 1000:.0f} ms")
    finally:
        server.stop()
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
