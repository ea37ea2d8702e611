"""A DCP save that never finished, in the real agent (issue 16 item 4): shards of a real
torch.distributed.checkpoint save land in a watched directory and the `.metadata` never
comes (the save crashed). After --verify.incomplete-after quiet seconds the agent judges the
directory `incomplete`: journaled, counted, and shown by `ckptwatch report` (exit 1). On
f503c65 such a directory was never judged at all."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from agentproc import start_agent
from ckptsets import dcp_save, shards
from helpers import REPO_ROOT, remove_tree, short_tmpdir, subprocess_env, wait_for


@pytest.mark.torch
def test_agent_judges_a_dcp_directory_without_metadata_incomplete(tmp_path):
    workdir = short_tmpdir("cwi")
    root = os.path.join(workdir, "ckpt")
    os.makedirs(root)
    saved = dcp_save(tmp_path / "saved")
    crashed = os.path.join(root, "step-7")
    try:
        with start_agent(workdir, "--watch.path", root, "--watch.mode", "inotify",
                         "--verify.quiet", "0.5", "--verify.incomplete-after", "2") as agent:
            os.makedirs(crashed)
            for name in shards(saved, ".distcp"):
                shutil.copyfile(os.path.join(saved, name), os.path.join(crashed, name))

            def verdicts():
                return [r for r in agent.journal_records()
                        if r.get("type") == "verification" and r.get("path") == crashed]

            records = wait_for(verdicts, timeout=60,
                               message=f"a verdict on {crashed}; log:\n{agent.log}")
            assert [(r["result"], r["cause"], r["format"]) for r in records] == \
                [("incomplete", "missing_metadata", "dcp")], records
            wait_for(lambda: agent.metric("ckptwatch_checkpoint_verifications_total",
                                          result="incomplete") == 1,
                     timeout=10, message="the incomplete verdict counted")
            assert agent.metric("ckptwatch_corrupt_checkpoints_total",
                                reason="missing_metadata") is None
            journal = agent.journal
        report = subprocess.run([sys.executable, "-m", "monitor.cli", "report", "--journal",
                                 journal], cwd=REPO_ROOT, env=subprocess_env(),
                                capture_output=True, text=True, timeout=120)
        assert report.returncode == 1, report.stderr
        text = " ".join(report.stdout.split())
        assert "incomplete (missing_metadata), dcp" in text and "did not finish" in text
        assert "1 unusable checkpoint" in text
    finally:
        remove_tree(workdir)
