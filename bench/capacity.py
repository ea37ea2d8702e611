"""Agent capacity: its CPU and memory at rest and under 64 ranks' worth of checkpoint saves.

    python bench/capacity.py [--ranks 64] [--size 4] [--rest 30] [--typical 120] [--heavy 60]
                             [--watch.mode inotify] [--watch.attribution auto] [--dir /tmp]

Starts the real agent (python agent.py, via bench.common.Agent) watching a checkpoint
directory (`--watch.path`), verification on (its defaults: structural check, plus the deep
CRC32 check below 256 MiB, i.e. every file here), journal on, and a scraper reading /metrics
every 15 s as Prometheus would. Then:

  rest      the agent alone, nothing writing, --rest seconds;
  spawn     --ranks writer processes start (--spawn fork, the default: forked from one
            Python that imported torch; --spawn exec: each a fresh Python, as torchrun starts
            its workers; see Ranks), with the `ckptwatch run` environment
            (monitor.cli.run.build_env: the bootstrap sitecustomize patches torch.save,
            CKPTWATCH_SOCKET = the agent's) and its own RANK, LOCAL_RANK (8 ranks per simulated node), WORLD_SIZE and job id;
            each imports torch and builds a state dict of --size MiB (model tensors,
            optimizer state, RNG state, step); not measured;
  typical   every rank saves once a minute (--typical seconds, period 60 s);
  heavy     every rank saves every 10 s (--heavy seconds, period 10 s);
  drain     nothing writes; verification finishes what is left (at most 60 s).

A save round is what a real job does at a checkpoint step: all ranks save at once (each
within a random 0-1 s of the round's start, as ranks leave the step's barrier), rank r to its
own shard `shards/rank-RR.pt` (overwritten every round), and the local rank 0 of each
simulated node (every 8th rank) first saves the consolidated `last.pt` on the shared
directory at the round's start: the node-local guard of the design card's variant 2, so
those ranks' writes overlap and make one concurrent collision per round. Saves per round:
ranks + ranks/8.

Measured for each phase from /proc/<agent pid>: CPU (utime+stime delta, every thread: loop,
watcher, verifier, HTTP), RSS (VmRSS sampled every second: median = steady, max) and peak
RSS (VmHWM, since the agent started); from its /metrics: events received, verifications,
collisions, writes. Load average at each phase's start and end (the machine may be shared).

The files go to /dev/shm by default: a mount of their own. With fanotify attribution the agent
marks the watched directory's whole mount and reads (then drops) every other process's file
events on it; on a busy root filesystem that costs the agent CPU in proportion to the
mount's traffic, at rest too, whatever the training job does (bench/fanotify_cost.py
measures it per event). --dir /tmp (or any directory on a busy mount) includes that cost.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
from bench.common import Agent  # noqa: E402

RANKS_PER_NODE = 8          # local ranks per simulated node; every 8th rank is a local rank 0
SCRAPE_INTERVAL = 15.0      # seconds, Prometheus' usual
JOB_ID = "capacity-bench"
_TICK = os.sysconf("SC_CLK_TCK")


# ---- one rank (a child process) ----------------------------------------------------------

def rank_main(rank: int, ranks: int, size_mib: float, outdir: str) -> int:
    """A writer: build the state dict, say `ready`, then follow `run T0 PERIOD ROUNDS` lines
    from stdin (T0 on CLOCK_MONOTONIC, which every process shares), answering `done N`."""
    import torch
    assert getattr(torch.save, "__ckptwatch_original__", None) is not None, \
        "the hook is not installed (bootstrap not on PYTHONPATH?)"
    torch.manual_seed(rank)
    # A small model's checkpoint: parameters, optimizer moments of the same shapes, RNG, step.
    n = int(size_mib * 1024 * 1024 / 4 / 3)       # float32 elements per third
    shapes = [n // 4] * 4
    params = {f"layer{i}.weight": torch.randn(s) for i, s in enumerate(shapes)}
    state = {"model": params,
             "optimizer": {"exp_avg": {k: torch.randn_like(v) for k, v in params.items()},
                           "exp_avg_sq": {k: torch.rand_like(v) for k, v in params.items()}},
             "rng": torch.get_rng_state(), "step": 0, "rank": rank}
    shard = os.path.join(outdir, "shards", f"rank-{rank:02d}.pt")
    shared = os.path.join(outdir, "last.pt")
    local_rank0 = rank % RANKS_PER_NODE == 0
    rng = random.Random(rank)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "run":
            break
        t0, period, rounds = float(cmd[1]), float(cmd[2]), int(cmd[3])
        saves = 0
        for k in range(rounds):
            start = t0 + k * period
            _sleep_until(start)
            state["step"] += 1
            if local_rank0:
                torch.save(state, shared)
                saves += 1
            _sleep_until(start + rng.uniform(0.0, 1.0))
            torch.save(state, shard)
            saves += 1
        print(f"done {saves}", flush=True)
    from ckptwatch import emitter
    emitter.get_emitter().flush(10.0)
    return 0


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


# ---- the agent, seen from outside -------------------------------------------------------

def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK     # utime, stime (fields 14, 15)


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler:
    """Reads the agent's RSS every second and scrapes /metrics every 15 s, in a thread."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.rss: list[int] = []
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        next_scrape = time.monotonic()
        while not self._stop.wait(1.0):
            self.rss.append(proc_memory(self.agent.pid)["VmRSS"])
            if time.monotonic() >= next_scrape:
                self.agent.scrape()
                self.scrapes += 1
                next_scrape += SCRAPE_INTERVAL

    def take(self) -> list[int]:
        rss, self.rss = self.rss, []
        return rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


