"""Where the test suite's CPU goes: a pytest plugin, and its summary.

The suite is bound by the CPU of the processes its tests start (docs/decisions.md, "Decision:
one job per scenario..."), which `--durations` does not show. As a plugin it records, per
test, the wall time and the CPU of the test process plus its reaped children (a torchrun job,
an agent stopped at teardown); each xdist worker writes its rows to DIR/rows-<worker>.json:

    CKPTWATCH_CPU_ROWS=/tmp/cpu PYTHONPATH=scripts PYTEST_ADDOPTS="-p pytest_cpu" scripts/test
    python scripts/pytest_cpu.py /tmp/cpu        # per tier and lane, then the costliest modules

CPU of a process not yet reaped (a module-scoped agent) is counted at the test that stops it.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time

_rows: list = []


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _rows_dir() -> str:
    return os.environ.get("CKPTWATCH_CPU_ROWS", "/tmp/ckptwatch-test-cpu")


try:
    import pytest
except ImportError:          # the summary needs no pytest
    pytest = None

if pytest is not None:
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own0, children0 = _cpu()
        started = time.monotonic()
        try:
            return (yield)
        finally:
            own1, children1 = _cpu()
            _rows.append((item.nodeid, time.monotonic() - started, own1 - own0,
                          children1 - children0))

    def pytest_sessionfinish(session):
        if not _rows:
            return
        os.makedirs(_rows_dir(), exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(_rows_dir(), f"rows-{worker}.json"), "w") as out:
            json.dump(_rows, out)


def summary(directory: str, top: int = 15) -> str:
    rows = []
    for name in sorted(glob.glob(os.path.join(directory, "rows-*.json"))):
        with open(name) as f:
            rows.extend(json.load(f))
    if not rows:
        raise SystemExit(f"pytest_cpu.py: no rows in {directory}")
    parts = collections.defaultdict(lambda: [0, 0.0, 0.0])
    modules = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for nodeid, wall, own, children in rows:
        module = nodeid.split("::")[0]
        if module.startswith("tests/unit"):
            part = "fast tier"
        else:
            part = next((f"lane {lane}" for lane in ("e2e-a", "e2e-b") if "@" + lane in nodeid),
                        "e2e, no lane")
        for table, key in ((parts, part), (modules, module)):
            table[key][0] += 1
            table[key][1] += wall
            table[key][2] += own + children
    lines = [f"{'':40s} {'tests':>6s} {'wall s':>8s} {'CPU s':>8s}"]
    for key, (n, wall, cpu) in sorted(parts.items()):
        lines.append(f"{key:40s} {n:6d} {wall:8.0f} {cpu:8.0f}")
    lines.append(f"{'all':40s} {len(rows):6d} {sum(r[1] for r in rows):8.0f} "
                 f"{sum(r[2] + r[3] for r in rows):8.0f}")
    lines.append("")
    for key, (n, wall, cpu) in sorted(modules.items(), key=lambda kv: -kv[1][2])[:top]:
        lines.append(f"{key:40s} {n:6d} {wall:8.0f} {cpu:8.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python scripts/pytest_cpu.py ROWS_DIR", file=sys.stderr)
        raise SystemExit(2)
    print(summary(sys.argv[1]))
