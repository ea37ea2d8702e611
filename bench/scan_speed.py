"""How fast is checkpoint verification, next to what a user would otherwise do?

Side by side, in one run, on the same file:
  1. structural verify (monitor.verify.integrity.verify) vs torch.load of the checkpoint
     (target: structural >= 100x faster);
  2. deep verify (CRC32 of every record) vs a plain sequential read of the file in 1 MiB
     chunks (target: deep throughput >= 50% of the plain read's), with the CRC32 backend
     installed (monitor.verify.crc: zlib-ng or isal from ckptwatch[fast]) and with stdlib zlib.

Each pair is measured twice: with the file in the page cache (warm: CPU cost only, the
agent's case right after a save) and with this file's pages dropped before every run
(cold: posix_fadvise DONTNEED on this one file, the case of `scan` over old checkpoints).

    /opt/ckptwatch-venv/bin/python bench/scan_speed.py [--size-mib 320] [--file PATH]
        [--old CHECKOUT --rounds 5]

--old CHECKOUT also times that checkout's structural verify on the same file, cold and warm,
in child processes (each tree's own directory first on sys.path), alternating old and new
--rounds times with torch.load in between, and prints each tree's ratio to torch.load: the
side-by-side comparison of two releases on a shared, loaded machine.
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
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monitor.verify import crc  # noqa: E402
from monitor.verify import torchzip  # noqa: E402
from monitor.verify.integrity import OK, verify  # noqa: E402
from monitor.verify.torchzip import CHUNK  # noqa: E402


def make_checkpoint(path: str, size_mib: int) -> None:
    """A model-like state dict: a few big matrices, many small vectors, an optimizer state."""
    import torch
    g = torch.Generator().manual_seed(0)
    state, total, i = {}, 0, 0
    target = size_mib << 20
    while total < target * 0.9:
        rows = 1024 if i % 4 else 4096
        w = torch.randn(rows, 1024, generator=g)
        state[f"layers.{i}.weight"] = w
        state[f"layers.{i}.bias"] = torch.randn(rows, generator=g)
        state[f"layers.{i}.norm"] = torch.ones(1024, dtype=torch.bfloat16)
        total += w.numel() * 4
        i += 1
    state["embed"] = torch.randn(int((target - total) / 4 / 1024) + 1, 1024, generator=g)
    torch.save({"model": state, "step": 1000, "rng": torch.get_rng_state()}, path)


def timed(fn, repeat: int) -> float:
    """Median wall time of fn() over repeat runs."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def plain_read(path: str) -> int:
    buf = bytearray(CHUNK)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                return n
            n += got


def stdlib_deep(path: str):
    """The deep check as it runs without ckptwatch[fast]: the same code, zlib's CRC32."""
    saved = torchzip.crc32
    torchzip.crc32 = zlib.crc32
    try:
        return verify(path, deep=True)
    finally:
        torchzip.crc32 = saved


# Run in a child with one tree first on sys.path: median seconds of `repeat` structural
# verifies of argv[2], warm (cached) and cold (this file's pages dropped before each).
_CHILD = """
import os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from monitor.verify.integrity import verify
path, repeat = sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
def timed(cold):
    times = []
    for _ in range(repeat):
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        verdict = verify(path)
        times.append(time.perf_counter() - started)
        assert verdict.status == "ok", verdict
    return statistics.median(times)
verify(path)
print(timed(False), timed(True))
"""


