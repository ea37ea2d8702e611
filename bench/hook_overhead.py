"""Hook overhead: the save path, and the whole process, agent running.

    python bench/hook_overhead.py [--rounds-small 3000] [--rounds-large 40]
                                  [--process-saves 5000] [--process-saves-large 20]
                                  [--pairs 3] [--skip-save-path] [--skip-process]
                                  [--skip-writers] [--compare LABEL=TREE ...] [--own-agents]

Per writer (--skip-writers skips it): bench/writer_overhead.py, the added cost of a
safetensors save_file and a DCP save beside torch.save's, interleaved in one process.

Save path: for each state-dict size, every round calls the plain (original) torch.save and the
instrumented one back to back, in alternating order, to tmpfs (/dev/shm), so both see the same
machine state. Reported: the median of each, the median of the per-round differences (the
added time per save), and the ratio. A third column saves with the hook active but no agent
listening (the agent-down case). Targets (issue 2): <= 10 us added at the median for 4 KiB,
<= 1 % for 64 MiB.

Whole process: the save path alone misses the sender thread, which sends the frames on the
training process's GIL, and the cost of handing the GIL to it and back. Each sample is a fresh child process that makes N saves
in a loop, plain (CKPTWATCH_DISABLE=1, hook not installed) or instrumented (hook installed,
the agent receiving), then waits for the sender to drain (flush) and reads its wall time and
its process CPU time (time.process_time: every thread of the child, the sender included).
Plain and instrumented children alternate (--pairs rounds, see --compare below).
Target (issue 22): the added process CPU at most 15 % of a plain 4 KiB save's, in the same run.

--compare LABEL=TREE (repeatable; default: f503c65=/work/wt/base-f503c65 when it exists) adds
instrumented children that import ckptwatch from another checkout (same interpreter, same
torch, same agent), so this tree's hook and an older one are measured side by side: every
round runs one child of each kind, in an order rotated every round. Reported per kind: medians
of wall and CPU per save, the median of per-round differences to the plain child, and that
difference as a share of the plain child's CPU. The load average is printed before and after.

--own-agents: each compared checkout's children send to an agent run from that checkout
(agent.py with the checkout's own .venv), started for the whole-process rounds beside this
tree's, so what a checkout's agent does to the saving process (waking it per frame, for one)
is in its figure; without it every child sends to this tree's agent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import Agent  # noqa: E402


def measure(plain, instrumented, state, rounds: int, outdir: str) -> tuple[list, list]:
    pa, pb = os.path.join(outdir, "plain.pt"), os.path.join(outdir, "instr.pt")
    t_plain, t_instr = [], []
    clock = time.perf_counter_ns
    for i in range(rounds):
        order = ((plain, pa, t_plain), (instrumented, pb, t_instr))
        for fn, path, out in (order if i % 2 == 0 else order[::-1]):
            t0 = clock()
            fn(state, path)
            out.append(clock() - t0)
    return t_plain, t_instr


# ---- whole process ------------------------------------------------------------------------

def child(instrumented: bool, saves: int, nbytes: int, outdir: str, tree: str) -> dict:
    """Runs in a fresh process: `saves` saves, then drain, then wall and CPU per save."""
    sys.path.insert(0, tree)            # the checkout whose ckptwatch is measured
    import torch
    if instrumented:
        import ckptwatch
        from ckptwatch import emitter as emitter_mod
        assert ckptwatch.install(), "hook did not install"
        assert ckptwatch.__file__.startswith(os.path.join(tree, "")), ckptwatch.__file__
    state = {"w": torch.zeros(nbytes // 4, dtype=torch.float32)}
    path = os.path.join(outdir, f"proc-{os.getpid()}.pt")
    save = torch.save

    def drain() -> None:
        if instrumented:
            assert emitter_mod.get_emitter().flush(10.0), "sender did not drain"

    warmup = max(2, saves // 10)
    for _ in range(warmup):                  # warm-up: caches, connection, sender thread
        save(state, path)
    if instrumented:
        # Wait for the warm-up's events without flush(): a flush makes the sender send at
        # once, and the timed saves should see the sender as a job that never flushes does.
        deadline = time.monotonic() + 10
        while emitter_mod.get_emitter().stats()["sent"] < warmup:   # >= 1 frame per save
            assert time.monotonic() < deadline, "sender did not drain"
            time.sleep(0.01)
    # Both kinds of child start the timed saves from the same collector state: otherwise
    # whether a full collection of torch's heap (~15 us per save over 5,000 saves) falls
    # inside the timed loop is luck, and it is larger than what is measured.
    import gc
    gc.collect()
    sender_clock = None
    if instrumented:   # the sender thread's own CPU time, for the breakdown
        sender_clock = time.pthread_getcpuclockid(emitter_mod.get_emitter()._thread.ident)
        sender0 = time.clock_gettime(sender_clock)
    wall0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(saves):
        save(state, path)
    drain()
    wall1, cpu1, main1 = time.perf_counter(), time.process_time(), time.thread_time()
    os.unlink(path)
    out = {"wall": (wall1 - wall0) / saves, "cpu": (cpu1 - cpu0) / saves,
           "main_cpu": (main1 - main0) / saves, "sender_cpu": 0.0}
    if instrumented:
        out["sender_cpu"] = (time.clock_gettime(sender_clock) - sender0) / saves
        out.update(emitter_mod.get_emitter().stats())
    return out


def run_child(tree: str | None, saves: int, nbytes: int, outdir: str, socket: str) -> dict:
    """tree None: a plain child (hook not installed); else instrumented from that checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update(CKPTWATCH_SOCKET=socket, PYTHONPATH=tree or _REPO, OMP_NUM_THREADS="1")
    if tree is None:
        env["CKPTWATCH_DISABLE"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--child",
           "plain" if tree is None else "instrumented", str(saves), str(nbytes), outdir,
           tree or _REPO]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_process(saves: int, nbytes: int, rounds: int, outdir: str, socket: str,
                    trees: dict, sockets: dict | None = None) -> dict:
    """{kind: figures} for "plain" and each instrumented tree, one child of each per round;
    sockets: {kind: agent socket} where a kind has its own agent (--own-agents)."""
    sockets = sockets or {}
    kinds = {"plain": None, **trees}
    results = {kind: [] for kind in kinds}
    names = list(kinds)
    for i in range(rounds):
        shift = i % len(names)
        for kind in names[shift:] + names[:shift]:
            results[kind].append(run_child(kinds[kind], saves, nbytes, outdir,
                                           sockets.get(kind, socket)))
    med = statistics.median
    plain = results["plain"]
    out = {}
    for kind, runs in results.items():
        out[kind] = {
            "wall": med(r["wall"] for r in runs), "cpu": med(r["cpu"] for r in runs),
            "added_wall": med(b["wall"] - a["wall"] for a, b in zip(plain, runs)),
            "added_cpu": med(b["cpu"] - a["cpu"] for a, b in zip(plain, runs)),
            "added_share": med((b["cpu"] - a["cpu"]) / a["cpu"] for a, b in zip(plain, runs)),
            "added_main_cpu": med(b["main_cpu"] - a["main_cpu"] for a, b in zip(plain, runs)),
            "sender_cpu": med(r["sender_cpu"] for r in runs),
            "sent": sum(r.get("sent", 0) for r in runs),
            "dropped": sum(r.get("dropped", 0) for r in runs),
        }
    return out


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BASE = "/work/wt/base-f503c65"


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, saves, nbytes, outdir, tree = sys.argv[2:7]
        print(json.dumps(child(mode == "instrumented", int(saves), int(nbytes), outdir, tree)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds-small", type=int, default=3000)
    ap.add_argument("--rounds-large", type=int, default=40)
    ap.add_argument("--process-saves", type=int, default=5000)
    ap.add_argument("--process-saves-large", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--skip-save-path", action="store_true")
    ap.add_argument("--skip-process", action="store_true")
    ap.add_argument("--skip-writers", action="store_true",
                    help="skip the per-writer table (bench/writer_overhead.py: torch.save, "
                         "safetensors, DCP side by side)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--compare", action="append", default=None, metavar="LABEL=TREE",
                    help="also an instrumented child importing ckptwatch from TREE")
    ap.add_argument("--own-agents", action="store_true",
                    help="children of each --compare TREE send to an agent run from TREE")
    args = ap.parse_args(argv)
    compare = args.compare
    if compare is None:
        compare = [f"f503c65={_BASE}"] if os.path.isdir(os.path.join(_BASE, "ckptwatch")) else []
    trees = {"hooked (this tree)": _REPO}
    for item in compare:
        label, sep, tree = item.partition("=")
        if not sep or not os.path.isdir(os.path.join(tree, "ckptwatch")):
            ap.error(f"--compare {item!r}: expected LABEL=TREE, TREE a checkout of ckptwatch")
        trees[f"hooked ({label})"] = os.path.abspath(tree)
    load_before = os.getloadavg()

    outdir = tempfile.mkdtemp(prefix="cwbench", dir=args.dir)
    own_agents = []
    try:
        with Agent() as agent:
            sockets = {}
            if args.own_agents and not args.skip_process:
                for kind, tree in trees.items():
                    if tree != _REPO:
                        own_agents.append(Agent(tree=tree))
                        sockets[kind] = own_agents[-1].socket
            process_rows = [] if args.skip_process else [
                ("4 KiB", args.process_saves,
                 measure_process(args.process_saves, 4 * 1024, args.pairs, outdir, agent.socket,
                                 trees, sockets)),
                ("64 MiB", args.process_saves_large,
                 measure_process(args.process_saves_large, 64 * 1024 * 1024, args.pairs, outdir,
                                 agent.socket, trees, sockets)),
            ]
            for other in own_agents:
                other.stop()
            own_agents = []
            process_received = agent.metrics().get("ckptwatch_events_received_total", 0)
            save_path = None if args.skip_save_path else save_path_bench(args, outdir, agent)
        if save_path is not None:
            save_path = save_path + agent_down_bench(args, outdir)
    finally:
        for other in own_agents:
            other.stop()
        import shutil
        shutil.rmtree(outdir, ignore_errors=True)

    import platform
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, files in {args.dir}")
    if not args.skip_writers:
        # In a child: this process's hook and writers are already set up for the tables above.
        print("\nPer writer (bench/writer_overhead.py, one process, interleaved):", flush=True)
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                     "writer_overhead.py")], check=False)
    if save_path is not None:
        rows, stats, received, down_diff, down_stats = save_path
        print("\nSave path (plain and instrumented torch.save interleaved in one process):")
        # "added" is the median of per-round (hooked - plain) differences: pairing cancels the
        # machine's drift, which a ratio of two separately taken medians does not.
        print(f"{'size':>7} {'rounds':>6} {'plain median':>13} {'hooked median':>14} "
              f"{'added (median of diffs)':>24} {'added %':>8}")
        for label, rounds, mp, mi, md in rows:
            print(f"{label:>7} {rounds:>6} {mp/1e3:>10.1f} us {mi/1e3:>11.1f} us "
                  f"{md/1e3:>21.2f} us {md/mp:>8.2%}")
        print(f"agent down, 4 KiB: added {down_diff/1e3:.2f} us per save (median of diffs); "
              f"events dropped while down: {down_stats.get('dropped')}")
        print(f"events sent {stats.get('sent')}, dropped {stats.get('dropped')}, "
              f"received by agent {int(received)}")
    if process_rows:
        print(f"\nWhole process (fresh child per sample, {args.pairs} rounds of one child per kind "
              "in rotated order; wall and process CPU per save read after the sender drained):")
        print(f"{'size':>7} {'kind':<24} {'wall':>10} {'cpu':>10} {'added wall':>11} "
              f"{'added cpu':>10} {'added cpu/plain cpu':>20} {'saving thread':>14} "
              f"{'sender thread':>14}")
        for label, saves, kinds in process_rows:
            unit, scale = ("us", 1e6) if kinds["plain"]["wall"] < 0.01 else ("ms", 1e3)
            digits = 1 if unit == "us" else 2
            for kind, r in kinds.items():
                cells = [f"{r[k] * scale:>{w - 3}.{digits}f} {unit}" for k, w in (
                    ("wall", 10), ("cpu", 10), ("added_wall", 11), ("added_cpu", 10))]
                share = "" if kind == "plain" else f"{r['added_share']:.1%}"
                extra = "" if kind == "plain" else (
                    f"{r['added_main_cpu'] * scale:>11.{digits}f} {unit} "
                    f"{r['sender_cpu'] * scale:>11.{digits}f} {unit}")
                print(f"{label:>7} {kind:<24} " + " ".join(cells) + f" {share:>20} {extra}")
        print("(added: median of per-round differences to the plain child of the same round; "
              "saving thread: its added CPU; sender thread: the sender's own CPU per save)")
        sent = sum(r["sent"] for _, _, kinds in process_rows for r in kinds.values())
        dropped = sum(r["dropped"] for _, _, kinds in process_rows for r in kinds.values())
        print(f"children: events sent {sent}, dropped {dropped}; "
              f"this tree's agent received {int(process_received)}"
              + ("; each --compare checkout's children sent to its own agent"
                 if args.own_agents else ""))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before[0]:.1f} {load_before[1]:.1f} "
          f"{load_before[2]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f} "
          f"{load_after[2]:.1f}")
    return 0


