"""Job scope's cost: the hook's added time per save with job scope on next to node scope only,
and the store traffic per save (round trips and bytes), with a real agent and a real TCPStore.

    python bench/jobscope_cost.py [--rounds 3000] [--saves 2000]

Part 1 (save path): in one process that looks like rank 2 of a 4-rank job (MASTER_ADDR/PORT,
RANK, WORLD_SIZE set; the store is a TCPStore server in this process), plain and instrumented
torch.save of a 4 KiB state dict to /dev/shm, interleaved as bench/hook_overhead.py does, once
with CKPTWATCH_JOBSCOPE=0 (node scope) and once with job scope on. Each mode runs in its own
subprocess so nothing carries over.

Part 2 (store traffic): two job-scope threads (two nodes' ranks) saving one shared path in
turn, `--saves` saves each; store operations and bytes per save from JobScope.stats(), split
into the announcement (start + end) and the reads that follow (at the end, then polls), and
the store's key count before, at the peak and after the window.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import REPO, Agent, free_port  # noqa: E402


def save_path_child(rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    from bench.hook_overhead import measure
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, True,
                          datetime.timedelta(seconds=10), wait_for_workers=False)
    plain = torch.save
    import ckptwatch
    from ckptwatch import jobscope
    ckptwatch.install()
    scope = jobscope.instance()
    if scope is not None:
        deadline = time.monotonic() + 10
        while scope.state != "active" and time.monotonic() < deadline:
            time.sleep(0.01)
    outdir = tempfile.mkdtemp(prefix="cwjs", dir="/dev/shm" if os.path.isdir("/dev/shm")
                              else None)
    state = {"w": torch.zeros(1024, dtype=torch.float32)}
    measure(plain, torch.save, state, max(2, rounds // 10), outdir)
    t_plain, t_instr = measure(plain, torch.save, state, rounds, outdir)
    diffs = [b - a for a, b in zip(t_plain, t_instr)]
    result = {"plain_us": statistics.median(t_plain) / 1e3,
              "hooked_us": statistics.median(t_instr) / 1e3,
              "added_us": statistics.median(diffs) / 1e3,
              "jobscope": scope.stats() if scope is not None else None}
    del store
    return result


def save_path(rounds: int, agent_socket: str, jobscope_on: bool) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="2",
               LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", CKPTWATCH_JOB="bench",
               CKPTWATCH_SOCKET=agent_socket, CKPTWATCH_JOBSCOPE="1" if jobscope_on else "0",
               PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--child", str(rounds)], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def isolated_save(window: float) -> dict:
    """Two nodes' ranks save one path once each, together; the store operations and bytes each
    spends on that save over its whole life (announcement, read at the end, polls until the
    window has passed, deletion)."""
    from ckptwatch.sharedfs import SharedPaths
    server, scopes = _two_nodes(window, SharedPaths({}))
    pendings = [(s.ident, 1, "/shared/last.pt", None, None, time.time(), time.monotonic())
                for s in scopes]
    for s, p in zip(scopes, pendings):
        s.started(p)
    time.sleep(0.05)
    for s, p in zip(scopes, pendings):
        s.ended(p, time.time(), time.monotonic(), "ok")
    time.sleep(0.1)
    at_end = [dict(s.stats()) for s in scopes]
    time.sleep(window * 4 + 1)
    final = [s.stats() for s in scopes]
    return {"window": window,
            "ops_at_save": sum(s["store_ops"] for s in at_end) / 2,
            "bytes_at_save": sum(s["store_bytes"] for s in at_end) / 2,
            "ops_total": sum(s["store_ops"] for s in final) / 2,
            "bytes_total": sum(s["store_bytes"] for s in final) / 2,
            "keys_after": server.num_keys()}


def _two_nodes(window: float, shared):
    """A store and two job-scope threads, ranks 0 and 2 of "nodes" a and b, both connected."""
    import torch.distributed as dist
    from ckptwatch.jobscope import JobScope
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    scopes = []
    for node, rank in (("node-a", 0), ("node-b", 2)):
        ident = {"node": node, "pid": 100000 + rank, "rank": rank, "local_rank": 0,
                 "world_size": 4, "local_world_size": 2, "node_rank": rank // 2, "job": "bench",
                 "master": "127.0.0.1:1", "restart": 0}
        scopes.append(JobScope("127.0.0.1", server.port, ident, window=window,
                               emit=lambda e: None, shared=shared).start())
    while any(s.state != "active" for s in scopes):
        time.sleep(0.01)
    return server, scopes


def store_traffic(saves: int) -> dict:
    from ckptwatch.sharedfs import SharedPaths
    window = 2.0
    server, scopes = _two_nodes(window, SharedPaths({"CKPTWATCH_SHARED_PATHS": "/shared"}))
    before = server.num_keys()
    t0 = time.perf_counter()
    peak = 0
    for i in range(saves):
        for seq_scope in scopes:
            pending = (seq_scope.ident, i + 1, "/shared/last.pt", None, None, time.time(),
                       time.monotonic())
            seq_scope.started(pending)
            seq_scope.ended(pending, time.time(), time.monotonic(), "ok")
        while any(s._frames or s._notes for s in scopes):
            time.sleep(0.0005)
        if i % 100 == 0:
            peak = max(peak, server.num_keys())
    elapsed = time.perf_counter() - t0
    stats_at_end = [s.stats() for s in scopes]
    time.sleep(window * 4 + 1)
    after = server.num_keys()
    total_saves = saves * len(scopes)
    ops = sum(s["store_ops"] for s in stats_at_end)
    nbytes = sum(s["store_bytes"] for s in stats_at_end)
    return {"saves": total_saves, "ops_per_save": ops / total_saves,
            "bytes_per_save": nbytes / total_saves, "keys_before": before, "keys_peak": peak,
            "keys_after": after, "seconds": elapsed,
            "announced": sum(s["announced"] for s in stats_at_end)}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(save_path_child(int(sys.argv[2]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--saves", type=int, default=2000)
    ap.add_argument("--window", type=float, default=10.0)
    args = ap.parse_args(argv)
    with Agent() as agent:
        node = save_path(args.rounds, agent.socket, False)
        job = save_path(args.rounds, agent.socket, True)
    print(f"4 KiB torch.save to /dev/shm, {args.rounds} rounds, median of per-round diffs:")
    print(f"  node scope only : plain {node['plain_us']:.1f} us, hooked {node['hooked_us']:.1f}"
          f" us, added {node['added_us']:.2f} us")
    print(f"  job scope on    : plain {job['plain_us']:.1f} us, hooked {job['hooked_us']:.1f}"
          f" us, added {job['added_us']:.2f} us  (job scope {job['jobscope']['state']}, "
          f"{job['jobscope']['announced']} announced, {job['jobscope']['dropped']} dropped)")
    one = isolated_save(args.window)
    print(f"store traffic of one save (two nodes' ranks save one path together, window "
          f"{one['window']:.0f}s):")
    print(f"  {one['ops_at_save']:.0f} round trips / {one['bytes_at_save']:.0f} bytes by the "
          f"end of the save's read; {one['ops_total']:.0f} / {one['bytes_total']:.0f} in all "
          f"(polls until the window passed, deletion); {one['keys_after']} key(s) left")
    traffic = store_traffic(args.saves)
    print(f"stress: two ranks on two nodes alternating on one path as fast as they can, "
          f"{traffic['saves']} saves in {traffic['seconds']:.1f}s:")
    print(f"  {traffic['ops_per_save']:.1f} round trips and {traffic['bytes_per_save']:.0f} "
          f"bytes per save (announcement, the read at the end and the polls that follow)")
    print(f"  store keys: {traffic['keys_before']} before, peak {traffic['keys_peak']}, "
          f"{traffic['keys_after']} after the window")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
