"""monitor.ingest.server under connection floods: per-peer caps, room for new peers, counted and
rate-limited refusals, stalled partial frames. Real Unix sockets and real processes (other uids
need root: the tests that use them are skipped otherwise)."""
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from ckptwatch import events
from helpers import subprocess_env, wait_for
from monitor.ingest.server import IngestServer
from otheruser import NOBODY, NOGROUP, needs_root
from wire import Recorder, hold, start_event


@pytest.fixture
def make_server(sockdir, no_thread_leak):
    servers = []

    def make(**limits):
        rec = Recorder()
        srv = IngestServer(os.path.join(sockdir, "agent.sock"), rec.on_events, rec.on_reject,
                           **limits)
        os.chmod(sockdir, 0o755)         # peers running as other uids must reach the socket
        srv.start()
        os.chmod(srv.path, 0o666)
        srv.rec = rec
        servers.append(srv)
        return srv
    yield make
    for srv in servers:
        srv.stop()


_PEER = r'''
import os, socket, sys, time
from ckptwatch import events
path, uid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if uid != os.getuid():
    os.setgid(uid); os.setuid(uid)
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socks.append(s)
print("ready", flush=True)
for line in sys.stdin:          # "send": one start event on the newest connection
    ev = {"v": 1, "type": "start", "node": "n1", "pid": os.getpid(), "seq": 1, "rank": 0,
          "path": "/ckpt/peer.pt", "site": "train.py:1", "func": "save",
          "wall": time.time(), "mono": time.monotonic()}
    try:
        socks[-1].sendall(events.encode(ev))
        print("sent", flush=True)
    except OSError as exc:
        print(f"error {exc}", flush=True)
'''


