"""fswatch: real watchdog observers (inotify and polling) on real directories; the fs-side
WriteTracker fed by real processes and procscan."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from helpers import subprocess_env, wait_for
from ckptwatch import events
from monitor.fs import tracker as fstracker
from monitor.fs import watch as fswatch
from monitor.fs.tracker import WriteTracker
from monitor.fs.watch import FsEvent, Watcher
from monitor.detect.model import Finding, Writer
from monitor.fs.procscan import Holder, ProcScanner

MODES = ["inotify", "polling"]
POLL = 0.1


class FsEventLog:
    """Collects FsEvents and rescans from watcher threads."""

    def __init__(self):
        self.events: list[FsEvent] = []
        self.rescans: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, ev):
        with self.lock:
            self.events.append(ev)

    def rescan(self, root):
        with self.lock:
            self.rescans.append(root)

    def kinds(self, path):
        with self.lock:
            return [e.kind for e in self.events if e.target == path]

    def wait(self, kind, path, timeout=10):
        def found():
            with self.lock:
                return [e for e in self.events if e.kind == kind and e.target == path]
        return wait_for(found, timeout=timeout, message=f"{kind} {path}")[-1]


@pytest.fixture
def watch(tmp_path, no_thread_leak):
    """watch(mode, roots=None, **kw) -> (watcher, recorder), stopped after the test."""
    started = []

    def make(mode, roots=None, cls=Watcher, **kw):
        rec = FsEventLog()
        kw.setdefault("poll_interval", POLL)
        kw.setdefault("rearm_interval", POLL)
        w = cls(roots or [str(tmp_path)], mode=mode, on_event=rec, on_rescan=rec.rescan, **kw)
        started.append(w)
        w.start()
        return w, rec

    yield make
    for w in started:
        w.stop()


def write(path, data=b"x" * 1000):
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("mode", MODES)
def test_finished_write_seen_with_its_size(tmp_path, watch, mode):
    w, rec = watch(mode)
    path = str(tmp_path / "model.pt")
    write(path, b"x" * 1234)
    write(str(tmp_path / "notes.txt"))        # not a checkpoint pattern
    ev = rec.wait("closed_write", path)
    assert ev.size == 1234 and ev.wall > 0 and ev.mono > 0
    kinds = rec.kinds(path)
    if mode == "inotify":
        assert kinds[:2] == ["created", "opened"] and "modified" in kinds
    else:
        assert kinds[0] == "created" and w.stats()["synthetic_closes"] >= 1
    assert rec.kinds(str(tmp_path / "notes.txt")) == []
    assert w.stats()["roots"][str(tmp_path)]["mode"] == mode
    assert all(r["state"] == "watching" for r in w.stats()["roots"].values())


def test_a_path_named_by_a_hook_event_counts_whatever_its_name(tmp_path, watch):
    w, rec = watch("inotify")
    named, other = str(tmp_path / "weights.out"), str(tmp_path / "other.out")
    assert w.add_path(named)
    write(other)
    write(named)
    rec.wait("closed_write", named)
    assert rec.kinds(other) == []


def test_polling_reports_close_only_once_size_is_stable(tmp_path, watch):
    w, rec = watch("polling", poll_interval=0.2, rearm_interval=0.2)
    path = str(tmp_path / "slow.pt")
    with open(path, "wb") as f:
        for _ in range(20):           # keeps growing for ~5 polls, never idle for one
            f.write(b"x" * 100)
            f.flush()
            assert "closed_write" not in rec.kinds(path)
            threading.Event().wait(0.05)
    assert "created" in rec.kinds(path)
    assert rec.wait("closed_write", path).size == 2000
    assert rec.kinds(path).count("closed_write") == 1


@pytest.mark.parametrize("mode", MODES)
def test_recursive_and_new_subdirectories(tmp_path, watch, mode):
    os.makedirs(tmp_path / "old" / "deeper")
    w, rec = watch(mode)
    write(str(tmp_path / "old" / "deeper" / "a.safetensors"))
    rec.wait("closed_write", str(tmp_path / "old" / "deeper" / "a.safetensors"))
    os.makedirs(tmp_path / "new" / "step_100")
    path = str(tmp_path / "new" / "step_100" / "shard.distcp")
    # Directory watches are added asynchronously: retry the write until it is seen.
    wait_for(lambda: write(path) or rec.kinds(path), timeout=10, interval=0.2)
    rec.wait("closed_write", path)


@pytest.mark.parametrize("mode", MODES)
def test_root_deleted_and_recreated_is_watched_again(tmp_path, watch, mode):
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    w, rec = watch(mode, roots=[root])
    write(os.path.join(root, "a.pt"))
    rec.wait("closed_write", os.path.join(root, "a.pt"))
    shutil.rmtree(root)
    rec.wait("root_lost", root)
    assert {p: r["state"] for p, r in w.stats()["roots"].items()} == {root: "lost"}
    os.makedirs(root)
    wait_for(lambda: all(r["state"] == "watching" for r in w.stats()["roots"].values()), timeout=10)
    assert rec.rescans == [root]
    path = os.path.join(root, "b.pt")
    write(path, b"y" * 77)
    assert rec.wait("closed_write", path).size == 77
    stats = w.stats()
    assert stats["root_losses"] == 1 and stats["rearms"] == 1
    assert stats["roots"][root]["mode"] == mode and stats["roots"][root]["rearms"] == 1


def test_missing_root_is_armed_when_it_appears(tmp_path, watch):
    root = str(tmp_path / "later")
    w, rec = watch("auto", roots=[root])
    assert {p: r["state"] for p, r in w.stats()["roots"].items()} == {root: "missing"}
    os.makedirs(root)
    wait_for(lambda: all(r["state"] == "watching" for r in w.stats()["roots"].values()), timeout=10)
    path = os.path.join(root, "x.ckpt")
    write(path)
    rec.wait("closed_write", path)


def _overflow_event():
    from watchdog.observers.inotify_c import InotifyConstants, InotifyEvent
    return InotifyEvent(-1, InotifyConstants.IN_Q_OVERFLOW, 0, b"")


def test_overflow_through_watchdogs_path_counts_and_rescans(tmp_path, watch):
    os.makedirs(tmp_path / "sub")
    w, rec = watch("inotify")
    # What watchdog's reader thread does with a kernel IN_Q_OVERFLOW record (wd == -1).
    w._inotify._inotify_fd.handle_event(_overflow_event())
    ev = rec.wait("overflow", str(tmp_path))
    assert ev.size is None
    wait_for(lambda: rec.rescans == [str(tmp_path)], timeout=5)
    assert w.stats()["events_lost"] == 1
    # watchdog rebuilt the recursive watches: events below the root still arrive.
    path = str(tmp_path / "sub" / "after.pt")
    write(path)
    rec.wait("closed_write", path)


def test_overflow_of_a_real_kernel_queue(tmp_path, watch):
    knob = "/proc/sys/fs/inotify/max_queued_events"
    try:
        with open(knob) as f:
            old = f.read().strip()
        # The limit is read when an inotify instance is created: shrink it only around
        # the start of our watcher (other processes on the host share it), then restore.
        with open(knob, "w") as f:
            f.write("16")
    except OSError:
        pytest.skip(f"{knob} is not writable here")
    try:
        w, rec = watch("inotify")
    finally:
        with open(knob, "w") as f:
            f.write(old)
    # Hold watchdog's reader thread still (it takes this lock per event) while the kernel
    # queue fills up, so the overflow happens whatever the machine's load.
    with w._inotify._inotify_fd._lock:
        for i in range(40):
            write(str(tmp_path / f"f{i}.pt"), b"x")
    wait_for(lambda: w.stats()["events_lost"] >= 1, timeout=10)
    rec.wait("overflow", str(tmp_path))
    wait_for(lambda: rec.rescans, timeout=5)
    # A storm of overflows is one rescan per rearm_interval, not one per overflow.
    assert len(rec.rescans) <= w.stats()["overflows"]


class _FullObserver(fswatch._InotifyObserver):
    """An inotify observer whose schedule fails as when max_user_watches is exhausted."""

    def schedule(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "inotify watch limit reached")


class _NoWatchLeftWatcher(Watcher):
    def _make_inotify_observer(self):
        return _FullObserver(self._note_overflow, self._note_limit)


def test_watch_limit_on_the_root_falls_back_to_polling(tmp_path, watch, caplog):
    w, rec = watch("auto", cls=_NoWatchLeftWatcher)
    root = w.stats()["roots"][str(tmp_path)]
    assert (root["mode"], root["fallback"], root["state"]) == ("polling", "watch_limit",
                                                               "watching")
    assert w.stats()["fallbacks"] == 1
    assert "polling it" in caplog.text
    path = str(tmp_path / "model.pt")
    write(path)
    rec.wait("closed_write", path)


class _FdWithoutRoomBelowDeep(fswatch._InotifyFD):
    """Fails to add a watch under any `deep` directory with ENOSPC (the root itself works),
    as when the limit runs out part-way through a big tree."""

    def _add_callback(self, path, mask, callback, id_):   # below our add_callback, as the kernel
        if b"/deep" in path:
            raise OSError(errno.ENOSPC, "inotify watch limit reached")
        return super()._add_callback(path, mask, callback, id_)


class _PartialObserver(fswatch._InotifyObserver):
    fd_class = _FdWithoutRoomBelowDeep


class _PartialWatcher(Watcher):
    def _make_inotify_observer(self):
        return _PartialObserver(self._note_overflow, self._note_limit)


def test_watch_limit_below_the_root_falls_back_to_polling(tmp_path, watch):
    os.makedirs(tmp_path / "deep")
    w, rec = watch("inotify", cls=_PartialWatcher)
    # watchdog itself would skip the failed subdirectory (7.1.0 silently, 7.1.1 with a log
    # line, or by failing the schedule); we move the root to polling.
    wait_for(lambda: w.stats()["roots"][str(tmp_path)]["mode"] == "polling", timeout=10)
    assert w.stats()["roots"][str(tmp_path)]["fallback"] == "watch_limit"
    path = str(tmp_path / "deep" / "model.pt")
    write(path)
    rec.wait("closed_write", path)


def test_watch_limit_hit_while_watching_falls_back_and_rescans(tmp_path, watch):
    """A directory made after the root is watched, whose watch is refused: watchdog skips it
    with at most a log line (every version), so writes below it would never be seen; the root
    moves to polling, and is rescanned for what inotify may have missed meanwhile."""
    w, rec = watch("inotify", cls=_PartialWatcher)
    wait_for(lambda: w.stats()["roots"][str(tmp_path)]["mode"] == "inotify", timeout=10)
    os.makedirs(tmp_path / "deep")
    wait_for(lambda: w.stats()["roots"][str(tmp_path)]["mode"] == "polling", timeout=10)
    assert w.stats()["roots"][str(tmp_path)]["fallback"] == "watch_limit"
    assert rec.rescans == [str(tmp_path)]
    path = str(tmp_path / "deep" / "model.pt")
    write(path)
    rec.wait("closed_write", path)


def test_bad_arguments():
    with pytest.raises(ValueError):
        Watcher(["/tmp"], mode="fanotify")
    with pytest.raises(ValueError):
        Watcher(["/tmp"], poll_interval=0)


def test_moved_file_counts_when_either_name_matches(tmp_path, watch):
    w, rec = watch("inotify")
    tmp = str(tmp_path / "model.pt.tmp")
    final = str(tmp_path / "model.pt")
    write(tmp, b"z" * 5)
    os.rename(tmp, final)
    ev = rec.wait("moved", final)
    assert (ev.path, ev.dest, ev.size) == (tmp, final, 5)


# ---------------------------------------------------------------------- WriteTracker (pure)

def _ev(kind, path, size=None, t=0.0, dest=None):
    return FsEvent(kind, path, size, 1000.0 + t, 1.7e9 + t, dest)


def _proc(pid, mode="w", rank=None, job="j"):
    return Holder(Writer("n1", pid, rank=rank, job=job), mode)


def test_tracker_intervals_are_valid_hook_shaped_events():
    t = WriteTracker(node="n1")
    out = t.observe(_ev("opened", "/c/a.pt", 0), [_proc(11, rank=0)])
    out += t.observe(_ev("modified", "/c/a.pt", 500, 0.1))
    out += t.observe(_ev("closed_write", "/c/a.pt", 900, 0.2), [])
    start, end = out
    for e in out:
        assert events.validate(e) is e and e["source"] == "fs"
    assert (start["type"], start["pid"], start["rank"], start["node"]) == ("start", 11, 0, "n1")
    assert (end["type"], end["seq"], end["bytes"], end["outcome"]) == \
           ("end", start["seq"], 900, "ok")
    assert end["start_mono"] == start["mono"] and end["mono"] > start["mono"]
    assert start["seq"] >= fstracker.FS_SEQ_BASE
    assert t.writing("/c/a.pt") == []


def _kinds(out):
    return [e.kind if isinstance(e, Finding) else e["type"] for e in out]


def test_tracker_concurrent_writers_and_fluctuation():
    t = WriteTracker(node="n1")
    t.observe(_ev("opened", "/c/a.pt", 0), [_proc(1, rank=0)])
    t.observe(_ev("modified", "/c/a.pt", 4000, 0.1))
    out = t.observe(_ev("opened", "/c/a.pt", 0, 0.2), [_proc(1, rank=0), _proc(2, rank=1)])
    # The second writer's start overlaps the first's write: the detector's collision.
    assert _kinds(out) == ["start", "size_fluctuation"]
    assert (out[0]["pid"], out[0]["rank"]) == (2, 1)
    fluct = out[1]
    assert [(w["pid"], w["rank"]) for w in fluct.writers] == [(1, 0), (2, 1)]
    assert (fluct.get("size_before"), fluct.get("size_after")) == (4000, 0)
    assert (fluct.job, fluct.source, fluct.node) == ("j", "fs", "n1")
    # Journaled as the dict it used to be.
    rec = fluct.to_record()
    assert sorted(rec) == sorted(["v", "type", "source", "node", "path", "wall", "mono", "job",
                                  "writers", "size_before", "size_after"])
    assert Finding.from_record(rec) == fluct
    # Unattributed close with two writers: nobody is ended on a guess.
    assert t.observe(_ev("closed_write", "/c/a.pt", 10, 0.3)) == []
    out = t.observe(_ev("closed_write", "/c/a.pt", 10, 0.4), [_proc(2, rank=1)])
    assert [(e["type"], e["pid"]) for e in out] == [("end", 1)]


def test_tracker_own_truncation_is_not_a_fluctuation():
    t = WriteTracker()
    t.observe(_ev("modified", "/c/a.pt", 9000))                       # an earlier save
    out = t.observe(_ev("opened", "/c/a.pt", 0, 1), [_proc(5)])        # truncates it
    out += t.observe(_ev("modified", "/c/a.pt", 100, 1.1))
    assert _kinds(out) == ["start"]
    assert t.counts["truncations"] == 1 and t.counts["size_fluctuation"] == 0


def test_tracker_torn_read_and_reader_alone():
    t = WriteTracker()
    assert t.observe(_ev("opened", "/c/a.pt", 10), [_proc(7, "r")]) == []   # no writer
    t.observe(_ev("opened", "/c/b.pt", 0), [_proc(1)])
    out = t.observe(_ev("opened", "/c/b.pt", 50, 0.1), [_proc(1), _proc(8, "r", job="eval")])
    (torn,) = out
    assert torn.kind == "torn_read" and torn.get("reader")["pid"] == 8
    assert torn.get("reader")["mode"] == "r" and torn.get("reader")["job"] == "eval"
    assert [w["pid"] for w in torn.writers] == [1]
    # The same pid reading its own file while writing it is not a torn read.
    t2 = WriteTracker()
    t2.observe(_ev("opened", "/c/c.pt", 0), [_proc(1)])
    assert t2.observe(_ev("opened", "/c/c.pt", 0, 0.1), [_proc(1), _proc(1, "r")]) == []


def test_tracker_deleted_and_root_lost_end_writes():
    t = WriteTracker()
    t.observe(_ev("opened", "/c/a.pt", 0), [_proc(1)])
    t.observe(_ev("opened", "/c/sub/b.pt", 0), [_proc(2)])
    (end,) = t.observe(_ev("deleted", "/c/a.pt", None, 1))
    assert (end["pid"], end["outcome"]) == (1, "deleted")
    (end,) = t.observe(_ev("root_lost", "/c", None, 2))
    assert (end["pid"], end["path"]) == (2, "/c/sub/b.pt")
    assert t.observe(_ev("overflow", "/c", None, 3)) == []


def test_tracker_needs_attribution():
    t = WriteTracker()
    assert t.needs_attribution(_ev("opened", "/c/a.pt"))
    assert t.needs_attribution(_ev("modified", "/c/a.pt"))
    assert not t.needs_attribution(_ev("deleted", "/c/a.pt"))
    assert not t.needs_attribution(_ev("overflow", "/c"))
    t.observe(_ev("opened", "/c/a.pt", 0), [_proc(1), _proc(2, "r")])
    assert t.holding("/c/a.pt") == {1, 2} and t.writing("/c/a.pt") == [1]


# ---------------------------------------------------------------------- end to end (fs side)

# Holds a checkpoint open for writing: writes argv[2] bytes, says "ready", waits for a line,
# closes, says "closed", exits when stdin closes.
WRITER = r"""
import sys
f = open(sys.argv[1], "wb")
f.write(b"w" * int(sys.argv[2])); f.flush()
print("ready", flush=True)
sys.stdin.readline()
f.close()
print("closed", flush=True)
sys.stdin.read()
"""

# A plain torch.save of a real state dict; the object's pickling waits for a line on stdin, so
# the save is paused with its file open (and already truncated) while the test looks.
TORCH_SAVER = r"""
import sys, torch
class Gate:
    def __reduce__(self):
        print("saving", flush=True)
        sys.stdin.readline()
        return (dict, ())
