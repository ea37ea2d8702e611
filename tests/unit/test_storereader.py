"""monitor.agent.storereader: the agent reads a job's store itself for the writes of a local
process that is gone without having read it (os._exit, SIGKILL right after a save), and the
hostile-input rules of the address a process names (ckptwatch.events, the "jobscope" event's
store_host / store_port / settled).

Real TCPStore servers (torch, loopback) and real JobScope threads (tests/support/jobstore.py);
the agent side is a real Handover and StoreReader thread; what it would hand the detector is
taken from its results queue.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from ckptwatch.events import EventError, REJECT_INCOMPLETE, validate
from ckptwatch.jobkeys import log_key, parse_log, path_hash, run_prefix
from helpers import free_port, wait_for
from jobstore import SHARED, Rank, torch_key
from monitor.agent import storereader
from monitor.agent.storereader import Handover, StoreReader, process_gone


def jobscope_event(pid: int, host="127.0.0.1", port=29500, **extra) -> dict:
    event = {"v": 1, "type": "jobscope", "node": "node-a", "pid": pid, "state": "active",
             "reason": None, "rank": 0, "job": "job-1", "master": "127.0.0.1:29500",
             "restart": 0, "wall": time.time(), "store_host": host, "store_port": port}
    event.update(extra)
    return event


# ---- the address a process names: hostile values -------------------------------------------

@pytest.mark.parametrize("host, port", [
    ("127.0.0.1", 29500), ("::1", 1), ("fe80::1%eth0", 65535), ("node-a", 29500),
    ("node-a.cluster.local", 29500), ("master_0.example.", 29500), ("a" * 63, 29500),
])
def test_a_store_address_of_the_right_form_is_taken(host, port):
    assert validate(jobscope_event(1234, host, port))["store_host"] == host


@pytest.mark.parametrize("host, port", [
    ("127.0.0.1", 0), ("127.0.0.1", 65536), ("127.0.0.1", -1), ("127.0.0.1", True),
    ("127.0.0.1", 29500.0), ("127.0.0.1", "29500"), ("127.0.0.1", None),
    (None, 29500), ("", 29500), ("a" * 64, 29500), (".".join(["a" * 50] * 6), 29500),
    ("evil host", 29500), ("host;rm -rf /", 29500), ("host\n", 29500), ("-host", 29500),
    ("127.0.0.1:29500", 29500), ("[::1]", 29500), ("h\u00f6st", 29500), ("a/b", 29500),
    ("\x00", 29500), (["127.0.0.1"], 29500), ("x" * 100000, 29500), (1234, 29500),
])
def test_a_store_address_of_any_other_form_rejects_the_event(host, port):
    with pytest.raises(EventError) as caught:
        validate(jobscope_event(1234, host, port))
    assert caught.value.reason == REJECT_INCOMPLETE


@pytest.mark.parametrize("settled", [1, "yes", [], {}, 0.0])
def test_settled_is_a_boolean_or_nothing(settled):
    with pytest.raises(EventError):
        validate(jobscope_event(1234, settled=settled))
    assert validate(jobscope_event(1234, settled=True))["settled"] is True


class _RecordingReader:
    """A StoreReader stand-in that takes every Follow handed to it."""

    def __init__(self):
        self.handed = []

    def submit(self, follow):
        self.handed.append(follow)
        return True


def recording_handover(gone, window: float = 2.0) -> tuple:
    """(a Handover, the list of Follows it hands over)."""
    reader = _RecordingReader()
    return Handover(reader, window=window, gone=gone), reader.handed


def test_the_hand_over_keeps_no_address_it_would_not_connect_to():
    handover, handed = recording_handover(lambda pid: True)
    # Not validated on the way in (a test calling it directly): the hand-over checks again.
    for pid, host, port in ((11, "bad host", 1), (12, "127.0.0.1", 70000), (13, None, None)):
        handover.announced(jobscope_event(pid, host, port), "node-a")
        handover.wrote({"type": "end", "pid": pid, "seq": 1, "path": "/p", "wall": 2.0,
                        "mono": 2.0, "start_wall": 1.0, "start_mono": 1.0, "outcome": "ok"})
        assert handover.hung_up(pid, 2.5, 2.5) == 0
    assert handed == []


# ---- who is read for -----------------------------------------------------------------------

def test_only_a_gone_process_that_did_not_settle_is_read_for():
    gone = {21: True, 22: False, 23: True}
    handover, handed = recording_handover(gone.__getitem__)
    for pid in gone:
        handover.announced(jobscope_event(pid), "node-a")
        handover.wrote({"type": "start", "pid": pid, "seq": 1, "path": "/s/a.pt",
                        "wall": 100.0, "mono": 10.0})
        handover.wrote({"type": "end", "pid": pid, "seq": 1, "path": "/s/a.pt", "wall": 100.5,
                        "mono": 10.5, "start_wall": 100.0, "start_mono": 10.0,
                        "outcome": "ok", "bytes": 7})
        handover.wrote({"type": "start", "pid": pid, "seq": 2, "path": "/s/b.pt",
                        "wall": 101.0, "mono": 11.0})
    handover.announced(jobscope_event(23, settled=True), "node-a")   # read all at its exit
    assert handover.hung_up(22, 12.0, 102.0) == 0                   # alive: its own scope reads
    assert handover.hung_up(23, 12.0, 102.0) == 0
    assert handover.hung_up(21, 12.0, 102.0) == 2
    ended, lost = sorted(handed, key=lambda f: f.seq)
    assert (ended.path, ended.ew, ended.em, ended.outcome, ended.size) == \
        ("/s/a.pt", 100.5, 10.5, "ok", 7)
    # In flight when it died: lost at the hang-up, as the detector ends it.
    assert (lost.path, lost.ew, lost.em, lost.outcome) == ("/s/b.pt", 102.0, 12.0, "lost")
    assert ended.key == log_key(run_prefix(ended.ident), path_hash("/s/a.pt"))
    assert handover.hung_up(21, 12.0, 102.0) == 0                   # once


def test_writes_that_came_before_the_jobscope_event_are_read_for():
    """The hook queues its "jobscope" event for its sender thread, so a save's start and end can
    reach the agent first (then the process os._exits): those writes are kept for the
    announcement, bounded, and handed over like the others (they were dropped: the other
    node's write was never learnt, tests/e2e/test_groundtruth.py y1 under load)."""
    handover, handed = recording_handover(lambda pid: True)
    handover.wrote({"type": "start", "pid": 41, "seq": 1, "path": "/s/y1.pt",
                    "wall": 100.0, "mono": 10.0})
    handover.wrote({"type": "end", "pid": 41, "seq": 1, "path": "/s/y1.pt", "wall": 100.1,
                    "mono": 10.1, "start_wall": 100.0, "start_mono": 10.0, "outcome": "ok"})
    handover.announced(jobscope_event(41), "node-b")
    assert handover.hung_up(41, 10.2, 100.2) == 1
    (follow,) = handed
    assert (follow.path, follow.outcome, follow.ident["node"]) == ("/s/y1.pt", "ok", "node-b")
    # A process that never announces is forgotten at its hang-up, and their number is bounded.
    handover.wrote({"type": "start", "pid": 42, "seq": 1, "path": "/s/x.pt",
                    "wall": 100.0, "mono": 10.0})
    assert handover.hung_up(42, 10.2, 100.2) == 0 and 42 not in handover._unannounced
    for pid in range(1000, 1000 + storereader.MAX_UNANNOUNCED + 50):
        handover.wrote({"type": "start", "pid": pid, "seq": 1, "path": "/s/x.pt",
                        "wall": 100.0, "mono": 10.0})
    assert len(handover._unannounced) == storereader.MAX_UNANNOUNCED


def test_a_handed_over_write_names_its_writer_as_its_events_did():
    """The hand-over keeps each write compactly (storereader: a list, the writer's fields a
    tuple) and rebuilds the writer's identity for the Follow: every field as its event named
    it, None for a field the event left out, the node its process claimed (before or after
    the write). Held to the dict it was built as before (issue 22)."""
    handover, handed = recording_handover(lambda pid: True)
    full = {"rank": 3, "local_rank": 1, "job": "job-1", "master": "10.0.0.1:29500",
            "restart": 2}
    handover.wrote({"type": "start", "pid": 51, "seq": 1, "path": "/s/a.pt", "wall": 100.0,
                    "mono": 10.0, **full})                  # before the announcement
    handover.announced(jobscope_event(51), "node-b")
    handover.wrote({"type": "end", "pid": 51, "seq": 1, "path": "/s/a.pt", "wall": 100.5,
                    "mono": 10.5, "start_wall": 100.0, "start_mono": 10.0, "outcome": "ok",
                    "bytes": 9, **full})
    handover.wrote({"type": "end", "pid": 51, "seq": 2, "path": "/s/b.pt", "wall": 101.5,
                    "mono": 11.5, "start_wall": 101.0, "start_mono": 11.0,
                    "outcome": "OSError", "rank": 3})       # a lone end, most fields left out
    assert handover.hung_up(51, 12.0, 102.0) == 2
    first, second = sorted(handed, key=lambda f: f.seq)
    assert first.ident == {"node": "node-b", "pid": 51, **full}
    assert (first.sw, first.sm, first.ew, first.em, first.outcome, first.size) == \
        (100.0, 10.0, 100.5, 10.5, "ok", 9)
    assert second.ident == {"node": "node-b", "pid": 51, "rank": 3, "local_rank": None,
                            "job": None, "master": None, "restart": None}
    assert (second.path, second.sw, second.ew, second.outcome, second.size) == \
        ("/s/b.pt", 101.0, 101.5, "OSError", None)


def test_a_write_older_than_two_windows_is_not_read_for():
    """Two windows after its end (clean-up) the process's own job scope reads no more for a
    write; before that it may, a chain going on (a rank SIGTERMed 2.07 s after a save, with
    another node's save 1.2 s after it, in a 2 s window: seed 3 of bench/groundtruth.py)."""
    handover, handed = recording_handover(lambda pid: True)
    handover.announced(jobscope_event(31), "node-a")
    handover.wrote({"type": "end", "pid": 31, "seq": 1, "path": "/s/old.pt", "wall": 100.0,
                    "mono": 10.0, "start_wall": 99.0, "start_mono": 9.0, "outcome": "ok"})
    handover.wrote({"type": "end", "pid": 31, "seq": 2, "path": "/s/recent.pt", "wall": 102.0,
                    "mono": 12.0, "start_wall": 101.0, "start_mono": 11.0, "outcome": "ok"})
    assert handover.hung_up(31, 14.07, 104.07) == 1
    assert [f.path for f in handed] == ["/s/recent.pt"]


def test_what_is_remembered_is_bounded(monkeypatch):
    monkeypatch.setattr(storereader, "MAX_PROCS", 4)
    monkeypatch.setattr(storereader, "MAX_WRITES_PER_PROC", 3)
    handover, handed = recording_handover(lambda pid: True, window=60.0)
    for pid in range(1, 11):
        handover.announced(jobscope_event(pid), "node-a")
        for seq in range(1, 9):
            handover.wrote({"type": "start", "pid": pid, "seq": seq, "path": f"/s/{seq}",
                            "wall": 100.0, "mono": 10.0})
    assert len(handover._procs) == 4
    assert sum(handover.hung_up(pid, 11.0, 101.0) for pid in range(1, 11)) == 4 * 3
    assert sorted({f.seq for f in handed}) == [6, 7, 8]


def test_process_gone_tells_a_live_process_from_a_zombie_and_a_reaped_one():
    assert process_gone(os.getpid()) is False
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: process_gone(child.pid), message="the child a zombie")
    assert open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] == "Z"
    child.wait()
    assert process_gone(child.pid) is True


