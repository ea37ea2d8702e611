"""Job scope at scale: one real TCPStore server, 1,024 (or more) simulated ranks, each a real
job-scope client (ckptwatch.jobscope.JobScope: its thread and its own connection, speaking
TCPStore's wire protocol), as threads in a few processes, next to the job's own store traffic.

    python bench/jobscope_scale.py [--ranks 1024] [--procs 4] [--nodes 128] [--rounds 2]
                                   [--window 4]

What one run does, in this order, with job scope's traffic OFF and ON alternating (--rounds of
each, side by side under the same load):
- checkpoint: every rank saves its own DCP-style shard (step-N/__<rank>_0.distcp) and rank 0
  the metadata (step-N/.metadata) -- a correct job: nothing may be reported. A save is the
  hook's two calls (started/ended) 20 ms apart; no file is written (the store is measured).
  OFF: the same saves without calling job scope (its connections stay open and idle).
- then the `local_rank == 0` bug: local rank 0 of each of --nodes nodes saves one shared
  last.pt, ON only: every one of them must report the others (remote events) and the hazard.
Measured per phase: job scope's store operations and bytes per rank per checkpoint (from each
client's own counts: every command sent, every byte each way), the store server's CPU seconds
(its /proc stat), the keys in the store at the peak (polled), and the latency of the job's own
store operations: --loops threads of torch's own TCPStore client doing add+get on keys of their
own, all the while, p50/p99 per phase kind. Connections added: established TCP connections to
the server's port before and after the job-scope clients connect (/proc/net/tcp*).

Each phase lasts 2 windows + 2 s after its saves so the clean-up reads are counted in it; the
window is short here (--window, default 4 s) to keep the run short: a window's watch reads grow
with log2(window / 0.25 s) only (module docstring of ckptwatch/jobscope.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHARED = "/ckptwatch-bench-shared"       # marked shared (CKPTWATCH_SHARED_PATHS), never created


def _pin(cpus) -> None:
    """--isolate: keep this process on `cpus` (None: leave it where the OS puts it)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def _server(conn, cpus=None) -> None:
    _pin(cpus)
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    conn.send(store.port)
    conn.recv()                                  # until told to stop
    del store


def _ranks(conn, port: int, ranks: list, window: float, per_node: int,
           stagger: float, cpus=None) -> None:
    """One process of simulated ranks: a JobScope each, driven by commands from the bench.
    The ranks connect `stagger` seconds apart: torch 2.13's TCPStore server stalls (every
    client, the job's own too, for seconds) when more than ~50 connections arrive in a burst
    (measured here with torch's own client: the 49th times out), so a burst of 1,024 would
    measure that stall, not job scope."""
    _pin(cpus)
    from ckptwatch.jobscope import JobScope
    from ckptwatch.sharedfs import SharedPaths
    shared = SharedPaths({"CKPTWATCH_SHARED_PATHS": SHARED})
    scopes, events = [], {}
    for rank in ranks:
        node = rank // per_node
        ident = {"node": f"node-{node}", "pid": 100000 + rank, "rank": rank,
                 "local_rank": rank % per_node, "world_size": None, "local_world_size": per_node,
                 "node_rank": node, "job": "scale", "master": f"127.0.0.1:{port}",
                 "restart": 0}
        sink = events.setdefault(rank, [])
        scopes.append((rank, ident, JobScope("127.0.0.1", port, ident, window=window,
                                             emit=sink.append, shared=shared,
                                             connect_budget=600.0, op_timeout=30.0).start()))
        time.sleep(stagger)
    deadline = time.monotonic() + 600
    while any(s.state != "active" for _, _, s in scopes) and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.send(("ready", sum(s.state == "active" for _, _, s in scopes)))
    seq = 0
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] == "stats":
            conn.send({rank: dict(ops=s.stats()["store_ops"], bytes=s.stats()["store_bytes"],
                                  state=s.state,
                                  remote=sum(e["type"] == "remote" for e in events[rank]),
                                  hazards=sorted({e["kind"] for e in events[rank]
                                                  if e["type"] == "hazard"}))
                       for rank, _, s in scopes})
            continue
        kind, step, on = cmd
        seq += 1
        saves = []
        for rank, ident, scope in scopes:
            if kind == "ckpt":
                paths = [f"{SHARED}/step-{step}/__{rank}_0.distcp"]
                if rank == 0:
                    paths.append(f"{SHARED}/step-{step}/.metadata")
            else:                                # the local_rank == 0 bug: one per node
                paths = [f"{SHARED}/last.pt"] if ident["local_rank"] == 0 else []
            for i, path in enumerate(paths):
                pending = (ident, seq * 4 + i, path, None, None, time.time(), time.monotonic())
                if on:
                    scope.started(pending)
                saves.append((scope, pending))
        time.sleep(0.02)
        for scope, pending in saves:
            if on:
                scope.ended(pending, time.time(), time.monotonic(), "ok", 1 << 20)
        conn.send("saved")


