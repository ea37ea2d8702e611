"""Whole-checkpoint verification in the real agent: a DCP directory saved into a watched
directory is verified as a set, and a shard swapped in from another save is "mixed" (the
verification itself is tests/unit/test_sets.py)."""
from __future__ import annotations

import os
import shutil

import pytest

from agentproc import start_agent
from ckptsets import dcp_save, shards
from helpers import remove_tree, short_tmpdir, wait_for
from monitor.verify.integrity import CORRUPT, OK


@pytest.mark.torch
def test_agent_reports_a_dcp_set_and_a_swapped_shard(saves, tmp_path):
    workdir = short_tmpdir("cws")
    root = os.path.join(workdir, "ckpt")
    os.makedirs(root)
    try:
        with start_agent(workdir, "--watch.path", root, "--watch.mode", "inotify",
                         "--verify.quiet", "0.5") as agent:
            d = dcp_save(os.path.join(root, "step-1"))

            def set_records():
                return [r for r in agent.journal_records()
                        if r.get("type") == "verification" and r.get("path") == d]

            # An ok verdict is counted, not journaled: two shards and the set.
            wait_for(lambda: agent.metric("ckptwatch_checkpoint_verifications_total",
                                          result=OK) == 3,
                     timeout=30, message=f"3 ok verifications; log:\n{agent.log}")
            assert set_records() == []
            name = shards(d, ".distcp")[0]
            shutil.copyfile(os.path.join(saves["dcp_big"], name), os.path.join(d, name))
            records = wait_for(set_records, timeout=30,
                               message=f"a set verdict; log:\n{agent.log}")
            assert [(r["result"], r["cause"], r["format"]) for r in records] == \
                [(CORRUPT, "mixed", "dcp")], records
            assert agent.metric("ckptwatch_corrupt_checkpoints_total", reason="mixed") == 1
    finally:
        remove_tree(workdir)