# ---- the reader against a real store ---------------------------------------------------------

class Agent:
    """A Handover and its StoreReader as the agent runs them (node-a), for process `pid`."""

    def __init__(self, port: int, window: float = 2.0, **kw):
        self.reader = StoreReader("node-a", window, **kw).start()
        self.handover = Handover(self.reader, window, gone=lambda pid: True)
        self.port = port

    def adopt(self, rank: Rank) -> None:
        """rank's process told its agent where its store is (as its jobscope event does)."""
        self.handover.announced(jobscope_event(rank.ident["pid"], port=self.port),
                                rank.ident["node"])

    def events(self, rank: Rank, pending, end=None) -> None:
        """rank's start (and end) events of its write `pending`, as the agent received them."""
        i, seq, path, _, _, wall, mono = pending
        base = {"pid": i["pid"], "seq": seq, "path": path, "rank": i["rank"],
                "local_rank": i["local_rank"], "job": i["job"], "master": i["master"],
                "restart": i["restart"]}
        self.handover.wrote(dict(base, type="start", wall=wall, mono=mono))
        if end is not None:
            self.handover.wrote(dict(base, type="end", wall=end[0], mono=end[1],
                                     start_wall=wall, start_mono=mono, outcome="ok",
                                     bytes=4096))

    def results(self) -> list:
        out = []
        while not self.reader.results.empty():
            out.append(self.reader.results.get_nowait())
        return out

    def close(self) -> None:
        self.reader.stop()


