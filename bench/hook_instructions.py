"""The hook's work per save, counted in instructions: steady on a loaded machine.

    python bench/hook_instructions.py [--tree CHECKOUT ...] [--calls 1000]

bench/hook_overhead.py measures what the hook adds to a real 4 KiB torch.save in process CPU
time, which on the shared 2-CPU machines moves by +-10 points of a plain save's time from one
run to the next. This counts what moves less: the instructions the hook's own user-space work
takes per save, each tree in its own process under valgrind (cachegrind, no cache simulation):

- the tree's wrapper (hook._make_wrapper) around a save that does nothing, called from this
  file (the call site), on a 4 KiB file under /dev/shm that exists (the end's `stat` finds
  it), the hook active as after install(), frames sent to a real agent (this tree's agent.py,
  started here) that acknowledges them -- so the record path, the kept frames and the sender
  thread's ack reads are in the count (both threads are counted);
- torch itself is not imported (its import alone is ~5 billion instructions under valgrind):
  `torch.distributed` and its `distributed_c10d` are stand-ins with torch 2.x's shape for a
  process without a process group (is_initialized() False, `_world._default_pg` None), so a
  tree's identity() asks them what it would ask torch on every save;
- run twice, with --calls and 3 x --calls saves; the difference divided by 2 x --calls is the
  instructions per save. A plain 4 KiB torch.save is ~437,300 (docs/performance.md).

--parts also counts the tree with pieces taken out, to say what each costs: "stat" (os.stat
answers a constant), "record" (Emitter.record does nothing: no send, nothing kept, no acks to
read), "identity" (identity() returns the first answer through a one-line function), and all
three together. The rest is the wrapper, the call site, the clocks and the frames' formatting.

Not counted: the kernel's side of the sends and the stat, and the cache misses the hook's
Python takes after each real torch.save -- which is why the whole-process figure (process CPU)
is several times what these instructions take in a hot loop. Each tree runs with this
interpreter (its modules first on sys.path). About half a minute per tree.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = "/dev/shm/ckptwatch-hook-instructions.pt"


def _stand_in_torch_distributed() -> None:
    torch = types.ModuleType("torch")
    dist = types.ModuleType("torch.distributed")
    c10d = types.ModuleType("torch.distributed.distributed_c10d")

    class _World:
        def __init__(self):
            self._default_pg = None

    class GroupMember:
        WORLD = None

    c10d._world = _World()
    c10d.GroupMember = GroupMember

    def is_initialized():
        return c10d.GroupMember.WORLD is not None

    def get_rank():
        return 0

    def get_world_size():
        return 1

    c10d.is_initialized = is_initialized
    dist.is_initialized, dist.get_rank, dist.get_world_size = (is_initialized, get_rank,
                                                               get_world_size)
    dist.distributed_c10d = c10d
    torch.distributed = dist
    sys.modules.update({"torch.distributed": dist, "torch.distributed.distributed_c10d": c10d})


def _noop(obj, f, *args, **kwargs):
    return None


PARTS = ("stat", "record", "identity", "stat+record+identity")


class _ConstantStat:
    st_size = 4096


class _OsWithoutStat:
    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def stat(path, _result=_ConstantStat):
        return _result


def harness(tree: str, calls: int, without: str = "") -> None:
    """Runs in the child, under valgrind."""
    sys.path.insert(0, tree)
    _stand_in_torch_distributed()
    from ckptwatch import emitter, hook
    left_out = set(without.split("+")) if without else set()
    if "stat" in left_out:
        hook.os = _OsWithoutStat()
    if "record" in left_out:
        emitter.Emitter.record = lambda self, frame: None
    if "identity" in left_out:
        first = hook.identity()
        hook.identity = lambda: first
    hook._torch_dir = "/nonexistent-torch/"
    hook._active = True
    save = hook._make_wrapper(_noop)
    state = {}
    for _ in range(50):                 # warm-up: connection, hello, call site, heads
        save(state, TARGET)
    for _ in range(calls):
        save(state, TARGET)
    emitter.get_emitter().flush(10.0)
    assert hook.stats()["errors"] == 0, hook.stats()
    sys.stdout.flush()
    os._exit(0)


def instructions(tree: str, calls: int, socket: str, without: str = "") -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env["CKPTWATCH_SOCKET"] = socket
    from bench.common import valgrind_instructions
    return valgrind_instructions([os.path.abspath(__file__), "--harness", "--tree", tree,
                                  "--calls", str(calls), "--without", without], tree, env)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[],
                    help="checkout to count (repeatable; default this one)")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--parts", action="store_true",
                    help="also count each tree without its stat, record, identity")
    ap.add_argument("--harness", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--without", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.tree] or [os.path.dirname(HERE)]
    if args.harness:
        harness(trees[0], args.calls, args.without)
    with open(TARGET, "wb") as f:
        f.write(b"\0" * 4096)
    sys.path.insert(0, os.path.dirname(HERE))
    from bench.common import Agent
    agent = Agent()
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    counts = {}
    try:
        for tree in trees:
            few = instructions(tree, args.calls, agent.socket)
            many = instructions(tree, 3 * args.calls, agent.socket)
            counts[tree] = (many - few) / (2 * args.calls)
            print(f"{tree}: {counts[tree]:,.0f} instructions per save "
                  f"({args.calls:,} calls {few:,}, {3 * args.calls:,} calls {many:,})",
                  flush=True)
            for part in PARTS if args.parts else ():
                without = ((instructions(tree, 3 * args.calls, agent.socket, part)
                            - instructions(tree, args.calls, agent.socket, part))
                           / (2 * args.calls))
                print(f"  without {part}: {without:,.0f} ({counts[tree] - without:,.0f} "
                      f"for it)", flush=True)
    finally:
        agent.stop()
        os.unlink(TARGET)
    first = counts[trees[0]]
    for tree in trees[1:]:
        print(f"{tree} / {trees[0]}: {counts[tree] / first:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
