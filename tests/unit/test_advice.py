"""ckptwatch.advice: the warning in the training process, `ckptwatch report` and `ckptwatch
lint` tell people the same fix."""
from __future__ import annotations

import textwrap

from ckptwatch import advice, policy
from monitor.cli.report import suggest_fix
from monitor.detect.model import Collision, Write, Writer
from monitor.lint import lint_source


def test_the_warning_the_report_and_lint_give_the_one_fix():
    notice = {"kind": "concurrent", "path": "/ckpt/last.pt", "site": "train.py:42",
              "others": [{"rank": 1, "pid": 12, "node": "n1", "site": "train.py:42"}]}
    assert policy.describe("train.py:42", notice).endswith(f"Fix: {advice.FIX}")

    writes = tuple(Write(writer=Writer(node="n1", pid=pid, rank=rank, job="j1", restart=0),
                         path="/ckpt/last.pt", seq=1, start_wall=10.0 + rank,
                         start_mono=rank, end_wall=12.0 + rank, end_mono=2.0 + rank,
                         outcome="ok", site="train.py:42")
                   for pid, rank in ((11, 0), (12, 1)))
    assert suggest_fix(Collision(path="/ckpt/last.pt", kind="concurrent", writes=writes)) \
        == advice.FIX

    [finding] = lint_source(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        torch.save({}, "last.pt")
    """), "train.py")
    assert finding.message.endswith(f"runs on every rank; {advice.FIX}")