@pytest.mark.torch
def test_the_agent_reports_what_a_gone_process_would_have(job_store):
    """node-a's rank writes with node-b's rank at once and "dies" right after (its job scope
    never reads): the agent's reader reports node-b's write exactly as the rank's own job scope
    reports it (the same fields: the same id and writer set on every agent)."""
    a = Rank(job_store.port, "node-a", 0, 0)
    b = Rank(job_store.port, "node-b", 2, 0)
    agent = Agent(job_store.port)
    try:
        wait_for(lambda: a.active() and b.active(), message="connected")
        agent.adopt(a)
        path = os.path.join(SHARED, "dies.pt")
        pa, pb = a.begin(path), b.begin(path)
        key = torch_key(log_key(run_prefix(a.ident), path_hash(path)))
        wait_for(lambda: job_store.get(key).count(b'"k":"s"') == 2, message="both starts")
        end_a = (time.time(), time.monotonic())
        a.scope.ended(pa, end_a[0], end_a[1], "ok", 4096)
        b.end(pb)
        agent.events(a, pa, end_a)
        assert agent.handover.hung_up(a.ident["pid"], time.monotonic(), time.time()) == 1
        got = wait_for(agent.results, message="the agent's report")
        own = wait_for(lambda: a.of_type("remote"), message="the rank's own report")
        assert len(got) == 1
        theirs, ours = own[0], got[0]
        assert ours["node"] == "node-a" and ours["pid"] == a.ident["pid"]
        assert ours["writer"]["node"] == "node-b" and ours["overlap"] is True
        for field in ("seq", "path", "writer", "wseq", "start_wall", "end_wall", "bytes",
                      "outcome", "overlap", "shared"):
            assert ours[field] == theirs[field], field
        assert validate(ours) is ours
        # Followed on: nothing is reported twice.
        time.sleep(storereader.POLL_FIRST * 2)
        assert agent.results() == [] and agent.reader.counters["reads"] >= 2
    finally:
        agent.close()


