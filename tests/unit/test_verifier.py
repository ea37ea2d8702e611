"""monitor.verify.worker: when a path is verified (pure schedule) and what verifying says (real
files, real worker thread)."""
import pytest

from helpers import wait_for
from monitor.verify.worker import RESULT_GONE, Verifier, VerifySchedule


def test_a_path_is_due_once_quiet_for_the_quiet_time():
    s = VerifySchedule(quiet=2.0)
    s.write_finished("/c/a.pt", "job", now=10.0)
    assert s.due(11.9) == []
    assert s.due(12.0) == [("/c/a.pt", "job", "", ())]
    assert s.due(100.0) == []          # handed out once


def test_a_new_write_postpones_verification_until_it_ends():
    s = VerifySchedule(quiet=1.0)
    s.write_finished("/c/a.pt", "j", now=10.0)
    s.write_started("/c/a.pt", now=10.5)
    assert s.due(50.0) == []           # still being written: never verify a file in flight
    s.write_finished("/c/a.pt", "j", now=60.0)
    assert s.due(60.9) == [] and s.due(61.0) == [("/c/a.pt", "j", "", ())]


def test_a_collision_is_linked_to_the_verification_of_its_path():
    s = VerifySchedule(quiet=1.0)
    for t in (10.0, 10.1, 10.2):
        s.write_finished("/c/last.pt", "j", now=t)
    s.collided("/c/last.pt", "abc123", now=11.0)
    assert s.due(11.2) == [("/c/last.pt", "j", "abc123", ())]


def test_the_schedule_is_bounded():
    s = VerifySchedule(quiet=1.0, max_paths=3)
    for i in range(10):
        s.write_finished(f"/c/{i}.pt", "", now=float(i))
    assert len(s) == 3
    assert [p for p, _, _, _ in s.due(100.0)] == ["/c/7.pt", "/c/8.pt", "/c/9.pt"]


@pytest.mark.parametrize("seed", range(20))
def test_due_paths_are_found_without_looking_at_every_path(seed):
    """due() stops at the first hook path not yet due (issue 22: one look per tick at every
    path known was most of a tick at 8,000 paths); under any sequence of writes, ends,
    collisions and watched paths it hands out what a look at every path would."""
    import copy
    import random
    rng = random.Random(seed)
    s, now = VerifySchedule(quiet=1.0, max_paths=50), 0.0
    for step in range(2000):
        now += rng.choice((0.0, 0.01, 0.3, 1.0))
        path, op = f"/c/{rng.randrange(60)}.pt", rng.random()
        if op < 0.35:
            s.write_started(path, now, sender=("rights", rng.randrange(2)))
        elif op < 0.8:
            s.write_finished(path, "j", now, watched=rng.random() < 0.1)
        elif op < 0.9:
            s.collided(path, f"c{step}", now)
        else:
            everything = copy.deepcopy(s)
            expected = [(p, e.job, e.collision_id, None) for p, e in
                        everything._due_watched.items() if e.at <= now]
            expected += [(p, e.job, e.collision_id, everything._senders.get(p, ()))
                         for p, e in everything._due.items() if e.at <= now]
            assert s._due_in_order()
            assert s.due(now) == expected, step


@pytest.fixture
def torch():
    import torch
    return torch


@pytest.mark.torch
def test_verify_real_files(tmp_path, torch):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(10_000)}, good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[:-100])
    v = Verifier(deep_max_bytes=1 << 30, max_rate=None)
    ok = v.verify(str(good), job="j", collision_id="")
    assert (ok.result, ok.format, ok.deep, ok.bytes) == ("ok", "torch-zip", True,
                                                         good.stat().st_size)
    corrupt = v.verify(str(bad), collision_id="c1")
    assert corrupt.result == "corrupt" and corrupt.cause == "truncated"
    assert corrupt.collision_id == "c1" and corrupt.reason
    assert v.verify(str(tmp_path / "renamed-away.pt")).result == RESULT_GONE
    # Above the deep limit only the structural check runs.
    assert Verifier(deep_max_bytes=10).verify(str(good)).deep is False


@pytest.mark.torch
def test_worker_thread_verifies_submitted_paths(tmp_path, torch, no_thread_leak):
    path = tmp_path / "x.pt"
    torch.save({"a": 1}, path)
    v = Verifier()
    v.start()
    try:
        assert v.submit(str(path), "job-1", "")
        got = wait_for(v.drain, message="a verification")
        assert [(g.path, g.result, g.job) for g in got] == [(str(path), "ok", "job-1")]
    finally:
        v.stop()


def test_a_full_queue_skips_and_counts(tmp_path):
    v = Verifier(max_queue=2)          # not started: nothing drains the queue
    assert [v.submit(f"/x/{i}.pt") for i in range(4)] == [True, True, False, False]
    assert v.skipped_total == 2


@pytest.mark.torch
def test_the_same_bytes_are_verified_once(tmp_path, torch):
    path = tmp_path / "x.pt"
    torch.save({"a": 1}, path)
    v = Verifier()
    assert v.verify(str(path)).result == "ok"
    assert v.verify(str(path)) is None and v.unchanged_total == 1
    torch.save({"a": 2, "b": torch.zeros(10)}, path)     # rewritten: verified again
    assert v.verify(str(path)).result == "ok"


