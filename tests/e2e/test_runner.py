"""monitor.cli.run under a real torchrun: every rank's hook reports its identity (the
environment and exec themselves are tests/unit/test_runner.py)."""
import subprocess
import sys
import textwrap

import pytest

from helpers import subprocess_env
from monitor.cli import run as runner
from receiver import Receiver


@pytest.mark.torch
def test_torchrun_ranks_report_their_identity(sock, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch
        torch.save({"w": torch.zeros(4)}, f"rank{os.environ['RANK']}.pt")
        """))
    env = runner.build_env(subprocess_env(), sock)
    with Receiver(sock) as rx:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", str(script)],
                             env=env, cwd=str(tmp_path), capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        ends = rx.wait_count("end", 2)
    by_rank = {e["rank"]: e for e in ends}
    assert sorted(by_rank) == [0, 1]
    for rank, event in by_rank.items():
        assert event["path"] == str(tmp_path / f"rank{rank}.pt")
        assert (event["local_rank"], event["world_size"], event["local_world_size"],
                event["node_rank"], event["restart"]) == (rank, 2, 2, 0, 0)
        assert event["outcome"] == "ok"
        assert event["master"] and event["master"].count(":") == 1
    # Both workers belong to one run: same torchelastic run id, different processes.
    assert by_rank[0]["job"] == by_rank[1]["job"] and by_rank[0]["job"]
    assert by_rank[0]["pid"] != by_rank[1]["pid"]