def side_by_side(path: str, old: str, rounds: int, repeat: int) -> None:
    """Structural verify of the old tree and this one vs torch.load, warm and cold, the
    trees alternating in one run (see the module doc)."""
    import torch
    fd = os.open(path, os.O_RDONLY)
    trees = (("old", os.path.abspath(old)), ("new", REPO))
    got = {name: {"warm": [], "cold": []} for name, _ in trees}
    loads = {"warm": [], "cold": []}
    for _ in range(rounds):
        for name, tree in trees:
            out = subprocess.run([tree_python(tree), "-c", _CHILD, tree, path, str(repeat)],
                                 capture_output=True, text=True, check=True, cwd=tree)
            warm, cold = map(float, out.stdout.split())
            got[name]["warm"].append(warm)
            got[name]["cold"].append(cold)
        plain_read(path)
        loads["warm"].append(timed(lambda: torch.load(path), 1))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        loads["cold"].append(timed(lambda: torch.load(path), 1))
    os.close(fd)
    print()
    print(f"side by side, {rounds} rounds (median of medians; {repeat} verifies per round), "
          f"load average {os.getloadavg()[0]:.1f}:")
    print(f"{'':24}{'warm':>12}{'cold':>12}")
    load = {c: statistics.median(v) for c, v in loads.items()}
    print(f"{'torch.load':24}{load['warm']:12.4f}{load['cold']:12.4f}")
    for name, tree in trees:
        med = {c: statistics.median(v) for c, v in got[name].items()}
        print(f"{'structural, ' + name:24}{med['warm']:12.4f}{med['cold']:12.4f}   "
              f"{load['warm'] / med['warm']:,.0f}x / {load['cold'] / med['cold']:,.0f}x "
              f"faster than torch.load ({tree})")


def tree_python(tree: str) -> str:
    own = os.path.join(tree, ".venv", "bin", "python")
    return own if os.path.exists(own) else sys.executable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=320, help="checkpoint size to generate")
    p.add_argument("--file", help="measure this checkpoint instead of generating one")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--old", help="an old checkout to measure side by side (structural)")
    p.add_argument("--rounds", type=int, default=5, help="alternations with --old")
    args = p.parse_args(argv)

    import torch
    tmp = None
    path = args.file
    if not path:
        tmp = tempfile.mkdtemp(prefix="cwscan")
        path = os.path.join(tmp, "bench.pt")
        make_checkpoint(path, args.size_mib)
    try:
        size = os.path.getsize(path)
        print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
        print(f"file: {path} ({size / 2**20:.0f} MiB), torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs")
        plain_read(path)                                  # warm the cache
        v = verify(path, deep=True)
        if v.status != OK:
            print(f"the checkpoint does not verify: {v}")
            return 1
        print(f"records: {v.details['entries']}, storages: {v.details['storages']}")
        if args.old:
            side_by_side(path, args.old, args.rounds, args.repeat * 4)
            return 0

        mib = size / 2**20
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)                       # dirty pages cannot be dropped

        def cold(fn):
            def run():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                fn()
            return run

        rows = {}
        for cache, wrap in (("warm", lambda fn: fn), ("cold", cold)):
            plain_read(path)
            rows[cache] = (
                timed(wrap(lambda: verify(path)), args.repeat * (20 if cache == "warm" else 2)),
                timed(wrap(lambda: torch.load(path)), max(2, args.repeat // 2)),
                timed(wrap(lambda: plain_read(path)), args.repeat),
                timed(wrap(lambda: verify(path, deep=True)), args.repeat),
                timed(wrap(lambda: stdlib_deep(path)), args.repeat))
        os.close(fd)

        print()
        print(f"{'seconds (MiB/s)':30}{'warm cache':>22}{'cold cache':>22}")
        names = ("structural verify", "torch.load", "plain read, 1 MiB chunks",
                 f"deep verify ({crc.BACKEND})", "deep verify (stdlib zlib)")
        for i, name in enumerate(names):
            cells = "".join(f"{rows[c][i]:12.4f} ({mib / rows[c][i]:6.0f})" for c in rows)
            print(f"{name:30}{cells}")
        block = os.urandom(1 << 20) * 64
        t_crc = timed(lambda: crc.crc32(block), args.repeat)
        print(f"{'CRC32 in memory (ceiling)':30}{t_crc * size / len(block):12.4f} "
              f"({mib / (t_crc * size / len(block)):6.0f})   backend {crc.BACKEND} "
              f"(stdlib zlib {zlib.ZLIB_RUNTIME_VERSION})")
        for c, (t_struct, t_load, t_read, t_deep, t_stdlib) in rows.items():
            print(f"{c}: structural verify is {t_load / t_struct:,.0f}x faster than torch.load "
                  f"(target >= 100x); deep verify runs at {100 * t_read / t_deep:.0f}% of the "
                  f"plain read's throughput (target >= 50%; {100 * t_read / t_stdlib:.0f}% "
                  "with stdlib zlib)")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