COUNTERS = {
    "events": "ckptwatch_events_received_total",
    "verifications": "ckptwatch_checkpoint_verifications_total",
    "writes": "ckptwatch_writes_total",
    "collisions": "ckptwatch_collisions_total",
    "corrupt": "ckptwatch_corrupt_checkpoints_total",
    "rejected": "ckptwatch_events_rejected_total",
    "dropped": "ckptwatch_client_events_dropped_total",
    "fs_lost": "ckptwatch_fs_events_lost_total",
    "attributions": "ckptwatch_attributions_total",
    "attribution_s": "ckptwatch_attribution_seconds_total",
}


def counters(agent: Agent) -> dict[str, float]:
    m = agent.metrics()
    return {k: m.get(name, 0.0) for k, name in COUNTERS.items()}


class Phase:
    """One measured stretch: CPU, RSS and counter deltas between begin() and end()."""

    def __init__(self, name: str, agent: Agent, sampler: Sampler):
        self.name, self.agent, self.sampler = name, agent, sampler

    def begin(self) -> "Phase":
        self.sampler.take()
        self.load0 = os.getloadavg()
        self.c0 = counters(self.agent)
        self.cpu0 = proc_cpu_seconds(self.agent.pid)
        self.t0 = time.monotonic()
        return self

    def end(self, saves: int = 0) -> dict:
        elapsed = time.monotonic() - self.t0
        cpu = proc_cpu_seconds(self.agent.pid) - self.cpu0
        mem = proc_memory(self.agent.pid)
        c1 = counters(self.agent)
        rss = self.sampler.take() or [mem["VmRSS"]]
        return {"phase": self.name, "seconds": elapsed, "cpu_seconds": cpu,
                "cpu_pct": 100 * cpu / elapsed, "saves": saves,
                "cpu_ms_per_save": 1e3 * cpu / saves if saves else None,
                "rss_median": statistics.median(rss), "rss_max": max(rss),
                "hwm": mem["VmHWM"], "load": (self.load0, os.getloadavg()),
                **{k: c1[k] - self.c0[k] for k in COUNTERS}}


# ---- the writers -------------------------------------------------------------------------

