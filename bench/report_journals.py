"""`ckptwatch report` on large journals: time and peak RSS, old tree against this one.

    .venv/bin/python bench/report_journals.py --old /work/wt/base-f503c65 \
        --records 200000 1000000 --kinds hazards writes --formats table json html

For each (kind, size) a journal is generated once (bench/report_journals.py's `generate`:
`hazards` = one hazard record per path, as a job-scope agent journals them; `writes` = finished
writes of 16 ranks on 1,000 paths with a concurrent collision every 100 writes), then
`ckptwatch report --format F -o FILE` runs under each tree in turn (old, new, old, new...:
same load), each in a child whose peak RSS is read from wait4() and whose address space is
capped at --max-gib (a report that reaches it fails with MemoryError: its exit code shows it).
A run is cut at --timeout seconds (reported as "> T s"). Output bytes are the report file's size.

Not a test: figures go into docs/report.md with the command and the load (uptime).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

WALL0 = 1_764_457_487.0


def _writer(rank: int, pid: int, job: str = "bench-job") -> str:
    return (f'"node":"n{rank % 4}","pid":{pid},"rank":{rank},"local_rank":{rank % 4},'
            f'"job":"{job}","restart":0,"master":null')


def generate(path: str, kind: str, n: int) -> None:
    """A journal of n records of one kind (see the module docstring)."""
    with open(path, "w", encoding="utf-8") as fh:
        if kind == "hazards":
            for i in range(n):
                wall = WALL0 + i * 0.01
                fh.write(
                    f'{{"type":"hazard","path":"/mnt/shared/run{i}/last.pt","node":"n0",'
                    f'"source":"hook","job":"bench-job","wall":{wall},"writers":[{{'
                    f'{_writer(0, 1000)},"seq":{i},"site":"train.py:42",'
                    f'"func":"save"}}],"hazard":"shared_storage_multi_writer","shared":'
                    f'"nfs","ranks":[0,1,2,3],"nodes":["n0","n1"],"reported_by":1000,'
                    f'"ts":{wall}}}\n')
            return
        seq = {}
        for i in range(n):
            rank = i % 16
            pid = 2000 + rank
            seq[rank] = seq.get(rank, 0) + 1
            start = WALL0 + i * 0.05
            line_path = f"/mnt/shared/ckpt/{(i // 16) % 1000}.pt"
            fh.write(f'{{"type":"write",{_writer(rank, pid)},"path":"{line_path}",'
                     f'"seq":{seq[rank]},"start_wall":{start},"end_wall":{start + 0.5},'
                     f'"duration":0.5,"bytes":16777216,"outcome":"ok","site":"train.py:42",'
                     f'"func":"save","source":"hook","ts":{start + 0.5}}}\n')
            if i % 100 == 99:
                a, b = (rank + 1) % 16, (rank + 2) % 16
                ws = ",".join(
                    f'{{{_writer(r, 2000 + r)},"path":"{line_path}","seq":{seq.get(r, 0)},'
                    f'"start_wall":{start + j * 0.1},"end_wall":{start + 0.5 + j * 0.1},'
                    f'"duration":0.5,"bytes":16777216,"outcome":"ok","site":"train.py:42",'
                    f'"func":"save","source":"hook"}}' for j, r in enumerate((a, b)))
                fh.write(f'{{"type":"collision","id":"c{i}","path":"{line_path}",'
                         f'"kind":"concurrent","scope":"node","sources":["hook"],'
                         f'"job":"bench-job","detected_wall":{start + 1},'
                         f'"overlap_seconds":0.4,"writers":[{ws}],"first":{{}},"last":{{}},'
                         f'"ts":{start + 1}}}\n')


def _limit(gib: float):
    def apply():
        import resource
        cap = int(gib * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return apply


def run_once(tree: str, journal: str, fmt: str, timeout: float, max_gib: float = 8.0) -> tuple:
    """(wall seconds or None if cut, CPU seconds, peak RSS in MiB, output bytes, exit code)
    of one report. On a shared machine CPU seconds (user + system) are the figure to compare:
    wall time follows the load."""
    out = tempfile.mktemp(suffix="." + fmt, dir=os.path.dirname(journal))
    python = os.path.join(tree, ".venv", "bin", "python")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from monitor.cli.main import main; "
            "sys.exit(main(sys.argv[2:]))")
    cmd = [python, "-c", code, tree, "report", "--journal", journal, "--format", fmt,
           "-o", out]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=_limit(max_gib))
    seconds = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            seconds = time.perf_counter() - t0
            break
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    size = os.path.getsize(out) if os.path.exists(out) else 0
    if os.path.exists(out):
        os.unlink(out)
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, size, \
        proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the baseline tree (with its .venv)")
    parser.add_argument("--new", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    parser.add_argument("--records", type=int, nargs="+", default=[200_000])
    parser.add_argument("--kinds", nargs="+", default=["hazards", "writes"])
    parser.add_argument("--formats", nargs="+", default=["table", "json", "html"])
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--max-gib", type=float, default=8.0,
                        help="address-space cap of each report (a shared machine must not "
                             "run out of memory; a report that hits it exits 1: MemoryError)")
    parser.add_argument("--dir", default=None, help="where journals go (default: a temp dir)")
    args = parser.parse_args(argv)
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f} (1/5/15 min), {os.cpu_count()} CPUs")
    print(f"{'journal':<24} {'format':<6} {'tree':<4} {'wall s':>8} {'CPU s':>7} "
          f"{'peak RSS':>10} {'output':>10} {'exit':>4}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kind in args.kinds:
            for n in args.records:
                journal = os.path.join(tmp, f"{kind}-{n}.jsonl")
                generate(journal, kind, n)
                label = f"{n:,} {kind} ({os.path.getsize(journal) >> 20} MiB)"
                for fmt in args.formats:
                    for name, tree in (("old", args.old), ("new", args.new)):
                        seconds, cpu, rss, size, code = run_once(tree, journal, fmt,
                                                                  args.timeout, args.max_gib)
                        shown = f"> {args.timeout:.0f}" if seconds is None else f"{seconds:.1f}"
                        print(f"{label:<24} {fmt:<6} {name:<4} {shown:>8} {cpu:>7.1f} "
                              f"{rss:>6.0f} MiB {size / 2**20:>6.1f} MiB {code:>4}",
                              flush=True)
                os.unlink(journal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
