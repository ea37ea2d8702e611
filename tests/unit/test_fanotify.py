"""fanotify attribution: the kernel interface against the real kernel (skipped where the
agent could not use it either: no CAP_SYS_ADMIN), and ExactAttribution + the tracker's
exact-writers mode as pure logic."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from helpers import wait_for
from ckptwatch import events
from monitor.fs import fanotify
from monitor.fs.fanotify import (FAN_CLOSE_NOWRITE, FAN_CLOSE_WRITE, FAN_MODIFY, FAN_OPEN,
                              FanEvent, FanotifyWatcher)
from monitor.fs.tracker import ExactAttribution, WriteTracker
from monitor.fs.watch import FsEvent
from monitor.detect.model import Writer
from monitor.fs.procscan import Holder, ProcScanner


WHY_NOT = fanotify.available("/tmp")[1]       # '' when this process can mark mounts
needs_fanotify = pytest.mark.skipif(bool(WHY_NOT), reason=f"fanotify: {WHY_NOT}")


# --------------------------------------------------------------------- the real kernel

class _Collect:
    def __init__(self):
        self.events: list[FanEvent] = []
        self.overflows = 0
        self.lock = threading.Lock()

    def event(self, ev):
        with self.lock:
            self.events.append(ev)

    def overflow(self):
        self.overflows += 1

    def of(self, path):
        with self.lock:
            return [e for e in self.events if e.path == path]


@pytest.fixture
def fan_watch(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    got = _Collect()
    w = FanotifyWatcher([str(root)], got.event, got.overflow)
    w.start()
    yield w, str(os.path.realpath(root)), got
    w.stop()


WRITE_ONCE = "import sys; open(sys.argv[1], 'wb').write(b'x' * 100)"


@needs_fanotify
def test_a_write_of_microseconds_is_named_with_its_pid(fan_watch):
    w, root, got = fan_watch
    path = os.path.join(root, "sub", "a.pt")
    os.makedirs(os.path.dirname(path))            # a directory made after the mark: covered
    child = subprocess.run([sys.executable, "-c", WRITE_ONCE, path], timeout=30)
    assert child.returncode == 0
    evs = wait_for(lambda: [e for e in got.of(path) if e.mask & FAN_CLOSE_WRITE], timeout=5,
                   message="close_write")
    mine = got.of(path)
    # The child's pid, not ours (the parent never touched the file).
    assert {e.pid for e in mine} == {e.pid for e in evs} and os.getpid() not in \
        {e.pid for e in mine}
    masks = 0
    for e in mine:
        masks |= e.mask
    assert masks & FAN_OPEN and masks & FAN_CLOSE_WRITE
    assert [e.mono for e in mine] == sorted(e.mono for e in mine)     # queue order


@needs_fanotify
def test_files_outside_the_roots_and_this_agents_own_are_dropped(fan_watch, tmp_path):
    w, root, got = fan_watch
    outside = tmp_path / "elsewhere.pt"          # same mount, outside the root
    subprocess.run([sys.executable, "-c", WRITE_ONCE, str(outside)], check=True, timeout=30)
    mine = os.path.join(root, "mine.pt")
    with open(mine, "wb") as f:                  # the agent's own pid (its verifier reads)
        f.write(b"y")
    # Inside the root any name is passed on: a temporary file may become a checkpoint.
    temp = os.path.join(root, "tmpx1y2")
    subprocess.run([sys.executable, "-c", WRITE_ONCE, temp], check=True, timeout=30)
    wait_for(lambda: got.of(temp), timeout=5, message="temp file event")
    assert got.of(str(outside)) == [] and got.of(mine) == []
    assert w.stats()["unrelated"] > 0 and w.stats()["relevant"] >= 1


ATOMIC = """
import os, sys
tmp = sys.argv[1] + ".tmp"
with open(tmp, "wb") as f:
    f.write(b"x" * 100)