class _Rank:
    """The bench's end of one rank's pipes (its stdin and stdout)."""

    def __init__(self, stdin, stdout):
        self.stdin, self.stdout = stdin, stdout


class Ranks:
    """The writer processes. spawn "exec": a fresh Python per rank, as torchrun starts its
    workers (each imports torch: ~150 MiB private memory and ~1 CPU-second each). spawn
    "fork": one instrumented Python imports torch, then forks a child per rank, which sets
    its RANK, LOCAL_RANK and GROUP_RANK in os.environ before its first save (the hook reads
    them then); each child is a process of its own (own pid, own hook connection, own state
    dict), but /proc/<pid>/environ, where the watcher reads ranks from, shows the parent's
    environment, so fs-only records carry no rank. Same agent work; seconds to start instead
    of minutes on a loaded 2-CPU machine."""

    def __init__(self, n: int, size_mib: float, outdir: str, socket: str, spawn: str):
        from monitor.cli.run import build_env
        base = dict(os.environ)
        base["PYTHONPATH"] = os.pathsep.join([_REPO] + [p for p in
                                              base.get("PYTHONPATH", "").split(os.pathsep) if p])
        base = build_env(base, socket)
        base.pop("CKPTWATCH_DISABLE", None)
        base.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
                    TORCHELASTIC_RUN_ID=JOB_ID, OMP_NUM_THREADS="1")
        self.procs: list[subprocess.Popen] = []
        self.ranks: list[_Rank] = []
        me = os.path.abspath(__file__)
        if spawn == "exec":
            for r in range(n):
                p = subprocess.Popen([sys.executable, me, "--rank-child", str(r), str(n),
                                      str(size_mib), outdir],
                                     env=dict(base, **rank_env(r)), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
                self.procs.append(p)
                self.ranks.append(_Rank(p.stdin, p.stdout))
            return
        child_fds = []
        for r in range(n):
            r_in, w_in = os.pipe()
            r_out, w_out = os.pipe()
            child_fds += [r_in, w_out]
            self.ranks.append(_Rank(os.fdopen(w_in, "w", buffering=1),
                                    os.fdopen(r_out, "r", buffering=1)))
        self.procs.append(subprocess.Popen(
            [sys.executable, me, "--zygote", str(n), str(size_mib), outdir,
             ",".join(map(str, child_fds))], env=base, pass_fds=child_fds))
        for fd in child_fds:
            os.close(fd)

    def expect(self, word: str, timeout: float) -> list[str]:
        """One line from every rank, each starting with word."""
        lines, deadline = [], time.monotonic() + timeout
        for rank in self.ranks:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"a rank did not say {word!r} in {timeout:g} s")
                if select.select([rank.stdout], [], [], min(left, 1.0))[0]:
                    line = rank.stdout.readline()
                    if not line:
                        raise RuntimeError(f"a rank exited before saying {word!r}")
                    if line.startswith(word):
                        lines.append(line.strip())
                        break
        return lines

    def run(self, period: float, rounds: int) -> int:
        """All ranks save `rounds` rounds, `period` apart, from 1 s from now; saves made."""
        t0 = time.monotonic() + 1.0
        for rank in self.ranks:
            rank.stdin.write(f"run {t0} {period} {rounds}\n")
            rank.stdin.flush()
        done = self.expect("done", timeout=rounds * period + 120)
        return sum(int(line.split()[1]) for line in done)

    def close(self) -> None:
        for rank in self.ranks:
            for f in (rank.stdin, rank.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def rank_env(r: int) -> dict[str, str]:
    return {"RANK": str(r), "LOCAL_RANK": str(r % RANKS_PER_NODE),
            "GROUP_RANK": str(r // RANKS_PER_NODE)}


def zygote_main(n: int, size_mib: float, outdir: str, fds: list[int]) -> int:
    """Import torch once (the hook patches it), then fork a child per rank on its pipes."""
    import torch  # noqa: F401  (imported once, before the forks: the point of the zygote)
    children = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(fds[2 * r], 0)
                os.dup2(fds[2 * r + 1], 1)
                for fd in fds:
                    os.close(fd)
                sys.stdin = open(0, "r", closefd=False)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                os.environ.update(rank_env(r))
                code = rank_main(r, n, size_mib, outdir)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            os._exit(code)
        children.append(pid)
    for fd in fds:
        os.close(fd)
    failed = 0
    for pid in children:
        failed += os.waitpid(pid, 0)[1] != 0
    return 1 if failed else 0


# ---- the run -----------------------------------------------------------------------------

def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run(args) -> list[dict]:
    outdir = tempfile.mkdtemp(prefix="cwcap", dir=args.dir)
    os.makedirs(os.path.join(outdir, "shards"))
    flags = ["--watch.path", outdir, "--watch.mode", args.watch_mode,
             "--watch.attribution", args.attribution]
    results = []
    ranks = None
    try:
        with Agent(*flags) as agent:
            sampler = Sampler(agent)
            sampler.start()
            method = [s.labels["method"] for s in agent.samples()
                      if s.name == "ckptwatch_attribution_method" and s.value == 1]
            time.sleep(3.0)   # past start-up
            phase = Phase("rest", agent, sampler).begin()
            time.sleep(args.rest)
            results.append(phase.end())

            t_spawn = time.monotonic()
            ranks = Ranks(args.ranks, args.size, outdir, agent.socket, args.spawn)
            ranks.expect("ready", timeout=600)
            spawn_s = time.monotonic() - t_spawn
            time.sleep(2.0)

            total_rounds = 0
            for name, period, seconds in (("typical", 60.0, args.typical),
                                          ("heavy", 10.0, args.heavy)):
                if seconds <= 0:
                    continue
                rounds = max(1, round(seconds / period))
                phase = Phase(name, agent, sampler).begin()
                saves = ranks.run(period, rounds)
                # The last round's saves end ~1 s after it starts; the phase lasts the whole
                # period of the last round, as a job that keeps going would.
                _sleep_until(phase.t0 + 1.0 + rounds * period)
                results.append(phase.end(saves))
                total_rounds += rounds

            # Drain: until no verification finished for 6 s (at most 60 s).
            phase = Phase("drain", agent, sampler).begin()
            expected = sum(r["saves"] for r in results)
            deadline, last = time.monotonic() + 60, counters(agent)["verifications"]
            while time.monotonic() < deadline:
                time.sleep(6.0)
                now = counters(agent)["verifications"]
                if now == last:
                    break
                last = now
            results.append(phase.end())
            sampler.stop()
            final = agent.metrics()
            meta = {"attribution": method, "spawn_seconds": spawn_s,
                    "saves": expected,
                    # one verification per path per round: every shard, and last.pt once
                    "verifications_expected": total_rounds * (args.ranks + 1), "final": {k: final.get(v, 0.0)
                                                  for k, v in COUNTERS.items()},
                    "scrapes": sampler.scrapes}
            ranks.close()
            ranks = None
    finally:
        if ranks is not None:
            ranks.close()
        shutil.rmtree(outdir, ignore_errors=True)
    return results, meta


def report(args, results, meta) -> None:
    import platform
    mib = 1024 * 1024
    how = "fresh Python processes" if args.spawn == "exec" else "processes forked after importing torch"
    print(f"ckptwatch capacity: {args.ranks} ranks ({how}, hook via "
          f"`ckptwatch run` environment), {args.size:g} MiB torch checkpoint per save, "
          f"{args.ranks // RANKS_PER_NODE} colliding local-rank-0 saves per round")
    print(f"agent: --watch.mode {args.watch_mode} --watch.attribution {args.attribution} "
          f"(running: {','.join(meta['attribution']) or '?'}), verification on (defaults), "
          f"journal on, /metrics scraped every {SCRAPE_INTERVAL:g} s; files in {args.dir or tempfile.gettempdir()}")
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus; ranks started in "
          f"{meta['spawn_seconds']:.0f} s (not measured)")
    print(f"\n{'phase':>8} {'secs':>5} {'saves':>6} {'saves/min':>9} {'agent cpu':>9} "
          f"{'ms cpu/save':>11} {'rss median':>10} {'rss max':>8} {'peak(HWM)':>9} "
          f"{'events/s':>8} {'verif/s':>7} {'collis.':>7} {'load avg start-end':>18}")
    for r in results:
        per = f"{r['cpu_ms_per_save']:.1f}" if r["cpu_ms_per_save"] else "-"
        print(f"{r['phase']:>8} {r['seconds']:>5.0f} {r['saves']:>6} "
              f"{60 * r['saves'] / r['seconds']:>9.0f} {r['cpu_pct']:>8.1f}% {per:>11} "
              f"{r['rss_median'] / mib:>6.1f} MiB {r['rss_max'] / mib:>4.1f} MiB "
              f"{r['hwm'] / mib:>5.1f} MiB {r['events'] / r['seconds']:>8.1f} "
              f"{r['verifications'] / r['seconds']:>7.2f} {r['collisions']:>7.0f} "
              f"{r['load'][0][0]:>8.1f} - {r['load'][1][0]:.1f}")
    f = meta["final"]
    print(f"\ntotals: saves {meta['saves']}, events {f['events']:.0f}, writes {f['writes']:.0f}, "
          f"verifications {f['verifications']:.0f} (one per path per round: "
          f"{meta['verifications_expected']}), collisions {f['collisions']:.0f}, "
          f"corrupt {f['corrupt']:.0f}, rejected {f['rejected']:.0f}, dropped by hooks "
          f"{f['dropped']:.0f}, fs events lost {f['fs_lost']:.0f}, /proc attributions "
          f"{f['attributions']:.0f} taking {f['attribution_s']:.1f} s, scrapes {meta['scrapes']}")
    print("(agent cpu: % of one core, every thread; ms cpu/save: agent CPU time of the phase "
          "per save; rss median/max: VmRSS sampled each second; peak: VmHWM since start)")
    if args.json:
        print(json.dumps({"args": vars(args), "results": results, "meta": meta}))


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--rank-child":
        rank, ranks, size, outdir = sys.argv[2:6]
        return rank_main(int(rank), int(ranks), float(size), outdir)
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--zygote":
        ranks, size, outdir, fds = sys.argv[2:6]
        return zygote_main(int(ranks), float(size), outdir, [int(f) for f in fds.split(",")])
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64, help="writer processes (default 64)")
    ap.add_argument("--size", type=float, default=4.0, help="MiB per checkpoint (default 4)")
    ap.add_argument("--rest", type=float, default=30.0, help="seconds at rest (default 30)")
    ap.add_argument("--typical", type=float, default=120.0,
                    help="seconds of the typical profile, one save per rank a minute (120)")
    ap.add_argument("--heavy", type=float, default=60.0,
                    help="seconds of the heavy profile, one save per rank every 10 s (60)")
    ap.add_argument("--watch.mode", dest="watch_mode", default="inotify",
                    choices=["inotify", "polling", "auto"])
    ap.add_argument("--watch.attribution", dest="attribution", default="auto",
                    choices=["auto", "fanotify", "proc"])
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the checkpoints go (default /dev/shm: a mount of their own, so "
                         "a fanotify mount mark sees only these files; see the docstring)")
    ap.add_argument("--spawn", choices=["fork", "exec"], default="fork",
                    help="fork: ranks forked from one Python that imported torch (default); "
                         "exec: a fresh Python per rank (minutes to start on 2 CPUs)")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args(argv)
    need = args.ranks * (200 if args.spawn == "exec" else 40) * 1024 * 1024
    if mem_available() < need:
        print(f"capacity: {args.ranks} ranks need ~{need >> 30} GiB free (each imports torch); "
              f"{mem_available() >> 20} MiB available. Use --ranks.", file=sys.stderr)
        return 2
    results, meta = run(args)
    report(args, results, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
