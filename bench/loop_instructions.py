"""The agent loop's work per event, counted in instructions: steady on a loaded machine.

    python bench/loop_instructions.py [--tree CHECKOUT ...] [--events 6000] [--paths 1000]

On the shared 2-CPU machines the agent's CPU time per event moves by +-30 % from one run to
the next with the other sessions' load (bench/ingest_throughput.py), more than most changes
move it. Instructions do not: this counts them with valgrind (cachegrind, no cache
simulation) for the loop's part of the agent alone, each tree in its own process:

- the load of bench/ingest_throughput.py's default shape (8 senders, start/end pairs over
  --paths paths per sender, every writer field), decoded by the tree's own codec, fed to the
  tree's own Agent (built from its config, sockets and threads not started) through
  hook_batch in batches of up to 4,096 events (the inbox's), tick() every 0.2 s;
- on a virtual clock: the detector and the verification schedule see 1/30,000 s pass per
  event (RATE), so the same work is done however slowly valgrind runs it (a path is saved
  about every 0.53 s, as in the real bench at ~30,000 events/s);
- run twice, with and without the loop; the difference divided by the events is the loop's
  instructions per event: detector, metrics, journal encoding (lines wait in its buffer),
  verification scheduling, size history, store hand-over, verdict book, the loop itself,
  with the agent's collector settings (monitor/agent/gcpolicy.py).

Not counted: the ingest thread (receive, framing, decoding, validation: ~25 % of the agent's
CPU in the real bench), scrapes, writing the journal to disk, the verifier's thread. Each
tree runs with this interpreter (its modules first on sys.path), so trees must share the
dependencies. A few minutes per tree under valgrind.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RATE = 30000.0          # virtual events per second
TICK = 0.2              # the agent's TICK_SECONDS
BATCH = 4096            # the inbox's BATCH


def harness(tree: str, senders: int, n_events: int, paths: int, loop: bool) -> None:
    """Runs in the child, under valgrind: the tree's agent loop fed the load."""
    sys.path.insert(0, tree)
    virtual = [time.monotonic()]
    from ckptwatch import events
    from monitor.ingest import codec
    try:
        from monitor.agent import config, gcpolicy
        from monitor.agent.daemon import Agent
        from monitor.ingest.server import RIGHTS
        from monitor.verify.rights import Rights
    except ImportError:             # f503c65's layout
        from monitor import config, gcpolicy
        from monitor.daemon import Agent
        from monitor.ingest import SENDER as RIGHTS
        from monitor.sender import Sender as Rights
    sys.path.insert(0, os.path.dirname(HERE))
    from bench.loads import make_frames

    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(senders)]   # live pids
    work = tempfile.mkdtemp(prefix="cwloop")
    agent = Agent.build(config.load([
        "--ingest.socket", os.path.join(work, "a.sock"), "--journal.path",
        os.path.join(work, "journal.jsonl"), "--web.listen-address", "127.0.0.1:0",
        "--log.level", "warning"]))
    agent.detector._clock = agent.checks._clock = lambda: virtual[0]
    streams = []
    for i, proc in enumerate(procs):
        frames = make_frames("pairs", n_events, i, proc.pid, paths)
        decoded = codec.decode_many([f[events.HEADER.size:] for f in frames])
        for event in decoded:
            event[RIGHTS] = Rights(0, 0)
        streams.append(decoded)
    reads = [s[j:j + 256] for j in range(0, n_events, 256) for s in streams]
    gcpolicy.configure()                # the agent's own collector settings (its main())
    virtual[0] = time.monotonic()       # later than every event's own mono
    next_tick = virtual[0]
    k = 0
    while loop and k < len(reads):
        batch = []
        while k < len(reads) and len(batch) < BATCH:
            batch.extend(reads[k])
            k += 1
        agent.hook_batch(batch)
        virtual[0] += len(batch) / RATE
        if virtual[0] >= next_tick:
            next_tick = virtual[0] + TICK
            agent.tick()
    for _ in range(10 if loop else 0):      # what is pending settles, as in the real loop
        virtual[0] += TICK
        agent.tick()
    for proc in procs:
        proc.kill()
    os._exit(0)        # no stop(): its flush is not per-event work


def instructions(tree: str, args, loop: bool) -> int:
    sys.path.insert(0, os.path.dirname(HERE))
    from bench.common import valgrind_instructions
    return valgrind_instructions(
        [os.path.abspath(__file__), "--harness", "--tree", tree, "--events", str(args.events),
         "--paths", str(args.paths), "--senders", str(args.senders)]
        + ([] if loop else ["--no-loop"]), tree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[],
                    help="checkout to count (repeatable; default this one)")
    ap.add_argument("--events", type=int, default=6000, help="events per sender")
    ap.add_argument("--paths", type=int, default=1000, help="paths per sender, each reused")
    ap.add_argument("--senders", type=int, default=8)
    ap.add_argument("--harness", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.tree] or [os.path.dirname(HERE)]
    if args.harness:
        harness(trees[0], args.senders, args.events, args.paths, not args.no_loop)
    events_total = args.senders * args.events
    print(f"{args.senders} senders x {args.events} events over {args.paths} paths each; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    counts = {}
    for tree in trees:
        with_loop, without = instructions(tree, args, True), instructions(tree, args, False)
        counts[tree] = (with_loop - without) / events_total
        print(f"{tree}: {counts[tree]:,.0f} instructions per event in the loop "
              f"(run {with_loop:,}, without the loop {without:,})", flush=True)
    first = counts[trees[0]]
    for tree in trees[1:]:
        print(f"{tree} / {trees[0]}: {counts[tree] / first:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