class Peer:
    """Another process, as `uid`, holding `n` connections to the agent."""

    def __init__(self, path, uid, n):
        self.proc = subprocess.Popen([sys.executable, "-c", _PEER, path, str(uid), str(n)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=subprocess_env())
        assert self.proc.stdout.readline().strip() == "ready"

    def send(self):
        self.proc.stdin.write("send\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def peers():
    started = []

    def spawn(path, uid, n):
        peer = Peer(path, uid, n)
        started.append(peer)
        return peer
    yield spawn
    for peer in started:
        peer.close()


def delivered_from(srv, pid):
    return [e for e in srv.rec.events if e["pid"] == pid]


def test_one_process_cannot_fill_the_connection_cap(make_server, peers):
    srv = make_server(max_connections=64)
    held = hold(srv.path, 300)       # one process, five times the cap
    try:
        # The agent accepts in order: the newcomer comes after all 300.
        peer = peers(srv.path, os.getuid(), 1)
        assert peer.send() == "sent"
        wait_for(lambda: delivered_from(srv, peer.proc.pid), timeout=5,
                 message="the newcomer's event")
        assert srv.connections == srv.max_per_pid + 1
        assert srv.refused == {"pid_limit": 300 - srv.max_per_pid, "uid_limit": 0}
    finally:
        for s in held:
            s.close()


@needs_root
def test_one_uid_cannot_fill_the_connection_cap(make_server, peers):
    srv = make_server(max_connections=64, max_per_pid=8, max_per_uid=24)
    for _ in range(6):                   # six processes of one uid, 8 connections each
        peers(srv.path, NOBODY, 8)
    wait_for(lambda: srv.refused["uid_limit"] == 6 * 8 - 24, message=f"{srv.refused}")
    assert srv.connections == 24
    newcomer = peers(srv.path, os.getuid(), 1)
    assert newcomer.send() == "sent"
    wait_for(lambda: delivered_from(srv, newcomer.proc.pid))


@needs_root
def test_full_agent_evicts_the_biggest_holder_not_the_newcomer(make_server, peers):
    srv = make_server(max_connections=20, max_per_pid=16, max_per_uid=16)
    first = peers(srv.path, NOBODY, 16)               # the biggest holder
    wait_for(lambda: srv.connections == 16)
    mine = hold(srv.path, 4)                          # the agent is now full
    try:
        wait_for(lambda: srv.connections == 20)
        newcomer = peers(srv.path, NOGROUP, 1)
        assert newcomer.send() == "sent"
        wait_for(lambda: delivered_from(srv, newcomer.proc.pid), message="newcomer's event")
        assert srv.evicted["make_room"] == 1
        assert srv.connections == 20
        assert sum(srv.refused.values()) == 0
        # the eviction hit the oldest connection of the biggest holder: the newest still works
        assert first.send() == "sent"
        wait_for(lambda: delivered_from(srv, first.proc.pid))
        for s in mine:                                # and none of the smaller holder's
            s.sendall(events.encode(start_event()))
        wait_for(lambda: len(delivered_from(srv, os.getpid())) == 4)
    finally:
        for s in mine:
            s.close()


def test_refusals_log_one_line_then_a_rate_limited_summary(make_server, caplog):
    caplog.set_level(logging.INFO, logger="ckptwatch.ingest")
    skipped = [0.0]          # the server's clock is moved past the log interval, not slept through
    srv = make_server(max_per_pid=4, log_interval=0.5,
                      clock=lambda: time.monotonic() + skipped[0])
    held = hold(srv.path, 1000)

    def warnings_logged():
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    try:
        wait_for(lambda: srv.refused["pid_limit"] == 996)
        skipped[0] += 0.7
        held += hold(srv.path, 10)       # refusals after the interval bring the summary
        wait_for(lambda: srv.refused["pid_limit"] == 1006)
        wait_for(lambda: any("suppressed" in line for line in warnings_logged()),
                 message=lambda: f"a summary line; logged: {warnings_logged()}")
        lines = warnings_logged()
        assert len(lines) <= 3, lines
        assert "refusing" in lines[0] and "pid_limit" in lines[0]
        assert any("suppressed" in line for line in lines[1:]), lines
    finally:
        for s in held:
            s.close()


def test_stalled_partial_frame_is_closed_idle_connection_is_not(make_server):
    srv = make_server(frame_timeout=0.5)
    stalled, idle = hold(srv.path, 2)
    try:
        frame = events.encode(start_event())
        stalled.sendall(frame[:3])           # a header never finished (slowloris)
        stalled.settimeout(5)
        assert stalled.recv(1) == b""        # the agent hung up
        assert srv.evicted["stalled_frame"] == 1
        assert events.REJECT_TRUNCATED in srv.rec.rejects
        # an idle hook between saves sends nothing and keeps its connection
        idle.sendall(frame)
        wait_for(lambda: len(srv.rec.events) == 1)
        assert srv.connections == 1
    finally:
        stalled.close()
        idle.close()


def hazard_event(pid, i):
    return {"v": 1, "type": "hazard", "kind": "local_rank_guard", "node": "n1", "pid": pid,
            "seq": i, "path": f"/ckpt/{i}.pt", "shared": "mount:nfs4", "wall": time.time()}


def test_job_scope_events_are_rate_limited_per_connection_writes_are_not(make_server):
    """A local process may say anything about other nodes (remote, hazard, jobscope events
    cannot be checked): it may say only so much. Its own start events still all get in."""
    from monitor.ingest.connections import JOB_SCOPE_BURST
    from ckptwatch import events
    srv = make_server()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(srv.path)
    flood = 4 * int(JOB_SCOPE_BURST)
    frames = b"".join(events.encode(hazard_event(os.getpid(), i)) for i in range(flood))
    frames += b"".join(events.encode(start_event(seq)) for seq in range(1, 101))
    sock.sendall(frames)
    wait_for(lambda: len(srv.rec.events) + len(srv.rec.rejects) >= flood + 100, timeout=20)
    sock.close()
    hazards = [e for e in srv.rec.events if e["type"] == "hazard"]
    starts = [e for e in srv.rec.events if e["type"] == "start"]
    assert len(starts) == 100
    # The burst, plus what the refill allowed while the frames were read (well under a second).
    assert JOB_SCOPE_BURST <= len(hazards) < JOB_SCOPE_BURST + 200
    assert srv.rec.rejects.count("rate_limited") == flood - len(hazards)