def test_pending_counts_due_paths_and_submissions_until_their_answer_is_drained(tmp_path):
    """ckptwatch_verifications_pending (what `ckptwatch check` waits on) is 0 only when every
    verdict is in the loop's hands, including a submission that yields no verdict."""
    s = VerifySchedule(quiet=1.0)
    s.write_finished("/ckpt/a.pt", "job", now=0.0)
    assert s.pending() == 1
    s.write_started("/ckpt/a.pt", now=0.5)           # waits on a write, not on the verifier
    assert s.pending() == 0
    s.write_finished("/ckpt/a.pt", "job", now=0.6)
    assert [p for p, *_ in s.due(now=2.0)] == ["/ckpt/a.pt"] and s.pending() == 0

    path = tmp_path / "x.pt"
    path.write_bytes(b"not a checkpoint")
    v = Verifier()
    v.start()
    try:
        for _ in range(2):          # the second time the file is unchanged: no verdict
            assert v.submit(str(path))
            assert v.outstanding == 1
            wait_for(lambda: v._outbox.qsize(), timeout=10)
            assert v.outstanding == 1                 # answered, not yet drained
            v.drain()
            assert v.outstanding == 0
        assert v.unchanged_total == 1
    finally:
        v.stop()


def test_hook_reported_paths_cannot_crowd_out_a_watched_path():
    """A hostile sender naming 10,000+ paths must not push out of the schedule a file the
    agent's own watcher saw: watched paths have their own capacity."""
    s = VerifySchedule(quiet=1.0, max_paths=10000)
    s.write_started("/watched/ckpt.pt", now=0.0, watched=True)
    s.write_finished("/watched/ckpt.pt", "", now=0.5, watched=True)
    flooder = object()                 # a hook's Sender: only compared, never used to read
    for i in range(10050):
        s.write_started(f"/flood/{i}.pt", now=1.0, sender=flooder)
        s.write_finished(f"/flood/{i}.pt", "x", now=1.0)
    due = {p: readers for p, _, _, readers in s.due(100.0)}
    assert due.get("/watched/ckpt.pt", "missing") is None    # due, read with the agent's rights
    assert len(due) <= 10000 + 1


def test_hook_reported_paths_cannot_fill_the_queue_for_watched_ones():
    v = Verifier(max_queue=8)           # not started: the queue only fills
    flooder = object()
    for i in range(20):
        v.submit(f"/flood/{i}.pt", readers=(flooder,))
    assert v.skipped_total == 12
    assert v.submit("/watched/ckpt.pt", readers=None)


def test_a_verification_becomes_a_finding_with_every_journaled_field():
    """The agent hands a Verification to the exporters as a Finding (monitor.agent.daemon):
    its journal record carries every field but set_dir and unfinished_set, the kind's own after the common."""
    import dataclasses

    from monitor.agent.daemon import verification_finding
    from monitor.detect.model import FINDING_VERIFICATION
    from monitor.verify.worker import Verification
    v = Verification(path="/c/x.pt", result="corrupt", format="torch-zip",
                     reason="truncated: 10 of 20 bytes", cause="truncated", deep=True,
                     bytes=10, seconds=0.25, job="j1", collision_id="3f2a", wall=5.0,
                     set_dir="/c")
    finding = verification_finding(v)
    assert (finding.kind, finding.get("result"), finding.job) == \
        (FINDING_VERIFICATION, "corrupt", "j1")
    record = finding.to_record()
    fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)
              if f.name not in ("set_dir", "unfinished_set")}
    assert record == {"type": "verification", **fields}
    assert list(record)[:4] == ["type", "path", "job", "wall"]


# ---- files that are not files (issue 17 item 5) -------------------------------------------

def test_a_file_swapped_for_a_fifo_after_each_look_is_never_opened_blocking(tmp_path,
                                                                           monkeypatch):
    # The agent's verifier stat'ed the path, then integrity.verify stat'ed it again and
    # opened it by name: a FIFO renamed over it in between blocked the verifier thread for
    # good (old code: this test timed out).
    from racer import FifoRacer, bounded
    path = tmp_path / "shard.pt"
    path.write_bytes(b"PK\x05\x06" + bytes(18))
    v = Verifier()
    with FifoRacer(path, monkeypatch) as racer:
        finished, got = bounded(lambda: v.verify(str(path)), timeout=10)
        assert finished, "the verifier blocked opening a FIFO"
        assert racer.looks >= 1
    assert got.result == "unverifiable" and "FIFO" in got.reason


def test_a_watched_path_that_is_a_symbolic_link_is_not_followed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:$6$SECRET")
    link = tmp_path / "last.pt"
    link.symlink_to(secret)
    got = Verifier().verify(str(link))          # readers=None: the agent's own rights
    assert got.result == "unverifiable" and "symbolic link" in got.reason


def test_a_held_write_is_verified_after_its_job_scope_collision_and_names_it():
    """A write of a job spanning nodes is held for the job-scope settle: its collision, which
    comes only then, is named in the verdict (issue 16: collision_id empty for job scope)."""
    s = VerifySchedule(quiet=2.0)
    s.write_finished("/ckpt/last.pt", "j1", now=10.0, hold=3.5)
    assert s.due(12.5) == []                       # quiet passed, the hold not yet
    s.collided("/ckpt/last.pt", "jabc", now=14.0)   # the job-scope collision, after job_settle
    assert [(p, c) for p, _, c, _ in s.due(15.6)] == [("/ckpt/last.pt", "jabc")]
