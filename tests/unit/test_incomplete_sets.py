"""A DCP checkpoint whose `.metadata` never came (its save crashed) is judged `incomplete`
after a quiet period (issue 16 item 4): by the schedule (pure, injected clock), by the real
verifier thread on real shards of a real DCP save, and in the metrics and the journal."""
from __future__ import annotations

import os
import shutil

import pytest

from ckptsets import dcp_save, shards
from helpers import wait_for
from monitor.verify.checks import Checks
from monitor.verify.worker import (CAUSE_MISSING_METADATA, RESULT_INCOMPLETE, Verification,
                                   VerifySchedule)


def test_schedule_judges_a_dcp_directory_without_metadata_after_the_quiet_period():
    s = VerifySchedule(quiet=1.0, incomplete_after=30.0)
    shard = Verification("/c/__0_0.distcp", "ok", unfinished_set="/c")
    s.verified([shard], 10.0)
    assert s.due_unfinished(39.0) == []
    s.write_started("/c/__1_0.distcp", 20.0, watched=True)     # the save goes on
    assert s.due_unfinished(100.0) == []
    s.write_finished("/c/__1_0.distcp", "", 110.0, watched=True)
    assert s.due_unfinished(139.0) == []
    assert s.due_unfinished(140.0) == ["/c"]
    assert s.due_unfinished(1000.0) == []                       # judged once


def test_metadata_that_comes_late_makes_it_a_set_not_incomplete():
    s = VerifySchedule(quiet=1.0, incomplete_after=30.0)
    s.verified([Verification("/c/__0_0.distcp", "ok", unfinished_set="/c")], 10.0)
    s.verified([Verification("/c/.metadata", "ok", set_dir="/c")], 25.0)
    assert s.due_unfinished(100.0) == []
    assert [d for d, _ in s.due_sets(100.0)] == ["/c"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_checks(checks: Checks, clock: Clock, until: float) -> list:
    """Tick at `until` (handing on what is due then) and wait for the verifier thread's
    answers to all of it."""
    clock.now = until
    found = checks.tick()

    def answered():
        found.extend(checks.tick())
        return checks.verifier.outstanding == 0

    wait_for(answered, timeout=30, message="the verifier's answers")
    return found


@pytest.mark.torch
@pytest.mark.parametrize("metadata_comes", [False, True])
def test_real_shards_without_metadata_are_incomplete(tmp_path, metadata_comes):
    saved = dcp_save(tmp_path / "saved")
    crashed = tmp_path / "ckpt" / "step-100"
    crashed.mkdir(parents=True)
    clock = Clock()
    checks = Checks(quiet=1.0, incomplete_after=30.0, clock=clock)
    checks.start()
    try:
        for name in shards(saved, ".distcp"):       # the shards land; .metadata does not
            path = str(crashed / name)
            checks.write_started(path, watched=True)
            shutil.copy(os.path.join(saved, name), path)
            checks.write_finished(path, "job-x", ("job-x", None, 0), watched=True)
        got = run_checks(checks, clock, 2.0)
        assert sorted(os.path.basename(v.path) for v in got) == shards(saved, ".distcp")
        assert all(v.unfinished_set == str(crashed) for v in got)
        if metadata_comes:
            meta = str(crashed / ".metadata")
            checks.write_started(meta, watched=True)
            shutil.copy(os.path.join(saved, ".metadata"), meta)
            checks.write_finished(meta, "job-x", ("job-x", None, 0), watched=True)
            got = run_checks(checks, clock, 5.0)
            got += run_checks(checks, clock, 10.0)         # the set, quiet after .metadata
            assert [(v.path, v.result, v.format) for v in got if v.path == str(crashed)] \
                == [(str(crashed), "ok", "dcp")]
            assert not run_checks(checks, clock, 100.0)
            return
        assert not run_checks(checks, clock, 31.0)          # not quiet for 30 s yet
        [v] = run_checks(checks, clock, 32.5)
        assert (v.path, v.result, v.format, v.cause) == (
            str(crashed), RESULT_INCOMPLETE, "dcp", CAUSE_MISSING_METADATA)
        assert "no .metadata" in v.reason and "did not finish" in v.reason
        assert not run_checks(checks, clock, 500.0)          # judged once
    finally:
        checks.stop()
