"""Agent ingest: sustained events/s and loss with 8 sending processes.

    python bench/ingest_throughput.py [--senders 8] [--events 40000]

Starts the real agent, forks N sender processes that each connect to its socket and send
--events valid events (start/end pairs of writes to their own paths, so the detector does real
work but finds no collision) as fast as the socket accepts them. Measures from the moment all
senders are released until the agent has counted every event as received and every write as
finished (scraped from its /metrics), i.e. the whole pipeline: ingest, decode, validation,
detector, metrics, journal. Loss = sent - received. Target (issue 8, item 11): >= 50,000
events/s, zero loss, 8 senders.

--stage ingest measures the socket server alone (monitor.ingest.server.IngestServer in this process,
counting validated events): receive, framing, JSON decoding, validation, pid check.

Both stages print CPU time per event next to events/s: on a shared, loaded machine the rate
follows whatever share of a core the agent gets, the CPU per event much less so.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import Agent  # noqa: E402
from ckptwatch import events# noqa: E402


def sender(sock_path: str, n_events: int, index: int, go, batch: int = 256) -> None:
    pid = os.getpid()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    frames = []
    now_wall, now_mono = time.time(), time.monotonic()
    for i in range(n_events // 2):
        path = f"/bench/sender{index}/ckpt{i % 64}.pt"
        base = {"v": 1, "node": "bench", "pid": pid, "seq": i, "rank": index, "local_rank": index,
                "world_size": 8, "job": "bench", "path": path, "site": "bench.py:1",
                "func": "sender"}
        t = now_mono + i * 1e-6
        frames.append(events.encode({**base, "type": "start", "wall": now_wall, "mono": t}))
        frames.append(events.encode({**base, "type": "end", "wall": now_wall, "mono": t + 5e-7,
                                     "start_wall": now_wall, "start_mono": t, "bytes": 4096,
                                     "outcome": "ok"}))
    payloads = [b"".join(frames[i:i + batch]) for i in range(0, len(frames), batch)]
    go.wait()
    for p in payloads:
        s.sendall(p)
    s.close()


def ingest_only(args, ctx) -> int:
    import tempfile
    import threading
    from monitor.ingest.server import IngestServer
    try:
        from monitor.ingest.codec import BACKEND as decoder
    except ImportError:     # a checkout from before monitor/ingest/codec.py, measured for comparison
        decoder = "json (events.decode_many)"
    total = args.senders * (args.events // 2) * 2
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
        procs = [ctx.Process(target=sender, args=(path, args.events, i, go))
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
    print(f"ingest stage only: {args.senders} senders x {args.events} events; "
          f"received {count[0]} of {total}, lost {total - count[0]}")
    print(f"elapsed {elapsed:.2f} s -> {count[0] / elapsed:,.0f} events/s; server CPU "
          f"{cpu:.2f} s ({cpu / elapsed:.0%} of one core, {cpu / max(count[0], 1) * 1e6:.1f} us "
          f"per event); decoder: {decoder}")
    return 0 if count[0] == total else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--senders", type=int, default=8)
    ap.add_argument("--events", type=int, default=40000, help="events per sender (even)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--stage", choices=["agent", "ingest"], default="agent",
                    help="agent: the real agent end to end (default); ingest: socket server only")
    args = ap.parse_args(argv)
    total = args.senders * (args.events // 2) * 2
    ctx = mp.get_context("fork")
    if args.stage == "ingest":
        return ingest_only(args, ctx)
    with Agent() as agent:
        go = ctx.Event()
        procs = [ctx.Process(target=sender, args=(agent.socket, args.events, i, go))
                 for i in range(args.senders)]
        for p in procs:
            p.start()
        time.sleep(1.0)  # let every sender connect and pre-encode its frames
        import psutil
        agent_proc = psutil.Process(agent.proc.pid)
        cpu0 = sum(agent_proc.cpu_times()[:2])
        t0 = time.monotonic()
        go.set()
        deadline = t0 + args.timeout
        m = {}
        while time.monotonic() < deadline:
            m = agent.metrics()
            if (m.get("ckptwatch_events_received_total", 0) >= total
                    and m.get("ckptwatch_writes_total", 0) >= total // 2):
                break
            time.sleep(0.1)   # each scrape costs the agent CPU: poll gently
        elapsed = time.monotonic() - t0
        agent_cpu = sum(agent_proc.cpu_times()[:2]) - cpu0
        for p in procs:
            p.join()
        m = agent.metrics()
    received = int(m.get("ckptwatch_events_received_total", 0))
    rejected = int(m.get("ckptwatch_events_rejected_total", 0))
    writes = int(m.get("ckptwatch_writes_total", 0))
    print(f"{args.senders} senders x {args.events} events = {total} events; "
          f"{os.cpu_count()} cpus")
    print(f"received {received}, rejected {rejected}, writes {writes}, "
          f"lost {total - received}")
    print(f"elapsed {elapsed:.2f} s -> {received / elapsed:,.0f} events/s end to end; "
          f"agent CPU {agent_cpu:.2f} s ({agent_cpu / elapsed:.0%} of one core, "
          f"{agent_cpu / received * 1e6:.1f} us per event)")
    return 0 if received == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
