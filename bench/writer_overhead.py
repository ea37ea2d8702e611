"""The hook's added cost per save for each writer: torch.save, safetensors, DCP (issue 18).

    python bench/writer_overhead.py [--rounds 200] [--dcp-rounds 60]
    (also run by bench/hook_overhead.py unless --skip-writers)

One process, an agent receiving. For each writer and size, every round makes one plain save
and one instrumented save of the same state to tmpfs, back to back, the order swapped every
round; the writers are switched between the two (ckptwatch.writers.uninstall()/install(),
torch.save's original from its marker), outside the timed call. Reported: the medians, the
median of per-round differences (the added time per save) and that as a share of the plain
save. DCP's save is dcp.save(no_dist=True) of a small state: one shard and the .metadata, two
reported writes per save.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import Agent  # noqa: E402


def _rounds(plain, instrumented, rounds: int) -> tuple[list, list]:
    clock = time.perf_counter_ns
    t_plain, t_instr = [], []
    for i in range(rounds):
        order = ((plain, t_plain), (instrumented, t_instr))
        for fn, out in (order if i % 2 == 0 else order[::-1]):
            fn(timed=False)                       # switch the writers, untimed
            t0 = clock()
            fn(timed=True)
            out.append(clock() - t0)
    return t_plain, t_instr


def measure(outdir: str, rounds: int, dcp_rounds: int) -> list:
    """[(writer, size label, rounds, plain median ns, hooked median ns, added median ns)]."""
    import warnings
    warnings.simplefilter("ignore")
    import ckptwatch
    ckptwatch.install()
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from ckptwatch import writers
    assert set(writers.installed()) >= {"safetensors", "dcp"}, writers.installed()
    hooked_save = torch.save
    plain_save = getattr(hooked_save, "__ckptwatch_original__")
    rows = []

    def case(name, label, save, n):
        def plain(timed):
            if not timed:
                writers.uninstall()
            else:
                save(plain_save, "plain")

        def hooked(timed):
            if not timed:
                writers.install()
            else:
                save(hooked_save, "hooked")
        _rounds(plain, hooked, max(2, n // 10))          # warm-up
        tp, ti = _rounds(plain, hooked, n)
        rows.append((name, label, n, statistics.median(tp), statistics.median(ti),
                     statistics.median([b - a for a, b in zip(tp, ti)])))

    for label, nbytes in (("4 KiB", 4 << 10), ("4 MiB", 4 << 20)):
        state = {"w": torch.zeros(nbytes // 4, dtype=torch.float32)}
        case("torch.save", label,
             lambda torch_save, tag: torch_save(state, os.path.join(outdir, f"{tag}.pt")), rounds)
        case("safetensors", label,
             lambda _t, tag: save_file(state, os.path.join(outdir, f"{tag}.safetensors")),
             rounds)
        case("dcp (no_dist)", label,
             lambda _t, tag: dcp.save(state, checkpoint_id=os.path.join(outdir, f"{tag}-dcp"),
                                      no_dist=True), dcp_rounds)
    writers.install()
    from ckptwatch import emitter
    emitter.get_emitter().flush(5.0)
    return rows


def report(rows) -> None:
    print(f"{'writer':>14} {'size':>6} {'rounds':>6} {'plain median':>13} {'hooked median':>14} "
          f"{'added (median of diffs)':>24} {'added %':>8}")
    for name, label, n, mp, mi, md in rows:
        print(f"{name:>14} {label:>6} {n:>6} {mp/1e3:>10.1f} us {mi/1e3:>11.1f} us "
              f"{md/1e3:>21.2f} us {md/mp:>8.2%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--dcp-rounds", type=int, default=60)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args(argv)
    outdir = tempfile.mkdtemp(prefix="cwwbench", dir=args.dir)
    try:
        with Agent() as agent:
            os.environ["CKPTWATCH_SOCKET"] = agent.socket
            rows = measure(outdir, args.rounds, args.dcp_rounds)
    finally:
        import shutil
        shutil.rmtree(outdir, ignore_errors=True)
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), files in {args.dir}")
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
