"""Agent ingest: sustained events/s, agent CPU per event and loss, on the shape of a real node.

    python bench/ingest_throughput.py [--senders 8] [--conns 1] [--events 40000] [--paths 1000]
        [--kind pairs|ends|dropped|hazard|remote] [--hello] [--old [NAME=]CHECKOUT ...]
        [--rounds 1]

Starts the real agent, forks --senders processes that each open --conns connections to its
socket and send --events valid events as fast as the socket accepts them. The default load is
the one issue 22 measured: 8 senders on 8 connections, no hello, start/end pairs over 1,000
paths per sender, each path saved again and again (pair i writes ckpt{i % paths}), so the
detector keeps per-path state and chains the way a long run on a real node does.
Measures from the moment all senders are released until the agent has counted every event as
received (or rejected) and every write as finished (scraped from its /metrics): the whole
pipeline (ingest, decode, validation, detector, metrics, journal). Loss = sent - received -
rejected.

--kind picks the event kind sent (each kind's own path through the agent):
  pairs    start and end of every save (the hook's default)
  ends     the end alone (a save whose start was dropped or refused: it stands alone)
  dropped  "dropped" counts (a hook's queue overflowed)
  hazard   job-scope hazards (rate-limited per connection: most are rejected "rate_limited")
  remote   job-scope remote writes naming no tracked write (rate-limited, then refused)
--conns spreads each sender's saves over that many connections of the same process (at most
the agent's per-process cap, 16). --hello starts every connection with a hello asking for
acknowledgements and notices (the hook's warn policy).

--old CHECKOUT runs the same load against that checkout's agent (its agent.py with its own
.venv, else this interpreter), alternating old and new --rounds times in one run, and prints
the ratios: the way to compare two releases on a shared, loaded machine. --old may be given
more than once (NAME=CHECKOUT names a tree; else "old", or each checkout's directory name
when there are several): every round runs each tree once, the order rotated from round to
round, and the summary gives each tree's medians and new's ratio to each, overall and per
round (trees of one round ran in the same minute). All print the agent's CPU per event next
to events/s: the rate follows whatever share of a core the agent gets, the CPU per event much
less so.

--stage ingest measures the socket server alone (monitor.ingest.server.IngestServer in this
process, counting validated events): receive, framing, JSON decoding, validation, pid check.

--profile FILE records the agent with py-spy while it takes the load (py-spy on PATH or
beside this interpreter; collapsed stacks for a .txt file, else speedscope); with --old, one
file per tree (FILE-old.txt, FILE-new.txt: FILE-NAME for each tree), first round only.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import REPO, Agent  # noqa: E402
from bench.loads import make_frames  # noqa: E402
from ckptwatch import events  # noqa: E402

KINDS = ("pairs", "ends", "dropped", "hazard", "remote")
_JOB_SCOPE_KINDS = ("hazard", "remote")


def sender(sock_path: str, args, index: int, go, batch: int = 256) -> None:
    """One process: --conns connections; connection c carries the saves i with i % conns == c
    (a save's start and end on one connection, in order); batches go round-robin."""
    pid = os.getpid()
    conns = []
    for _ in range(args.conns):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        conns.append(s)
    frames = make_frames(args.kind, args.events, index, pid, args.paths)
    per_save = 2 if args.kind == "pairs" else 1
    streams = [[] for _ in conns]
    for i in range(0, len(frames), per_save):
        streams[(i // per_save) % len(conns)].extend(frames[i:i + per_save])
    hello = events.hello_frame("bench", pid, notices=True) if args.hello else None
    payloads = []
    for c, stream in enumerate(streams):
        chunks = [b"".join(stream[j:j + batch]) for j in range(0, len(stream), batch)]
        if hello is not None:
            chunks.insert(0, hello)
        payloads.append(chunks)
    go.wait()
    for round_ in range(max(len(p) for p in payloads)):
        for s, chunks in zip(conns, payloads):
            if round_ < len(chunks):
                s.sendall(chunks[round_])
    for s in conns:
        s.close()


def expected(args) -> tuple[int, int]:
    """Events sent in all, writes the agent should finish for them."""
    per_sender = args.events - args.events % 2 if args.kind == "pairs" else args.events
    total = args.senders * per_sender
    writes = total // 2 if args.kind == "pairs" else total if args.kind == "ends" else 0
    return total, writes


def run_agent(args, ctx, tree: str, profile: str | None = None) -> dict:
    total, writes_expected = expected(args)
    import psutil
    with Agent(tree=tree) as agent:
        go = ctx.Event()
        procs = [ctx.Process(target=sender, args=(agent.socket, args, i, go))
                 for i in range(args.senders)]
        for p in procs:
            p.start()
        time.sleep(1.0)  # let every sender connect and pre-encode its frames
        agent_proc = psutil.Process(agent.proc.pid)
        spy = start_profile(agent.proc.pid, profile) if profile else None
        cpu0 = sum(agent_proc.cpu_times()[:2])
        t0 = time.monotonic()
        go.set()
        deadline = t0 + args.timeout
        m = {}
        while time.monotonic() < deadline:
            m = agent.metrics()
            taken = (m.get("ckptwatch_events_received_total", 0)
                     + m.get("ckptwatch_events_rejected_total", 0))
            if taken >= total and m.get("ckptwatch_writes_total", 0) >= writes_expected:
                break
            time.sleep(0.5)   # each scrape costs the agent CPU: poll gently
        elapsed = time.monotonic() - t0
        agent_cpu = sum(agent_proc.cpu_times()[:2]) - cpu0
        if spy is not None:
            spy.send_signal(signal.SIGINT)     # py-spy writes its file on SIGINT
            spy.wait(60)
        for p in procs:
            p.join()
        m = agent.metrics()
    received = int(m.get("ckptwatch_events_received_total", 0))
    rejected = int(m.get("ckptwatch_events_rejected_total", 0))
    return {"tree": tree, "total": total, "received": received, "rejected": rejected,
            "writes": int(m.get("ckptwatch_writes_total", 0)),
            "lost": total - received - rejected, "elapsed": elapsed, "cpu": agent_cpu,
            "rate": (received + rejected) / elapsed,
            "us_per_event": agent_cpu / max(received + rejected, 1) * 1e6}


def profile_file(profile: str | None, name: str, old) -> str | None:
    """Where to write the py-spy record of tree `name`: the file given, or with --old one
    file per tree (name-old.txt, name-new.txt)."""
    if profile is None or not old:
        return profile
    stem, ext = os.path.splitext(profile)
    return f"{stem}-{name}{ext}"


def start_profile(pid: int, out: str) -> subprocess.Popen:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--output", out, "--format",
                             "raw" if out.endswith(".txt") else "speedscope", "--rate", "200",
                             "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ingest_only(args, ctx) -> int:
    import tempfile
    import threading
    from monitor.ingest.server import IngestServer
    from monitor.ingest.codec import BACKEND as decoder
    total, _ = expected(args)
    count = [0]
    lock = threading.Lock()
    done = threading.Event()

    def on_events(batch):
        with lock:
            count[0] += len(batch)
            if count[0] >= total:
                done.set()
    path = os.path.join(tempfile.mkdtemp(prefix="cwb", dir="/tmp"), "ingest.sock")
    server = IngestServer(path, on_events, lambda reason: None)
    server.start()
    try:
        go = ctx.Event()
        procs = [ctx.Process(target=sender, args=(path, args, i, go))
                 for i in range(args.senders)]
        for p in procs:
            p.start()
        time.sleep(1.0)
        t0, cpu0 = time.monotonic(), time.process_time()
        go.set()
        done.wait(args.timeout)
        elapsed = time.monotonic() - t0
        cpu = time.process_time() - cpu0    # this process: the server thread, senders apart
        for p in procs:
            p.join()
    finally:
        server.stop()
    print(f"ingest stage only: {args.senders} senders x {args.events} {args.kind} events; "
          f"received {count[0]} of {total}, lost {total - count[0]}")
    print(f"elapsed {elapsed:.2f} s -> {count[0] / elapsed:,.0f} events/s; server CPU "
          f"{cpu:.2f} s ({cpu / elapsed:.0%} of one core, {cpu / max(count[0], 1) * 1e6:.1f} us "
          f"per event); decoder: {decoder}")
    return 0 if count[0] == total else 1


def old_trees(olds: list) -> list:
    """(name, checkout) of each --old: NAME=CHECKOUT, else "old" for a single one, else the
    checkout's directory name."""
    trees = []
    for spec in olds:
        name, sep, tree = spec.partition("=")
        if not sep:
            tree = spec
            name = "old" if len(olds) == 1 else os.path.basename(os.path.normpath(spec))
        if name == "new" or name in (n for n, _ in trees):
            raise SystemExit(f"--old: tree name {name!r} used twice (or is 'new')")
        trees.append((name, tree))
    return trees


def summarise(results: dict, rounds: int) -> None:
    """Each tree's medians, and new's ratio to every other tree: of the medians and per round
    (the runs of one round took the same minute of the machine)."""
    import statistics
    rate = {n: statistics.median(r["rate"] for r in rs) for n, rs in results.items()}
    cpu = {n: statistics.median(r["us_per_event"] for r in rs) for n, rs in results.items()}
    print(f"median of {rounds}: " + "; ".join(
        f"{n} {rate[n]:,.0f} events/s, {cpu[n]:.1f} us/event" for n in results))
    new = results["new"]
    for name, rs in results.items():
        if name == "new":
            continue
        per_round = ", ".join(f"{a['rate'] / b['rate']:.2f}/{a['us_per_event'] / b['us_per_event']:.2f}"
                              for a, b in zip(new, rs))
        print(f"new/{name}: rate {rate['new'] / rate[name]:.2f}x, CPU per event "
              f"{cpu['new'] / cpu[name]:.2f}x (medians); per round rate/CPU: {per_round}")
    print(f"load average now {os.getloadavg()[0]:.1f}")


def describe(r: dict, label: str) -> str:
    return (f"{label:>4}: {r['rate']:>9,.0f} events/s  {r['us_per_event']:6.1f} us agent CPU/event"
            f"  ({r['cpu'] / r['elapsed']:.0%} of a core)  received {r['received']}, rejected "
            f"{r['rejected']}, writes {r['writes']}, lost {r['lost']}  ({r['elapsed']:.1f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--senders", type=int, default=8)
    ap.add_argument("--conns", type=int, default=1, help="connections per sender (<= 16)")
    ap.add_argument("--events", type=int, default=40000, help="events per sender")
    ap.add_argument("--paths", type=int, default=1000, help="paths per sender, each reused")
    ap.add_argument("--kind", choices=KINDS, default="pairs")
    ap.add_argument("--hello", action="store_true",
                    help="start each connection with a hello asking for acks and notices")
    ap.add_argument("--old", action="append", default=[], metavar="[NAME=]CHECKOUT",
                    help="an old checkout to measure side by side (repeatable)")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of old and new")
    ap.add_argument("--profile", help="py-spy the agent(s) into this file (see above)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--stage", choices=["agent", "ingest"], default="agent",
                    help="agent: the real agent end to end (default); ingest: socket server only")
    args = ap.parse_args(argv)
    if not 1 <= args.conns <= 16 or args.senders < 1 or args.paths < 1 or args.events < 2:
        ap.error("--conns must be 1..16; --senders, --paths >= 1; --events >= 2")
    ctx = mp.get_context("fork")
    if args.stage == "ingest":
        return ingest_only(args, ctx)
    total, _ = expected(args)
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(f"load: {args.senders} senders x {args.conns} connection(s), {args.events} "
          f"{args.kind} events each over {args.paths} paths ({total} events), hello "
          f"{'yes' if args.hello else 'no'}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    trees = old_trees(args.old) + [("new", REPO)]
    results: dict[str, list] = {name: [] for name, _ in trees}
    ok = True
    for round_ in range(args.rounds):
        # Rotated each round: no tree always runs first (the machine's warm-up) or last.
        shift = round_ % len(trees)
        for name, tree in trees[shift:] + trees[:shift]:
            r = run_agent(args, ctx, tree, profile_file(args.profile, name, args.old)
                          if round_ == 0 else None)
            results[name].append(r)
            ok = ok and r["lost"] == 0
            print(describe(r, name), flush=True)
    if args.old:
        summarise(results, args.rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