torch.save({"w": torch.zeros(64, 64), "gate": Gate()}, sys.argv[1])
print("saved", flush=True)
"""


class Pipeline:
    """Watcher -> procscan -> WriteTracker, as the agent wires it (fstracker.attribute)."""

    def __init__(self):
        self.tracker = WriteTracker(node="n1")
        self.scanner = ProcScanner(node="n1", min_interval=0)
        self.out: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, ev):
        with self.lock:
            self.out.extend(fstracker.attribute(ev, self.tracker, self.scanner))

    def of_type(self, kind):
        with self.lock:
            return [e for e in self.out if _kinds([e]) == [kind]]


def _spawn(code, *args, **env):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=subprocess_env(**env))


def _expect(proc, word):
    line = proc.stdout.readline().strip()
    assert line == word, line


def _reap(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for stream in (p.stdin, p.stdout):
            if stream:
                stream.close()


@pytest.fixture(params=MODES)
def pipeline_watch(request, tmp_path, no_thread_leak):
    pipe = Pipeline()
    w = Watcher([str(tmp_path)], mode=request.param, on_event=pipe, rearm_interval=POLL,
                poll_interval=POLL)
    w.start()
    yield pipe
    w.stop()


def test_two_real_writers_of_one_path_overlap(tmp_path, pipeline_watch):
    pipe = pipeline_watch
    path = str(tmp_path / "last.pt")
    a = _spawn(WRITER, path, 1 << 20, RANK=0, LOCAL_RANK=0, TORCHELASTIC_RUN_ID="r1")
    b = None
    try:
        _expect(a, "ready")
        wait_for(lambda: pipe.tracker.writing(path) == [a.pid], timeout=10)
        b = _spawn(WRITER, path, 100, RANK=1, LOCAL_RANK=1, TORCHELASTIC_RUN_ID="r1")
        _expect(b, "ready")
        wait_for(lambda: len(pipe.of_type("start")) == 2, timeout=10)
        assert [(e["pid"], e["rank"], e["local_rank"], e["job"], e["path"]) for e in
                pipe.of_type("start")] == [(a.pid, 0, 0, "r1", path), (b.pid, 1, 1, "r1", path)]
        # b opened with O_TRUNC under a's feet: the file shrank with two writers on it.
        (fluct,) = wait_for(lambda: pipe.of_type("size_fluctuation"), timeout=10)
        assert [(w["pid"], w["rank"]) for w in fluct.writers] == [(a.pid, 0), (b.pid, 1)]
        assert fluct.path == path and fluct.job == "r1"
        assert fluct.get("size_before") >= 1 << 20 and \
            fluct.get("size_after") < fluct.get("size_before")
        for p in (a, b):
            p.stdin.write("close\n")
            p.stdin.flush()
            _expect(p, "closed")
        ends = wait_for(lambda: len(pipe.of_type("end")) == 2 and pipe.of_type("end"),
                        timeout=10)
        starts = pipe.of_type("start")
        assert {e["pid"] for e in starts} == {e["pid"] for e in ends} == {a.pid, b.pid}
        for e in starts + ends:
            events.validate(e)
        # The two intervals overlap: what the detector will call a concurrent collision.
        by_pid = {e["pid"]: e for e in ends}
        assert by_pid[b.pid]["start_mono"] < by_pid[a.pid]["mono"]
    finally:
        _reap(*(p for p in (a, b) if p is not None))


@pytest.mark.torch
def test_plain_torch_save_truncating_its_own_file_is_no_fluctuation(tmp_path, pipeline_watch):
    pipe = pipeline_watch
    path = str(tmp_path / "model.pt")
    write(path, b"old" * 100_000)                 # the previous, bigger checkpoint
    wait_for(lambda: pipe.tracker._sizes.get(path) == 300_000, timeout=10)
    saver = _spawn(TORCH_SAVER, path, RANK=0, TORCHELASTIC_RUN_ID="r2")
    try:
        _expect(saver, "saving")                 # file open and truncated, save paused
        wait_for(lambda: pipe.tracker.writing(path) == [saver.pid], timeout=10)
        saver.stdin.write("go\n")
        saver.stdin.flush()
        _expect(saver, "saved")
        (end,) = wait_for(lambda: pipe.of_type("end"), timeout=10)
        assert (end["pid"], end["rank"], end["job"]) == (saver.pid, 0, "r2")
        assert end["bytes"] == os.path.getsize(path)
        # The shrink was seen, and it was the saver's own truncation: not a fluctuation.
        assert pipe.tracker.counts["truncations"] >= 1
        assert pipe.of_type("size_fluctuation") == [] and len(pipe.of_type("start")) == 1
    finally:
        _reap(saver)


class _ScriptedScanner:
    """holders_of answers from a list, one per call (the fd of a new opener shows up late)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []

    def holders_of(self, path, changed_after=None, since=None):
        self.calls.append((changed_after, since))
        return self.answers.pop(0)