os.replace(tmp, sys.argv[1])
"""


@needs_fanotify
def test_names_are_those_at_the_event_not_at_the_read(tmp_path):
    """The agent reads after the temporary file was renamed onto the checkpoint: the write
    must still be reported under the temporary name (a descriptor would now resolve to the
    checkpoint, and two ranks' temporary files would look like a concurrent collision)."""
    fan = fanotify.Fanotify()
    try:
        fan.mark_mount(str(tmp_path))
        dest = os.path.join(os.path.realpath(tmp_path), "model.pt")
        subprocess.run([sys.executable, "-c", ATOMIC, dest], check=True, timeout=30)
        events = []
        while batch := fan.read():
            events += batch
        mine = [(m, path) for m, pid, path in events if path and path.startswith(dest)]
        written = {path for m, path in mine if m & (FAN_MODIFY | FAN_CLOSE_WRITE)}
        assert written == {dest + ".tmp"}, mine
    finally:
        fan.close()


@needs_fanotify
def test_the_kernel_reports_a_queue_overflow(tmp_path):
    """More than max_queued_events unread: the kernel queues FAN_Q_OVERFLOW, and the
    watcher turns it into on_overflow (the agent rescans)."""
    fan = fanotify.Fanotify()
    try:
        fan.mark_mount(str(tmp_path))
        with open("/proc/sys/fs/fanotify/max_queued_events") as f:
            limit = int(f.read())
        # Events of one file and pid merge while unread (open, write and close become one
        # event), so distinct files, one event each.
        for i in range(limit + 100):
            with open(tmp_path / f"p{i}.pt", "wb") as f:
                f.write(b"z")
        masks = []
        while batch := fan.read():
            masks += [m for m, _, _ in batch]
        assert any(m & fanotify.FAN_Q_OVERFLOW for m in masks)
    finally:
        fan.close()
    got = _Collect()
    w = FanotifyWatcher([str(tmp_path)], got.event, got.overflow)
    w._handle([(fanotify.FAN_Q_OVERFLOW, -1, None)])
    assert got.overflows == 1 and w.stats()["overflows"] == 1


def test_without_privilege_start_raises_a_clear_error(monkeypatch):
    class Denied:
        def __init__(self):
            raise OSError(1, "fanotify_init: Operation not permitted")
    monkeypatch.setattr(fanotify, "Fanotify", Denied)
    w = FanotifyWatcher(["/tmp"], lambda e: None, lambda: None)
    with pytest.raises(OSError) as info:
        w.start()
    assert "CAP_SYS_ADMIN" in fanotify.why(info.value)


# --------------------------------------------------------------------- pure logic

def _fe(mask, pid, t, path="/c/a.pt"):
    return FanEvent(mask, pid, path, 1000.0 + t, 1.7e9 + t)


def _describe(pid, mode):
    return Holder(Writer("n1", pid, rank=pid % 10, job="j"), mode)


def _exact():
    tracker = WriteTracker(node="n1", exact_writers=True)
    return tracker, ExactAttribution(tracker, _describe, lambda p: p.endswith(".pt"))


def test_merged_events_keep_the_overlap_the_opens_show():
    """A opens, B opens, then the kernel delivers A's writes and close merged into one
    event, and B's too: the writes started at the opens, so they overlap."""
    tracker, exact = _exact()
    out = exact.observe(_fe(FAN_OPEN, 1, 0))
    out += exact.observe(_fe(FAN_OPEN, 2, 1))
    out += exact.observe(_fe(FAN_MODIFY | FAN_CLOSE_WRITE, 1, 2))
    out += exact.observe(_fe(FAN_MODIFY | FAN_CLOSE_WRITE, 2, 3))
    for e in out:
        assert events.validate(e) is e and e["source"] == "fs"
    spans = {}
    for e in out:
        spans.setdefault(e["pid"], {})[e["type"]] = e["mono"]
    assert spans == {1: {"start": 1000.0, "end": 1002.0}, 2: {"start": 1001.0, "end": 1003.0}}
    assert tracker.writing("/c/a.pt") == []


def test_a_whole_write_merged_into_one_event_spans_from_the_previous_read():
    """The agent read too late to see the opens apart: each save arrives as one event
    (open+modify+close). All that is known is that both happened after `since`: the writes
    are taken to span [since, read], so two of them overlap."""
    tracker, exact = _exact()
    whole = FAN_OPEN | FAN_MODIFY | FAN_CLOSE_WRITE
    out = exact.observe(FanEvent(whole, 1, "/c/a.pt", 1005.0, 1.7e9 + 5, 1004.0, 1.7e9 + 4))
    out += exact.observe(FanEvent(whole, 2, "/c/a.pt", 1005.1, 1.7e9 + 5.1, 1004.0,
                                  1.7e9 + 4))
    spans = {(e["pid"], e["type"]): e["mono"] for e in out}
    assert spans == {(1, "start"): 1004.0, (1, "end"): 1005.0,
                     (2, "start"): 1004.0, (2, "end"): 1005.1}
    assert spans[(2, "start")] < spans[(1, "end")]


def test_a_second_live_writer_starts_while_the_first_writes():
    """The two intervals overlap: the detector makes that a concurrent collision."""
    tracker, exact = _exact()
    exact.observe(_fe(FAN_OPEN, 1, 0))
    exact.observe(_fe(FAN_MODIFY, 1, 0.1))
    out = exact.observe(_fe(FAN_MODIFY, 2, 0.2))          # no open seen: starts now
    assert [(e["type"], e["pid"], e["rank"]) for e in out] == [("start", 2, 2)]
    assert out[0]["mono"] == 1000.2
    assert tracker.writing("/c/a.pt") == [1, 2]
    # More writes of a known writer change nothing; its close ends it.
    assert exact.observe(_fe(FAN_MODIFY, 1, 0.3)) == []
    (end,) = exact.observe(_fe(FAN_CLOSE_WRITE, 1, 0.4))
    assert (end["type"], end["pid"], end["outcome"]) == ("end", 1, "ok")


def test_reads_are_not_writes_and_an_empty_write_open_is():
    tracker, exact = _exact()
    assert exact.observe(_fe(FAN_OPEN, 3, 0)) == []
    assert exact.observe(_fe(FAN_CLOSE_NOWRITE, 3, 1)) == []
    assert tracker.writing("/c/a.pt") == []
    # Opened for writing, nothing written (O_TRUNC of an empty file): still a write.
    exact.observe(_fe(FAN_OPEN, 4, 2))
    out = exact.observe(_fe(FAN_CLOSE_WRITE, 4, 3))
    assert [(e["type"], e["mono"]) for e in out] == [("start", 1002.0), ("end", 1003.0)]


def test_exact_mode_needs_no_scan_and_a_scan_never_overrules_the_kernel():
    """With fanotify no inotify event asks for a /proc scan (issue 22: the kernel names
    writers and readers); a scan's holders, if given, still find readers but neither start
    nor end writers, and only a rescan after lost events decides writers."""
    tracker, exact = _exact()
    exact.observe(_fe(FAN_MODIFY, 1, 0))
    for kind in ("opened", "modified", "closed_write", "closed_nowrite", "created"):
        assert not tracker.needs_attribution(FsEvent(kind, "/c/a.pt", 0, 1000.1, 0.0))
    reader = Holder(Writer("n1", 9, job="eval"), "r")
    stray = Holder(Writer("n1", 7), "w")                  # a writer only the scan shows
    out = tracker.observe(FsEvent("opened", "/c/a.pt", 10, 1000.2, 0.0), [reader, stray])
    assert [f.kind for f in out] == ["torn_read"]
    assert tracker.writing("/c/a.pt") == [1]
    # An unattributed inotify close does not end the only writer on a guess.
    assert tracker.observe(FsEvent("closed_write", "/c/a.pt", 10, 1000.3, 0.0)) == []
    assert tracker.writing("/c/a.pt") == [1]
    # A rescan after lost events does decide writers.
    out = tracker.observe(FsEvent("modified", "/c/a.pt", 10, 1000.4, 0.0), [],
                          reconcile_writers=True)
    assert [(e["type"], e["pid"]) for e in out] == [("end", 1)]


def _torn(out):
    return [(f.writers[0]["pid"] if f.writers else None, f.details["reader"]["pid"])
            for f in out if getattr(f, "kind", None) == "torn_read"]


def test_a_read_while_another_process_writes_is_a_torn_read_at_its_close():
    tracker, exact = _exact()
    out = exact.observe(_fe(FAN_OPEN | FAN_MODIFY, 1, 0))        # 1 writes
    out += exact.observe(_fe(FAN_OPEN, 3, 1))                    # 3 opens: reader or writer?
    assert _torn(out) == []
    out += exact.observe(_fe(FAN_CLOSE_NOWRITE, 3, 2))           # a reader
    assert _torn(out) == [(1, 3)]
    finding = [f for f in out if getattr(f, "kind", None) == "torn_read"][0]
    assert finding.path == "/c/a.pt" and finding.details["reader"]["mode"] == "r"
    assert finding.details["mono"] == 1002.0


def test_a_write_begun_and_ended_during_a_read_tears_it():
    tracker, exact = _exact()
    out = exact.observe(_fe(FAN_OPEN, 3, 0))                     # 3 reads first
    out += exact.observe(_fe(FAN_OPEN | FAN_MODIFY, 1, 1))
    out += exact.observe(_fe(FAN_CLOSE_WRITE, 1, 2))             # 1 is done before 3 is
    out += exact.observe(_fe(FAN_CLOSE_NOWRITE, 3, 3))
    assert _torn(out) == [(1, 3)]
    # A read merged into one event (open and close) while 1 writes again: torn as well.
    out = exact.observe(_fe(FAN_OPEN | FAN_MODIFY, 1, 4))
    out += exact.observe(_fe(FAN_OPEN | FAN_CLOSE_NOWRITE, 4, 5))
    assert _torn(out) == [(1, 4)]


def test_reads_alone_an_own_read_and_a_writers_open_are_no_torn_reads():
    tracker, exact = _exact()
    out = exact.observe(_fe(FAN_OPEN, 3, 0))
    out += exact.observe(_fe(FAN_CLOSE_NOWRITE, 3, 1))           # nobody writes
    out += exact.observe(_fe(FAN_OPEN, 2, 2))                    # 2 opens, then writes:
    out += exact.observe(_fe(FAN_OPEN, 5, 3))
    out += exact.observe(_fe(FAN_MODIFY, 2, 4))                  # a writer, not a reader
    out += exact.observe(_fe(FAN_MODIFY, 5, 5))
    out += exact.observe(_fe(FAN_CLOSE_WRITE, 2, 6))
    out += exact.observe(_fe(FAN_OPEN | FAN_CLOSE_NOWRITE, 5, 7))  # the writer reads its own
    out += exact.observe(_fe(FAN_CLOSE_WRITE, 5, 8))
    assert _torn(out) == []
    assert [e["type"] for e in out] == ["start", "start", "end", "end"]


def test_open_reads_are_bounded():
    tracker = WriteTracker(node="n1", exact_writers=True)
    exact = ExactAttribution(tracker, _describe, max_pending=8)
    for pid in range(100, 150):
        exact.observe(_fe(FAN_OPEN, pid, pid, path=f"/c/{pid}.pt"))
    assert sum(len(r) for r in exact._reads.values()) <= 8
    exact.observe(_fe(FAN_OPEN | FAN_MODIFY, 1, 200, path="/c/149.pt"))
    out = exact.observe(_fe(FAN_CLOSE_NOWRITE, 149, 201, path="/c/149.pt"))
    assert _torn(out) == [(1, 149)]                             # the newest ones are kept


def test_describe_reads_a_live_process_and_survives_a_gone_one():
    scanner = ProcScanner(node="n9")
    env = {**os.environ, "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "jobx"}
    # The child says when it runs: described between fork and exec it would still carry this
    # process's environment, and the scanner keeps the first identity it reads per (pid, start
    # time) -- exec changes neither (docs/limitations.md).
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                              "time.sleep(30)"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        me = scanner.describe(child.pid, "w")
        assert (me.pid, me.mode, me.writer.rank, me.writer.local_rank, me.writer.job) == \
               (child.pid, "w", 3, 1, "jobx")
    finally:
        child.kill()
        child.wait()
    # Gone, but its identity was read while it lived: kept.
    gone = scanner.describe(child.pid, "w")
    assert (gone.pid, gone.writer.rank, gone.writer.job) == (child.pid, 3, "jobx")
    # Never seen alive: only the pid.
    never = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, env=env, check=True)
    unknown = scanner.describe(int(never.stdout), "w")
    assert (unknown.writer.rank, unknown.writer.node) == (None, "n9")


def _moved(src, dest, t, size=1000):
    return FsEvent("moved", src, size, 1000.0 + t, 1.7e9 + t, dest)


def test_an_atomic_save_is_its_temp_files_writer_taking_no_time():
    """write tmp, rename onto a.pt: a write of a.pt by the tmp's writer, at the rename, zero
    length -- two atomic saves never overlap, whoever renames."""
    tracker, exact = _exact()
    out = []
    for pid, t in ((1, 0), (2, 0.1)):                 # both ranks write their temps at once
        out += exact.observe(_fe(FAN_OPEN, pid, t, f"/c/tmp{pid}"))
    for pid, t in ((1, 0.2), (2, 0.3)):
        out += exact.observe(_fe(FAN_MODIFY | FAN_CLOSE_WRITE, pid, t, f"/c/tmp{pid}"))
    assert out == []                                   # temps are not checkpoints
    out += tracker.observe(_moved("/c/tmp1", "/c/a.pt", 0.4))
    out += tracker.observe(_moved("/c/tmp2", "/c/a.pt", 0.5))
    for e in out:
        assert events.validate(e) is e
    assert [(e["type"], e["pid"], e["path"], e["mono"]) for e in out] == [
        ("start", 1, "/c/a.pt", 1000.4), ("end", 1, "/c/a.pt", 1000.4),
        ("start", 2, "/c/a.pt", 1000.5), ("end", 2, "/c/a.pt", 1000.5)]
    assert out[1]["renamed_from"] == "/c/tmp1" and out[1]["bytes"] == 1000
    assert out[1]["start_mono"] == out[1]["mono"]
    assert tracker.counts["renames"] == 2


def test_a_rename_that_overtakes_its_writers_close_waits_for_it():
    tracker, exact = _exact()
    exact.observe(_fe(FAN_OPEN, 5, 0, "/c/tmp5"))
    assert tracker.observe(_moved("/c/tmp5", "/c/a.pt", 0.2)) == []     # inotify first
    out = exact.observe(_fe(FAN_MODIFY | FAN_CLOSE_WRITE, 5, 0.1, "/c/tmp5"))
    assert [(e["type"], e["pid"], e["mono"]) for e in out] == [("start", 5, 1000.2),
                                                               ("end", 5, 1000.2)]
    # A rename nobody's write explains is forgotten after RENAME_WAIT.
    assert tracker.observe(_moved("/c/tmpX", "/c/b.pt", 1)) == []
    tracker.observe(_moved("/c/tmpY", "/c/c.pt", 10))
    assert exact.observe(_fe(FAN_CLOSE_WRITE, 6, 10.1, "/c/tmpX")) == []


def test_a_checkpoint_renamed_keeps_its_writer():
    """A tracked checkpoint moved elsewhere (rotation) is attributed to its last writer: the
    same writer, so never a collision by itself."""
    tracker, exact = _exact()
    exact.observe(_fe(FAN_OPEN, 1, 0))
    exact.observe(_fe(FAN_CLOSE_WRITE, 1, 0.1))
    out = tracker.observe(_moved("/c/a.pt", "/c/prev.pt", 0.5))
    assert [(e["type"], e["pid"], e["path"]) for e in out] == [("start", 1, "/c/prev.pt"),
                                                               ("end", 1, "/c/prev.pt")]


def test_auto_falls_back_to_proc_and_forced_fanotify_is_a_clear_error(monkeypatch, tmp_path):
    from monitor.fs.source import FsSource

    class Denied:
        def __init__(self):
            raise OSError(1, "fanotify_init: Operation not permitted")
    monkeypatch.setattr(fanotify, "Fanotify", Denied)
    auto = FsSource([str(tmp_path)], ["*.pt"], "inotify", 1.0, "n1", lambda batch: None)
    auto.start()
    try:
        assert auto.attribution == "proc" and auto.fan is None
        assert not auto.tracker.exact_writers
        assert auto.stats()["attribution_method"] == "proc"
    finally:
        auto.stop()
    forced = FsSource([str(tmp_path)], ["*.pt"], "inotify", 1.0, "n1", lambda batch: None,
                      attribution="fanotify")
    with pytest.raises(OSError) as info:
        forced.start()
    assert "--watch.attribution fanotify" in str(info.value)
    assert "CAP_SYS_ADMIN" in str(info.value)
    with pytest.raises(ValueError):
        FsSource([str(tmp_path)], ["*.pt"], "inotify", 1.0, "n1", lambda b: None,
                 attribution="ebpf")


def test_since_bounds_idle_reads_by_the_wake_slack_and_bursts_by_the_last_drain():
    w = FanotifyWatcher(["/tmp"], lambda e: None, lambda: None)
    w._drained(True, 100.0)                      # a read at t=100 emptied the queue
    # Idle until t=3700: the events are at most WAKE_SLACK old, not an hour.
    assert w._since(3700.0) == 3700.0 - fanotify.WAKE_SLACK
    # Woken right after the drain: the drain is the tighter bound.
    assert w._since(100.01) == 100.0
    w._drained(False, 3700.0)                    # that read filled the buffer: a burst
    # The next read's events were queued before 3700 too: only the last drain bounds them.
    assert w._since(3700.2) == 100.0
    w._drained(True, 3700.2)
    assert w._since(3700.21) == 3700.2


@needs_fanotify
def test_a_read_reports_whether_it_emptied_the_queue(tmp_path):
    fan = fanotify.Fanotify()
    try:
        fan.mark_mount(str(tmp_path))
        for i in range(3000):                    # ~3,000 events: several reads' worth
            (tmp_path / f"q{i}.pt").write_bytes(b"z")
        flags = []
        while fan.read():
            flags.append(fan.drained)
        assert flags[0] is False and flags[-1] is True
    finally:
        fan.close()


# --------------------------------------------------------------------- /proc scans per save

SAVES = """
import sys
for i in range(int(sys.argv[2])):
    with open(sys.argv[1], "wb") as f:
        f.write(b"x" * 4096)
with open(sys.argv[1], "rb") as f:       # a reader of its own file: not a torn read
    f.read()
"""


@pytest.fixture
def fan_source(tmp_path):
    """(source, items): a started FsSource with fanotify attribution on tmp_path/ckpt and
    every item it delivered."""
    from monitor.fs.source import FsSource
    root = tmp_path / "ckpt"
    root.mkdir()
    items, lock = [], threading.Lock()

    def deliver(batch):
        with lock:
            items.extend(batch)
    src = FsSource([str(root)], ["*.pt"], "inotify", 1.0, "n1", deliver,
                   attribution="fanotify")
    src.start()
    yield src, str(os.path.realpath(root)), items
    src.stop()


def _ends(items, path):
    return [i for i in list(items) if isinstance(i, dict) and i["type"] == "end"
            and i["path"] == path]


@needs_fanotify
def test_saves_fanotify_named_cost_no_proc_scan(fan_source):
    """Issue 22: with fanotify naming every writer (and reader), the agent reads no
    /proc/<pid>/fd for a save: not for its open, its writes, its close, nor a read of it."""
    src, root, items = fan_source
    path = os.path.join(root, "a.pt")
    child = subprocess.run([sys.executable, "-c", SAVES, path, "5"], timeout=60)
    assert child.returncode == 0
    # (The kernel may merge one process's saves of one file into fewer events.)
    ends = wait_for(lambda: _ends(items, path), timeout=20, message="an attributed save")
    writers = {e["pid"] for e in ends}
    assert len(writers) == 1 and os.getpid() not in writers
    # Everything the watcher queued is handled before a marker written after the saves.
    marker = os.path.join(root, "marker.pt")
    with open(marker, "wb") as f:
        f.write(b"m")
    wait_for(lambda: any(getattr(i, "path", None) == marker for i in list(items)),
             timeout=20, message="the marker's notice")
    assert src.scanner.stats()["scans"] == 0
    assert not [i for i in list(items) if getattr(i, "kind", None) == "torn_read"]
