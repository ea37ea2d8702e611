"""The agent in this process: Agent.build/start/stop and its turns driven by hand, the health
checks on a real IngestServer, and `python agent.py --help` (the real process end to end is
tests/e2e/test_agent.py)."""
import os
import subprocess
import sys

from helpers import REPO_ROOT


def test_python_agent_py_help():
    proc = subprocess.run([sys.executable, "agent.py", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT)
    assert proc.returncode == 0
    assert "--web.listen-address" in proc.stdout and "--ingest.socket" in proc.stdout


def test_health_fails_when_ingest_thread_is_gone(tmp_path, sockdir, no_thread_leak):
    import time

    from exporters.health import STALL_SECONDS, health_check
    from monitor.ingest.server import IngestServer

    ingest = IngestServer(os.path.join(sockdir, "h.sock"), lambda e: None, lambda r: None)
    heartbeat = [time.monotonic()]
    health = health_check(ingest, heartbeat)
    ingest.start()
    try:
        assert health() == (True, "")
        heartbeat[0] -= STALL_SECONDS + 1
        assert health() == (False, "agent loop stalled")
        heartbeat[0] = time.monotonic()
    finally:
        ingest.stop()
    assert health() == (False, "ingest thread is not running")


def _event(kind, pid, seq, t, path):
    ev = {"v": 1, "type": kind, "node": "n1", "pid": pid, "seq": seq, "path": path,
          "wall": 1.7e9 + t, "mono": t, "rank": pid % 10, "job": "inproc"}
    if kind == "end":
        ev.update(start_wall=1.7e9, start_mono=0.0, outcome="ok", bytes=10)
    return ev


def test_agent_stop_finalises_pending_collisions_and_removes_its_socket(workdir, sockdir,
                                                                          no_thread_leak):
    """Agent.build/start/stop in-process: a collision still settling when the agent stops is
    journaled by stop(), which also removes the socket, even though serve() never ran."""
    import time

    from exporters.journal import read_records
    from monitor.agent import config
    from monitor.agent.daemon import Agent

    sock = os.path.join(sockdir, "inproc.sock")
    journal = os.path.join(workdir, "journal.jsonl")
    agent = Agent.build(config.load(["--ingest.socket", sock, "--journal.path", journal,
                                     "--web.listen-address", "127.0.0.1:0",
                                     "--collision.settle", "30"]))
    agent.start()
    try:
        assert os.path.exists(sock)
        now = time.monotonic()
        agent.hook_batch([_event("start", 11, 1, now - 2, "/c/a.pt"),
                          _event("start", 12, 1, now - 1.5, "/c/a.pt"),
                          _event("end", 11, 1, now - 1, "/c/a.pt"),
                          _event("end", 12, 1, now - 0.5, "/c/a.pt")])
        agent.tick()
        assert [r["type"] for r in read_records(journal)] == ["write", "write"]  # settling
    finally:
        agent.stop()
    assert not os.path.exists(sock)
    (collision,) = [r for r in read_records(journal) if r["type"] == "collision"]
    assert collision["kind"] == "concurrent" and \
        [w["pid"] for w in collision["writers"]] == [11, 12]


def test_health_fails_while_the_loop_is_behind_its_queue(sockdir, no_thread_leak):
    """/healthz fails once the oldest event waiting for the loop has waited MAX_LAG_SECONDS,
    and recovers when the loop takes it (issue 8 item 5: a loop that is behind is unhealthy)."""
    import time

    from exporters.health import MAX_LAG_SECONDS, health_check
    from monitor.ingest.inbox import Inbox
    from monitor.ingest.server import IngestServer

    now = [100.0]
    inbox = Inbox(clock=lambda: now[0])
    ingest = IngestServer(os.path.join(sockdir, "lag.sock"), lambda e: None, lambda r: None)
    health = health_check(ingest, [time.monotonic()], inbox=inbox, clock=lambda: now[0])
    ingest.start()
    try:
        inbox.put([{"type": "start"}])
        now[0] += 1.0
        inbox.put([{"type": "start"}])
        now[0] += MAX_LAG_SECONDS - 1.0
        assert health() == (True, "")
        now[0] += 0.5
        ok, reason = health()
        assert not ok and reason.startswith("agent loop behind: oldest queued event waited")
        assert len(inbox.take(0)) == 2
        assert health() == (True, "") and inbox.oldest_wait() == 0.0
    finally:
        ingest.stop()


def test_a_watched_write_whose_start_comes_after_its_close_is_still_verified(workdir, sockdir):
    """The watcher's start of a write (fanotify queue) can reach the loop after the close of
    the same write (inotify queue) and after the hook's report of it: the fs end that follows
    the start must make the path due again, or it is never verified (seen in bench/capacity.py
    and `ckptwatch check`: 10-30 of 520 new files unverified with inotify + fanotify)."""
    import time

    from monitor.agent import config
    from monitor.agent.daemon import Agent
    from monitor.fs.source import FILE_CLOSED, FileNotice

    root = os.path.join(workdir, "ckpt")
    os.makedirs(root)
    path = os.path.join(root, "late.pt")
    agent = Agent.build(config.load(["--ingest.socket", os.path.join(sockdir, "a.sock"),
                                     "--journal.path", os.path.join(workdir, "j.jsonl"),
                                     "--web.listen-address", "127.0.0.1:0",
                                     "--watch.path", root, "--verify.quiet", "0.5"]))
    try:
        now = time.monotonic()
        fs_start = {**_event("start", 77, 1, now - 1.0, path), "source": "fs"}
        fs_end = {**_event("end", 77, 1, now - 0.5, path), "source": "fs", "start_mono": now - 1.0}
        agent.fs_inbox.put([FileNotice(FILE_CLOSED, path)])     # the close, first
        agent.fs_inbox.put([fs_start, fs_end])                   # then the write it closed
        agent.fs_turn()
        due = agent.checks.schedule.due(time.monotonic() + 5)
        assert [p for p, *_ in due] == [path]
    finally:
        agent.journal.close()


def test_ready_waits_for_start_and_liveness_ignores_lag(sockdir, no_thread_leak):
    """/-/ready is false until the agent has started every source, and while the loop is
    behind; /-/healthy stays true through both (a restart would not help)."""
    import threading
    import time

    from exporters.health import MAX_LAG_SECONDS, health_check, liveness_check
    from monitor.ingest.inbox import Inbox
    from monitor.ingest.server import IngestServer

    now = [100.0]
    inbox = Inbox(clock=lambda: now[0])
    ingest = IngestServer(os.path.join(sockdir, "ready.sock"), lambda e: None, lambda r: None)
    started = threading.Event()
    heartbeat = [time.monotonic()]
    ready = health_check(ingest, heartbeat, inbox=inbox, started=started)
    healthy = liveness_check(ingest, heartbeat)
    ingest.start()
    try:
        assert ready() == (False, "agent is starting") and healthy() == (True, "")
        started.set()
        assert ready() == (True, "")
        inbox.put([{"type": "start"}])
        now[0] += MAX_LAG_SECONDS + 1
        assert not ready()[0] and healthy() == (True, "")
        heartbeat[0] -= 31                                  # the loop stopped turning
        assert healthy() == (False, "agent loop stalled")
    finally:
        ingest.stop()