@pytest.mark.torch
def test_a_dead_writers_open_write_ends_in_the_log_where_its_agent_ends_it(job_store):
    """node-a's rank dies while it writes (its end line never comes): its agent appends it,
    lost at the hang-up, and node-b's rank, waiting on the open write, then reports it."""
    a = Rank(job_store.port, "node-a", 0, 0)
    b = Rank(job_store.port, "node-b", 2, 0)
    agent = Agent(job_store.port)
    try:
        wait_for(lambda: a.active() and b.active(), message="connected")
        agent.adopt(a)
        path = os.path.join(SHARED, "killed.pt")
        pa, pb = a.begin(path), b.begin(path)
        key = torch_key(log_key(run_prefix(a.ident), path_hash(path)))
        wait_for(lambda: job_store.get(key).count(b'"k":"s"') == 2, message="both starts")
        b.end(pb)
        agent.events(a, pa)                  # its start only: then SIGKILL
        wait_for(lambda: b.scope.counters["reads"] >= 2, message="b follows the open group")
        assert b.of_type("remote") == []
        hangup = (time.monotonic(), time.time())
        assert agent.handover.hung_up(a.ident["pid"], *hangup) == 1
        wait_for(lambda: agent.reader.counters["ended"] == 1, message="the end appended")
        logged = {w.node: w for w in parse_log(job_store.get(key))}
        assert logged["node-a"].outcome == "lost"
        assert logged["node-a"].ew == float(f"{hangup[1]:.6f}")
        report = wait_for(lambda: b.of_type("remote"), message="b's report of a")[0]
        assert report["writer"]["node"] == "node-a" and report["outcome"] == "lost"
        assert report["overlap"] is True
        # node-a's agent reports b's write for the dead one too.
        assert [e["writer"]["node"] for e in wait_for(agent.results, message="report")] == \
            ["node-b"]
        # Appended once, however often it reads.
        time.sleep(storereader.FOLLOW_FIRST * 4)
        assert job_store.get(key).count(b'"k":"e"') == 2
    finally:
        agent.close()


def test_a_store_that_is_not_there_or_does_not_answer_costs_bounded_time(monkeypatch):
    """Nobody listens at one address, a silent server at the other: the loop's side never
    waits, the reader gives each up within its deadline and backs off."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    dead_port = free_port()
    agent = Agent(dead_port, window=1.0, op_timeout=0.2)
    try:
        for pid, port in ((41, dead_port), (42, silent.getsockname()[1])):
            agent.handover.announced(jobscope_event(pid, port=port), "node-a")
            agent.handover.wrote({"type": "end", "pid": pid, "seq": 1, "path": "/s/x.pt",
                                  "wall": time.time(), "mono": time.monotonic(),
                                  "start_wall": time.time(), "start_mono": time.monotonic(),
                                  "outcome": "ok"})
            began = time.monotonic()
            assert agent.handover.hung_up(pid, time.monotonic(), time.time()) == 1
            assert time.monotonic() - began < 0.1            # the loop never waits
        wait_for(lambda: agent.reader.counters["errors"] >= 2, timeout=5,
                 message="both stores given up")
        wait_for(lambda: agent.reader.following == 0, timeout=10,
                 message="the follows given up at their horizon")
        assert agent.results() == []
        assert agent.reader.counters["errors"] <= 6          # backed off, not hammered
    finally:
        agent.close()
        silent.close()