def test_attribute_looks_again_when_an_open_shows_nobody_new():
    t = WriteTracker()
    t.observe(_ev("opened", "/c/a.pt", 0), [_proc(1)])
    scanner = _ScriptedScanner([_proc(1)], [_proc(1), _proc(2)])
    slept = []
    out = fstracker.attribute(_ev("opened", "/c/a.pt", 0, 1), t, scanner, sleep=slept.append,
                              clock=lambda: 1001.0)
    assert [(e["type"], e["pid"]) for e in out] == [("start", 2)]
    assert slept == [fstracker.OPEN_RETRY_DELAY] and scanner.calls[0] == (1001.0, None)
    # A write reuses the scanner's rate-limited result, or a scan begun after it; no retry.
    scanner = _ScriptedScanner([_proc(1), _proc(2)])
    assert fstracker.attribute(_ev("modified", "/c/a.pt", 9, 2), t, scanner, sleep=slept.append) \
        == []
    assert scanner.calls == [(None, 1002.0)] and len(slept) == 1


def test_attribute_does_not_look_again_at_an_open_older_than_the_retry_delay():
    """Taken from the queue late (behind slow scans): the fd of that open is in /proc by
    now, so the one scan (begun after open + delay) is the answer, with no sleep."""
    t = WriteTracker()
    t.observe(_ev("opened", "/c/a.pt", 0), [_proc(1)])
    scanner = _ScriptedScanner([_proc(1)], [_proc(1)])
    slept = []
    ev = FsEvent("opened", "/c/a.pt", 0, time.monotonic() - 1.0, time.time())  # taken late
    assert fstracker.attribute(ev, t, scanner, sleep=slept.append) == []
    assert slept == [] and len(scanner.calls) == 1
    assert scanner.calls[0][0] >= ev.mono + fstracker.OPEN_RETRY_DELAY