def save_path_bench(args, outdir: str, agent: Agent):
    import torch
    plain = torch.save
    sizes = [("4 KiB", 4 * 1024, args.rounds_small),
             ("64 MiB", 64 * 1024 * 1024, args.rounds_large)]
    rows = []
    os.environ["CKPTWATCH_SOCKET"] = agent.socket
    import ckptwatch
    from ckptwatch import emitter as emitter_mod
    ckptwatch.install()
    instrumented = torch.save
    assert instrumented is not plain, "hook did not install"
    for label, nbytes, rounds in sizes:
        state = {"w": torch.zeros(nbytes // 4, dtype=torch.float32)}
        measure(plain, instrumented, state, max(2, rounds // 10), outdir)  # warm-up
        t_plain, t_instr = measure(plain, instrumented, state, rounds, outdir)
        diffs = [b - a for a, b in zip(t_plain, t_instr)]
        rows.append((label, rounds, statistics.median(t_plain), statistics.median(t_instr),
                     statistics.median(diffs)))
    emitter_mod.get_emitter().flush(5.0)
    time.sleep(0.5)
    received = agent.metrics().get("ckptwatch_events_received_total", 0)
    stats = emitter_mod.get_emitter().stats()
    return rows, stats, received


def agent_down_bench(args, outdir: str):
    # The agent has stopped; the hook stays installed and its sender keeps trying to reconnect
    # (with backoff) while events queue up and are dropped at the bound.
    import torch
    from ckptwatch import emitter as emitter_mod
    instrumented = torch.save
    plain = getattr(instrumented, "__ckptwatch_original__")
    state = {"w": torch.zeros(1024, dtype=torch.float32)}
    t_plain, t_down = measure(plain, instrumented, state, args.rounds_small, outdir)
    down_diff = statistics.median([b - a for a, b in zip(t_plain, t_down)])
    return down_diff, emitter_mod.get_emitter().stats()


if __name__ == "__main__":
    raise SystemExit(main())
