"""monitor.cli.demo_job saving once in each of several --save modes, each mode into its own
subdirectory of --out (SUBDIRS), one after the other with a barrier between: one job shared by
the end-to-end tests whose scenarios need not be alone in a job (the torch import, DDP and the
optimizer's torch._dynamo cost ~20 s CPU per job on the 2-CPU build machine).

    torchrun ... tests/support/modesjob.py --modes local-rank0,every-rank,rank0,per-rank \\
        --out DIR [demo_job's other arguments]

Every save is demo_job.save_checkpoint's torch.save (the call site the tests assert), with
args.save set to the mode and args.out to the mode's subdirectory. The subdirectory names
carry no digit and no node name (ckptwatch.sharedfs.names_rank_or_node looks at the last two
path components): a path's hazards are judged exactly as under demo_job's own --out.

The tests import program(), mode_dir() and under() from here, before they skip without torch:
torch is imported by main() only.
"""
from __future__ import annotations

import argparse
import os
import sys

SUBDIRS = {"local-rank0": "localguard", "every-rank": "everyrank", "rank0": "globalguard",
           "per-rank": "perrank"}


def program(modes) -> list[str]:
    """The training program's arguments (before --out and demo_job's): this script, saving
    in each of `modes`, in that order."""
    assert modes and all(m in SUBDIRS for m in modes), modes
    return [os.path.abspath(__file__), "--modes", ",".join(modes)]


def mode_dir(out: str, mode: str) -> str:
    """Where `mode`'s saves go under --out."""
    return os.path.join(out, SUBDIRS[mode])


def under(records: list[dict], directory: str) -> list[dict]:
    """The journal records among `records` whose path lies directly in `directory` (one
    mode's)."""
    return [r for r in records if os.path.dirname(r["path"]) == directory]


def main(argv=None) -> int:
    import torch.distributed as dist

    from monitor.cli import demo_job
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--modes", required=True, help="comma-separated demo_job --save modes")
    ours, rest = p.parse_known_args(argv)
    modes = ours.modes.split(",")
    assert modes and all(m in SUBDIRS for m in modes), modes
    save = demo_job.save_checkpoint

    def save_each_mode(state: dict, args, rank: int, local_rank: int) -> None:
        for i, mode in enumerate(modes):
            if i:
                dist.barrier()          # one mode's saves are over before the next's begin
            out = mode_dir(args.out, mode)
            os.makedirs(out, exist_ok=True)
            save(state, argparse.Namespace(**{**vars(args), "save": mode, "out": out}),
                 rank, local_rank)

    demo_job.save_checkpoint = save_each_mode
    return demo_job.main(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