def test_rescan_reconciles_writers_missed_and_closes_lost(tmp_path):
    """After an overflow: a writer whose open was never seen starts, a tracked writer whose
    close was lost ends; one pass over the processes for the whole root."""
    tracker = WriteTracker(node="n1")
    scanner = ProcScanner(node="n1", min_interval=0)
    missed, gone = str(tmp_path / "sub" / "missed.pt"), str(tmp_path / "gone.pt")
    os.makedirs(tmp_path / "sub")
    tracker.observe(_ev("opened", gone, 0), [_proc(999_999_999, rank=5)])   # no such process
    holder = _spawn(WRITER, missed, 10, RANK=2)
    try:
        _expect(holder, "ready")
        write(str(tmp_path / "notes.txt"))
        out = fstracker.rescan(str(tmp_path), tracker, scanner,
                             Watcher([str(tmp_path)]).matches)
        assert sorted((e["type"], e["pid"], e["rank"], e["path"]) for e in out) == sorted(
            [("start", holder.pid, 2, missed), ("end", 999_999_999, 5, gone)])
        assert tracker.writing(missed) == [holder.pid]
        assert scanner.stats()["full_scans"] == 0
    finally:
        _reap(holder)


def test_a_broken_inotify_import_on_linux_is_loud(tmp_path):
    # watchdog's inotify module failing to import (a watchdog outside the pinned range, a
    # broken install) must not silently turn every root into a polled one.
    code = r"""
import json, logging, sys
import watchdog.observers                              # the real package, as installed
for name in ("watchdog.observers.inotify", "watchdog.observers.inotify_c"):
    sys.modules.pop(name, None)
sys.modules["watchdog.observers.inotify_c"] = None     # our inotify import now fails
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from monitor.fs import watch
w = watch.Watcher([sys.argv[1]], mode="auto")
w.start()
stats = w.stats()
w.stop()
print(json.dumps({"unavailable": stats["inotify_unavailable"],
                  "modes": sorted({r["mode"] for r in stats["roots"].values()})}))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json
    assert json.loads(out.stdout) == {"unavailable": 1, "modes": ["polling"]}
    assert "ERROR" in out.stderr and "inotify is unavailable" in out.stderr


def test_inotify_is_available_here():
    # The counterpart: on this Linux machine the pinned watchdog's inotify imports.
    assert fswatch.inotify_available() and not fswatch.inotify_broken()
