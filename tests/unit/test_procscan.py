"""procscan: real subprocesses holding real files open, attributed with their rank and job."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil

from helpers import subprocess_env, wait_for
from monitor.fs import procscan
from monitor.detect.model import Writer
from monitor.fs.procscan import ProcScanner, mode_from_flags

# Opens argv[1] with mode argv[2], writes a little, says "ready", holds it until stdin closes.
HOLDER = r"""
import sys
f = open(sys.argv[1], sys.argv[2])
if "r" not in sys.argv[2] or "+" in sys.argv[2]:
    f.write(b"x" * 10); f.flush()
print("ready", flush=True)
sys.stdin.read()
"""


class Holder:
    """A subprocess holding a path open; a context manager that always reaps it."""

    def __init__(self, path, mode="wb", argv=None, **env):
        argv = argv or [sys.executable, "-c", HOLDER, path, mode]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=subprocess_env(**env), text=True)
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line

    @property
    def pid(self):
        return self.proc.pid

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        self.proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_writer_found_with_rank_and_job_from_its_environment(tmp_path):
    path = str(tmp_path / "model.pt")
    scanner = ProcScanner(node="node-a")
    with Holder(path, RANK=3, LOCAL_RANK=1, WORLD_SIZE=8, GROUP_RANK=0,
                TORCHELASTIC_RUN_ID="job-42", MASTER_ADDR="10.0.0.1", MASTER_PORT=29500,
                TORCHELASTIC_RESTART_COUNT=2) as h:
        writers = scanner.writers_of(path)
        assert [w.pid for w in writers] == [h.pid]
        w = writers[0]
        assert w.mode == "w" and w.writer == Writer(
            "node-a", h.pid, rank=3, local_rank=1, world_size=8, node_rank=0, job="job-42",
            master="10.0.0.1:29500", restart=2)
        assert w.cmdline[0] == sys.executable and path in w.cmdline
        assert scanner.readers_of(path) == []
    stats = scanner.stats()
    assert stats["scans"] >= 1 and stats["total_seconds"] > 0 and stats["last_seconds"] > 0
    assert stats["errors"] == 0


def test_ckptwatch_job_and_node_from_environment_win(tmp_path):
    path = str(tmp_path / "model.pt")
    with Holder(path, CKPTWATCH_JOB="mine", CKPTWATCH_NODE="pod-7", SLURM_JOB_ID="99",
                SLURM_PROCID=5) as h:
        (w,) = ProcScanner(node="agent-node").writers_of(path)
    assert (w.pid, w.writer.job, w.writer.node, w.writer.rank) == (h.pid, "mine", "pod-7", 5)


def test_modes_reader_appender_and_read_write(tmp_path):
    path = str(tmp_path / "model.pt")
    with open(path, "wb") as f:
        f.write(b"y" * 100)
    scanner = ProcScanner(min_interval=0)
    with Holder(path, "rb") as reader, Holder(path, "ab") as appender, \
            Holder(path, "r+b") as updater:
        holders = {p.pid: p.mode for p in scanner.holders_of(path)}
        assert holders == {reader.pid: "r", appender.pid: "a", updater.pid: "r+"}
        assert [p.pid for p in scanner.readers_of(path)] == [reader.pid]
        assert sorted(p.pid for p in scanner.writers_of(path)) == \
               sorted([appender.pid, updater.pid])


def test_non_python_writer_found_by_full_scan_fallback(tmp_path):
    path = str(tmp_path / "blob.bin")
    shell = ["/bin/bash", "-c", f'exec 3>"{path}"; echo ready; read -r _']
    with Holder(path, argv=shell, RANK=6) as h:
        assert ProcScanner(full_scan_fallback=False).writers_of(path) == []
        scanner = ProcScanner()
        (w,) = scanner.writers_of(path)
        assert (w.pid, w.mode, w.writer.rank) == (h.pid, "w", 6)
        assert scanner.stats()["full_scans"] == 1


def test_explicit_candidates_and_vanished_processes_tolerated(tmp_path):
    path = str(tmp_path / "model.pt")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with Holder(path, RANK=1) as h:
        scanner = ProcScanner(full_scan_fallback=False)
        assert [w.pid for w in scanner.writers_of(path, candidates=[gone.pid, h.pid])] == \
               [h.pid]
        assert scanner.writers_of(path, candidates=[psutil.Process(h.pid)])[0].writer.rank == 1
        assert scanner.writers_of(path, candidates=[os.getpid()]) == []
    assert scanner.stats()["errors"] == 0


def test_rate_limit_reuses_a_recent_scan_unless_the_path_changed_since(tmp_path):
    path = str(tmp_path / "model.pt")
    now = [100.0]
    scanner = ProcScanner(min_interval=1.0, clock=lambda: now[0])
    with Holder(path) as first:
        assert [w.pid for w in scanner.writers_of(path)] == [first.pid]
        with Holder(path, "ab") as second:
            # Inside the interval: the cached result (it predates the second open).
            assert [w.pid for w in scanner.writers_of(path)] == [first.pid]
            assert scanner.stats()["cache_hits"] == 1
            # The caller saw a change after that scan began: scan again.
            now[0] += 0.1
            got = scanner.writers_of(path, changed_after=now[0])
            assert sorted(w.pid for w in got) == sorted([first.pid, second.pid])
            assert scanner.stats()["scans"] == 2
            now[0] += 1.0    # and once the interval passed, a plain call scans too
            scanner.writers_of(path)
            assert scanner.stats()["scans"] == 3


def test_process_started_after_the_last_refresh_is_found(tmp_path):
    path = str(tmp_path / "model.pt")
    scanner = ProcScanner(refresh_interval=3600, min_refresh=0, full_scan_fallback=False)
    with Holder(path, RANK=0) as first:
        assert [w.writer.rank for w in scanner.writers_of(path)] == [0]
        assert scanner.stats()["refreshes"] == 1
        with Holder(path, "ab", RANK=1) as second:
            got = scanner.writers_of(path, changed_after=float("inf"))
            assert {(w.pid, w.writer.rank) for w in got} == {(first.pid, 0), (second.pid, 1)}
            stats = scanner.stats()
            assert stats["refreshes"] == 1 and stats["updates"] >= 1


def test_fdinfo_modes_of_a_reader_a_writer_and_an_appender(tmp_path):
    path = str(tmp_path / "model.pt")
    with open(path, "wb") as f:
        f.write(b"z")
    with Holder(path, "rb") as r, Holder(path, "wb") as w, Holder(path, "ab") as a:
        for h, mode in ((r, "r"), (w, "w"), (a, "a")):
            assert [m for _, _, m in procscan._proc_fd_opens(h.pid, os.path.realpath(path))] \
                   == [mode]


def test_mode_from_flags():
    assert mode_from_flags(os.O_RDONLY) == "r"
    assert mode_from_flags(os.O_WRONLY | os.O_TRUNC | os.O_CREAT) == "w"
    assert mode_from_flags(os.O_WRONLY | os.O_APPEND) == "a"
    assert mode_from_flags(os.O_RDWR) == "r+"
    assert procscan.Holder(Writer("n", 1), "r+").writing
    assert not procscan.Holder(Writer("n", 1), "r").writing


def test_candidate_filter():
    assert procscan.is_candidate("python3.11", [])
    assert procscan.is_candidate("pt_elastic", [])
    assert procscan.is_candidate("x", ["/usr/bin/python3", "train.py"])
    assert not procscan.is_candidate("bash", ["/bin/bash"])


def test_own_process_excluded_by_default(tmp_path):
    path = str(tmp_path / "model.pt")
    with open(path, "wb"):
        assert ProcScanner(full_scan_fallback=False).writers_of(path) == []
        (me,) = ProcScanner(exclude_pids=(), full_scan_fallback=False).writers_of(
            path, candidates=[os.getpid()])
        assert me.pid == os.getpid()


def test_closed_writer_no_longer_reported(tmp_path):
    path = str(tmp_path / "model.pt")
    scanner = ProcScanner(min_interval=0)
    with Holder(path) as h:
        assert scanner.writers_of(path)
        h.close()
        wait_for(lambda: scanner.writers_of(path) == [], timeout=5)


def _closing_when_met(scanner, writer, decoys, met):
    """Wraps scanner._opens: records the pids a scan looks at, in order, and ends `writer`
    (its save is over) as soon as the scan looks at one of `decoys` before it, as a short
    save ends while a slow walk of the node is still on other processes."""
    real = scanner._opens

    def opens(proc, path):
        met.append(proc.pid)
        if proc.pid in decoys and writer.pid not in met:
            writer.close()
        return real(proc, path)
    scanner._opens = opens


def test_a_job_started_after_the_last_refresh_is_met_before_older_processes(tmp_path):
    """A job that just started is looked at before processes that have run for longer (the
    old scan met new processes last, after every process it already knew): the writer of a
    short save is found while its file is still open (the loaded e2e failure,
    docs/decisions.md "Naming the writer of a short save")."""
    path = str(tmp_path / "model.pt")
    scanner = ProcScanner(full_scan_fallback=False, min_interval=0, refresh_interval=3600)
    with Holder(str(tmp_path / "a.log")) as d1, Holder(str(tmp_path / "b.log")) as d2:
        assert scanner.writers_of(path) == []               # the decoys are known now
        with Holder(path, RANK=0) as w:
            met: list = []
            _closing_when_met(scanner, w, {d1.pid, d2.pid}, met)
            got = [h.pid for h in scanner.writers_of(path, changed_after=float("inf"))]
            assert got == [w.pid], (met, w.pid)


def test_a_process_seen_writing_is_met_before_newer_ones(tmp_path):
    """A job saves again and again: the process that wrote last is looked at first. (The
    old order of processes known at a refresh was a set's, which may or may not put the
    newer decoy first: this holds the new order, it cannot show the old one failing.)"""
    path = str(tmp_path / "model.pt")
    with Holder(path, RANK=1) as w, Holder(str(tmp_path / "b.log")) as newer:
        scanner = ProcScanner(full_scan_fallback=False, min_interval=0)
        assert [h.pid for h in scanner.writers_of(path)] == [w.pid]
        met: list = []
        _closing_when_met(scanner, w, {newer.pid}, met)
        got = [h.pid for h in scanner.writers_of(path, changed_after=float("inf"))]
        assert got == [w.pid], (met, w.pid)


def test_a_scan_begun_after_a_change_answers_for_it_whatever_its_age(tmp_path):
    """Events queued behind a slow scan (a save's open, writes and close) reuse a scan that
    began after them instead of walking the node once each; one begun before is not."""
    path = str(tmp_path / "model.pt")
    now = [100.0]
    scanner = ProcScanner(min_interval=0.05, clock=lambda: now[0])
    with Holder(path) as h:
        assert [w.pid for w in scanner.writers_of(path, changed_after=99.0)] == [h.pid]
        now[0] = 105.0                                      # long past min_interval
        assert [w.pid for w in scanner.writers_of(path, changed_after=99.5)] == [h.pid]
        assert (scanner.stats()["cache_hits"], scanner.stats()["scans"]) == (1, 1)
        assert [w.pid for w in scanner.writers_of(path, since=99.9)] == [h.pid]
        assert (scanner.stats()["cache_hits"], scanner.stats()["scans"]) == (2, 1)
        assert [w.pid for w in scanner.writers_of(path, changed_after=100.5)] == [h.pid]
        assert scanner.stats()["scans"] == 2


def test_holders_under_reads_each_descriptor_once(tmp_path):
    """The rescan's pass: every checkpoint below the root that a candidate holds, with its
    mode, and nothing outside it."""
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    with Holder(str(inside / "a.pt"), RANK=2) as a, Holder(str(outside / "b.pt")), \
            Holder(str(inside / "c.log"), "wb"):
        got = ProcScanner().holders_under(str(inside), lambda p: p.endswith(".pt"))
    assert {p: [(x.pid, x.mode, x.writer.rank) for x in hs] for p, hs in got.items()} == \
        {os.path.realpath(str(inside / "a.pt")): [(a.pid, "w", 2)]}


def test_a_due_refresh_comes_after_the_walk_not_before_it(tmp_path):
    """Classifying every process again costs ~15 ms of CPU (60 ms at load 6): when it is
    due at a scan for a change, the candidates are walked first and the refresh follows."""
    path = str(tmp_path / "model.pt")
    now = [100.0]
    scanner = ProcScanner(refresh_interval=5.0, min_interval=0, clock=lambda: now[0])
    with Holder(path) as h:
        assert [w.pid for w in scanner.writers_of(path)] == [h.pid]
        now[0] += 10.0                                         # a refresh is due
        calls: list = []
        update, opens = scanner._update_candidates, scanner._opens
        scanner._update_candidates = lambda t, full: (calls.append(("update", full)),
                                                      update(t, full))[1]
        scanner._opens = lambda proc, p: (calls.append(("walk", proc.pid)), opens(proc, p))[1]
        assert [w.pid for w in scanner.writers_of(path, changed_after=now[0])] == [h.pid]
    assert ("update", True) in calls
    assert calls.index(("walk", h.pid)) < calls.index(("update", True)), calls
    assert scanner.refresh() is False                          # not due again yet


# Holds argv[1] open for writing after opening argv[2] descriptors on /dev/null, then waits.
MANY_FDS = r"""
import os, sys
spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(int(sys.argv[2]))]
f = open(sys.argv[1], "wb")
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_process_holding_many_descriptors_costs_a_bounded_walk(tmp_path, monkeypatch):
    """A local user's process may hold a million descriptors: a walk of it stops at
    MAX_FDS_WALKED (counted), so it cannot make every scan of the node take seconds. The
    checkpoint opened past the bound is not named: the cost of the bound, stated."""
    monkeypatch.setattr(procscan, "MAX_FDS_WALKED", 200, raising=False)   # old code: no bound
    looked = []
    real_readlink = os.readlink
    monkeypatch.setattr(procscan.os, "readlink",
                        lambda p, *a, **k: (looked.append(p), real_readlink(p, *a, **k))[1])
    path = str(tmp_path / "late.pt")
    with Holder(path, argv=[sys.executable, "-c", MANY_FDS, path, "1000"]) as h:
        scanner = ProcScanner()
        holders = scanner.holders_of(path, candidates=[h.pid])
    mine = [p for p in looked if p.startswith(f"/proc/{h.pid}/")]
    assert len(mine) <= 200, len(mine)
    assert holders == []
    assert scanner.stats()["fds_capped"] == 1