def _latency(conn, port: int, loops: int, cpus=None) -> None:
    """The job's own store traffic: add+get loops on torch's own client, timestamped."""
    _pin(cpus)
    import torch.distributed as dist
    samples: list = []
    stop = threading.Event()

    def loop(i: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        key = f"job/loop{i}"
        while not stop.is_set():
            t0 = time.monotonic()
            store.add(key, 1)
            store.get(key)
            samples.append((t0, time.monotonic() - t0))
            time.sleep(0.005)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(loops)]
    for t in threads:
        t.start()
    conn.recv()
    stop.set()
    for t in threads:
        t.join(10)
    conn.send(samples)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _connections(port: int) -> int:
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        n += 1
        except OSError:
            pass
    return n


class KeyPeak(threading.Thread):
    def __init__(self, port: int):
        super().__init__(daemon=True)
        import torch.distributed as dist
        self.store = dist.TCPStore("127.0.0.1", port, None, False,
                                   datetime.timedelta(seconds=60), wait_for_workers=False)
        self.peak = 0
        self.halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, self.store.num_keys())
            except Exception:           # the server stopped at the end of the run
                return
            time.sleep(0.1)

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--connect-rate", type=float, default=20.0,
                    help="new connections per second, all processes together")
    ap.add_argument("--off-off", action="store_true",
                    help="noise floor: the 'on' phases run with job scope off too (A/A)")
    ap.add_argument("--isolate", action="store_true",
                    help="the store server and the job's loops on CPU 0, the simulated ranks "
                         "on the other CPUs: on a real cluster the ranks' own CPU is on "
                         "other hosts, so only their store traffic reaches the server's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.ranks % args.nodes:
        ap.error("--ranks must be a multiple of --nodes")
    per_node = args.ranks // args.nodes
    ctx = mp.get_context("spawn")
    load = os.getloadavg()
    store_cpus = rank_cpus = None
    if args.isolate:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            ap.error("--isolate needs 2 CPUs or more")
        store_cpus, rank_cpus = {cpus[0]}, set(cpus[1:])
        _pin(store_cpus)                # this process polls the keys: the server's side

    srv_conn, child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(child, store_cpus), daemon=True)
    server.start()
    port = srv_conn.recv()
    lat_conn, child = ctx.Pipe()
    latency = ctx.Process(target=_latency, args=(child, port, args.loops, store_cpus),
                          daemon=True)
    latency.start()
    peak = KeyPeak(port)
    base_conns = _connections(port)
    workers = []
    for i in range(args.procs):
        conn, child = ctx.Pipe()
        ranks = list(range(i, args.ranks, args.procs))
        p = ctx.Process(target=_ranks, args=(child, port, ranks, args.window, per_node,
                                             args.procs / args.connect_rate, rank_cpus),
                        daemon=True)
        p.start()
        workers.append((p, conn))
    active = sum(conn.recv()[1] for _, conn in workers)
    added = _connections(port) - base_conns

    def stats() -> dict:
        merged = {}
        for _, conn in workers:
            conn.send(("stats",))
        for _, conn in workers:
            merged.update(conn.recv())
        return merged

    def phase(kind: str, step: int, on: bool) -> dict:
        before = stats()
        cpu0 = _cpu_seconds(server.pid)
        wcpu0 = sum(_cpu_seconds(p.pid) for p, _ in workers)
        peak.take()
        t0 = time.monotonic()
        for _, conn in workers:
            conn.send((kind, step, on))
        for _, conn in workers:
            conn.recv()
        time.sleep(2 * args.window + 2.0)       # the phase's reads and clean-up
        t1 = time.monotonic()
        after = stats()
        ops = {r: after[r]["ops"] - before[r]["ops"] for r in after}
        nbytes = {r: after[r]["bytes"] - before[r]["bytes"] for r in after}
        return {"kind": kind, "on": on, "t0": t0, "t1": t1, "ops": ops, "bytes": nbytes,
                "cpu": _cpu_seconds(server.pid) - cpu0,
                "wcpu": sum(_cpu_seconds(p.pid) for p, _ in workers) - wcpu0, "keys_peak": peak.take(),
                "after": after}

    phases = []
    step = 0
    for _ in range(args.rounds):
        for on in (False, True):
            step += 1
            # --off-off: the B phases send nothing either; their figures are labelled "on".
            ph = phase("ckpt", step, on and not args.off_off)
            ph["on"] = on
            phases.append(ph)
    bug = phase("bug", step + 1, True)
    lat_conn.send("stop")
    samples = lat_conn.recv()
    for _, conn in workers:
        conn.send(("quit",))
    peak.halt.set()                     # before the server stops: no failed poll to print
    peak.join(5)
    srv_conn.send("stop")

    def lat(on: bool) -> tuple:
        xs = [dt for p in phases if p["on"] == on for t, dt in samples if p["t0"] <= t < p["t1"]]
        return _pct(xs, 0.5) * 1e3, _pct(xs, 0.99) * 1e3, len(xs)

    def per_rank(on: bool, name: str) -> tuple:
        xs = [x for p in phases if p["on"] == on for x in p[name].values()]
        n = sum(1 for p in phases if p["on"] == on)
        return statistics.mean(xs) if xs else 0.0, max(xs) if xs else 0, n

    off_lat, on_lat = lat(False), lat(True)

    def slow_by_offset(on: bool, limit: float) -> dict:
        """How many samples slower than `limit` (s) start in each 1 s of the phases: shows
        which of job scope's bursts (save, end reads, late reads, clean-up) makes the tail."""
        bins: dict = {}
        for p in phases:
            if p["on"] != on:
                continue
            for t, dt in samples:
                if p["t0"] <= t < p["t1"] and dt > limit:
                    b = int(t - p["t0"])
                    bins[b] = bins.get(b, 0) + 1
        return dict(sorted(bins.items()))
    writers = [r for r in bug["after"] if (r % per_node) == 0]
    got_all = sum(bug["after"][r]["remote"] >= args.nodes - 1 for r in writers)
    guard = sum("local_rank_guard" in bug["after"][r]["hazards"] for r in writers if r)
    ckpt_on = [p for p in phases if p["on"]]
    result = {
        "command": "python bench/jobscope_scale.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
        "load_before": load, "load_after": os.getloadavg(), "ranks": args.ranks,
        "active": active, "procs": args.procs, "nodes": args.nodes, "window": args.window,
        "connections_added": added,
        "ops_per_rank_ckpt_on": per_rank(True, "ops"), "ops_per_rank_ckpt_off":
            per_rank(False, "ops"),
        "bytes_per_rank_ckpt_on": per_rank(True, "bytes"),
        "rank0_ops_per_ckpt": statistics.mean(p["ops"][0] for p in ckpt_on),
        "server_cpu_s_per_ckpt": {"off": statistics.mean(p["cpu"] for p in phases
                                                         if not p["on"]),
                                  "on": statistics.mean(p["cpu"] for p in ckpt_on),
                                  "bug": bug["cpu"]},
        "keys_peak": {"off": max(p["keys_peak"] for p in phases if not p["on"]),
                      "on": max(p["keys_peak"] for p in ckpt_on), "bug": bug["keys_peak"]},
        "job_latency_ms": {"off": {"p50": off_lat[0], "p99": off_lat[1], "n": off_lat[2]},
                           "on": {"p50": on_lat[0], "p99": on_lat[1], "n": on_lat[2]},
                           "p99_ratio": on_lat[1] / off_lat[1] if off_lat[1] else None},
        "slow_by_second": {"limit_ms": off_lat[1],
                           "off": slow_by_offset(False, off_lat[1] / 1e3),
                           "on": slow_by_offset(True, off_lat[1] / 1e3)},
        "worker_cpu_s_per_ckpt": {"off": statistics.mean(p["wcpu"] for p in phases
                                                         if not p["on"]),
                                  "on": statistics.mean(p["wcpu"] for p in ckpt_on)},
        "bug": {"writers": len(writers), "saw_every_other_writer": got_all,
                "local_rank_guard": guard, "ops_per_writer": statistics.mean(
                    bug["ops"][r] for r in writers)},
        # Counted from the start: after the last correct checkpoint it must still be 0.
        "remote_reports_in_correct_checkpoints": sum(v["remote"]
                                                     for v in phases[-1]["after"].values()),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"command: {result['command']}")
    print(f"load (1/5/15 min) before {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, after "
          f"{result['load_after'][0]:.1f}")
    print(f"ranks {args.ranks} ({active} active) in {args.procs} processes, {args.nodes} nodes,"
          f" window {args.window:g} s; connections added {added} "
          f"({added / max(1, args.ranks):.2f} per rank)")
    on_ops, off_ops = result["ops_per_rank_ckpt_on"], result["ops_per_rank_ckpt_off"]
    print(f"store ops per rank per checkpoint: on {on_ops[0]:.2f} (max {on_ops[1]}), "
          f"off {off_ops[0]:.2f}; rank 0 (shard + .metadata) {result['rank0_ops_per_ckpt']}")
    print(f"store bytes per rank per checkpoint: on {result['bytes_per_rank_ckpt_on'][0]:.0f}")
    cpu = result["server_cpu_s_per_ckpt"]
    print(f"store server CPU per checkpoint phase: off {cpu['off']:.2f} s, on {cpu['on']:.2f} s;"
          f" bug phase {cpu['bug']:.2f} s")
    print(f"simulated ranks' CPU per checkpoint phase (all processes): off "
          f"{result['worker_cpu_s_per_ckpt']['off']:.2f} s, on "
          f"{result['worker_cpu_s_per_ckpt']['on']:.2f} s")
    sb = result["slow_by_second"]
    print(f"samples slower than the off p99 ({sb['limit_ms']:.2f} ms) by second of the phase: "
          f"off {sb['off']}, on {sb['on']}")
    keys = result["keys_peak"]
    print(f"keys at peak: off {keys['off']}, on {keys['on']}, bug {keys['bug']}")
    jl = result["job_latency_ms"]
    print(f"job's add+get latency: off p50 {jl['off']['p50']:.2f} ms p99 {jl['off']['p99']:.2f}"
          f" ms (n={jl['off']['n']}); on p50 {jl['on']['p50']:.2f} ms p99 "
          f"{jl['on']['p99']:.2f} ms (n={jl['on']['n']}); p99 on/off "
          f"{jl['p99_ratio']:.2f}")
    b = result["bug"]
    print(f"local_rank==0 bug, {b['writers']} writers: {b['saw_every_other_writer']} reported "
          f"all {args.nodes - 1} others, {b['local_rank_guard']} named local_rank_guard, "
          f"{b['ops_per_writer']:.1f} store ops per writer")
    print(f"remote reports during the correct checkpoints: "
          f"{result['remote_reports_in_correct_checkpoints']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
