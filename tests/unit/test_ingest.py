"""monitor.ingest.server with real Unix sockets: delivery, every reject reason, isolation, socket path."""
import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from helpers import wait_for
from wire import Recorder, connect, start_event
from ckptwatch import events
from monitor.ingest.server import HANGUP, AgentAlreadyRunning, IngestError, IngestServer


@pytest.fixture
def server(sockdir, no_thread_leak):
    rec = Recorder()
    srv = IngestServer(os.path.join(sockdir, "sub", "agent.sock"), rec.on_events, rec.on_reject)
    srv.start()
    srv.rec = rec
    yield srv
    srv.stop()


def test_valid_events_delivered_in_order(server):
    with connect(server.path) as sock:
        sock.sendall(b"".join(events.encode(start_event(seq=i)) for i in range(500)))
        wait_for(lambda: len(server.rec.events) == 500)
    assert [e["seq"] for e in server.rec.events] == list(range(500))
    assert server.rec.rejects == []


def test_socket_dir_created_and_mode_0660(server):
    st = os.stat(server.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_socket_mode_and_group_configurable(sockdir, no_thread_leak):
    path = os.path.join(sockdir, "a.sock")
    srv = IngestServer(path, lambda e: None, lambda r: None, socket_mode=0o600,
                       socket_group=os.getgid())
    srv.start()
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_gid == os.getgid()
    finally:
        srv.stop()


def frame(payload: bytes) -> bytes:
    return events.HEADER.pack(len(payload)) + payload


BAD_INPUTS = {
    "malformed": frame(b"\xff\xfe not json"),
    "unknown_version": events.encode({**start_event(), "v": 99}),
    "incomplete": events.encode({k: v for k, v in start_event().items() if k != "path"}),
    "pid_mismatch": events.encode(start_event(pid=1)),
}


@pytest.mark.parametrize("reason", sorted(BAD_INPUTS))
def test_bad_frame_rejected_connection_keeps_working(server, reason):
    with connect(server.path) as sock:
        sock.sendall(BAD_INPUTS[reason] + events.encode(start_event(seq=7)))
        wait_for(lambda: server.rec.events)
    assert server.rec.rejects == [reason]
    assert [e["seq"] for e in server.rec.events] == [7]


def test_random_bytes_rejected(server):
    rng = random.Random(1)
    with connect(server.path) as sock:
        # A small length header followed by junk: decodes as a malformed frame.
        sock.sendall(frame(bytes(rng.randrange(256) for _ in range(300))))
        wait_for(lambda: server.rec.rejects)
    assert server.rec.rejects == ["malformed"]


def test_oversized_frame_rejected_and_connection_closed(server):
    with connect(server.path) as sock:
        sock.sendall(events.HEADER.pack(events.MAX_FRAME_BYTES + 1) + b"x" * 100)
        wait_for(lambda: server.rec.rejects)
        sock.settimeout(5)
        assert sock.recv(1) == b""          # the agent closed the unframeable stream
    assert server.rec.rejects == ["oversized"]
    wait_for(lambda: server.connections == 0)


def test_truncated_frame_at_eof(server):
    data = events.encode(start_event())
    with connect(server.path) as sock:
        sock.sendall(data[:-5])
    wait_for(lambda: server.rec.rejects)
    assert server.rec.rejects == ["truncated"]
    assert server.rec.events == []


def test_good_client_unaffected_by_bad_one(server):
    good, bad = connect(server.path), connect(server.path)
    try:
        wait_for(lambda: server.connections == 2)
        rng = random.Random(2)
        good.sendall(events.encode(start_event(seq=1)))
        for _ in range(20):
            bad.sendall(frame(bytes(rng.randrange(256) for _ in range(50))))
        good.sendall(events.encode(start_event(seq=2)))
        bad.sendall(events.HEADER.pack(10 ** 9))       # oversized: bad gets disconnected
        wait_for(lambda: server.connections == 1)
        good.sendall(events.encode(start_event(seq=3)))
        wait_for(lambda: len(server.rec.events) == 3)
    finally:
        good.close()
        bad.close()
    assert [e["seq"] for e in server.rec.events] == [1, 2, 3]
    assert server.rec.rejects.count("oversized") == 1


SENDER = """
import os, socket, sys, time
sys.path.insert(0, {root!r})
from ckptwatch import events
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({path!r})
ev = {{"v": 1, "type": "start", "node": "n", "pid": os.getpid() + int(sys.argv[1]), "seq": 0,
      "path": "/x", "wall": time.time(), "mono": time.monotonic()}}
s.sendall(events.encode(ev))
s.close()
"""


def test_pid_checked_against_peer_credentials_of_other_process(server):
    code = SENDER.format(root=os.path.dirname(os.path.dirname(os.path.abspath(events.__file__))),
                         path=server.path)
    subprocess.run([sys.executable, "-c", code, "0"], check=True, timeout=30)
    subprocess.run([sys.executable, "-c", code, "1"], check=True, timeout=30)
    wait_for(lambda: server.rec.events and server.rec.rejects)
    assert len(server.rec.events) == 1 and server.rec.events[0]["pid"] != os.getpid()
    assert server.rec.rejects == ["pid_mismatch"]


def test_callback_exception_does_not_kill_server(sockdir, no_thread_leak):
    got = []

    def on_events(batch):
        got.extend(batch)
        if len(got) == 1:
            raise RuntimeError("boom")

    srv = IngestServer(os.path.join(sockdir, "c.sock"), on_events, lambda r: None)
    srv.start()
    try:
        with connect(srv.path) as sock:
            # One read each: the second event comes after the callback raised on the first.
            sock.sendall(events.encode(start_event(seq=1)))
            wait_for(lambda: len(got) == 1)
            sock.sendall(events.encode(start_event(seq=2)))
            wait_for(lambda: len(got) == 2)
        assert srv.alive and srv.errors_total == 1
    finally:
        srv.stop()


def test_stale_socket_replaced(sockdir, no_thread_leak):
    path = os.path.join(sockdir, "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()                     # the file stays, nobody listens: what a killed agent leaves
    rec = Recorder()
    srv = IngestServer(path, rec.on_events, rec.on_reject)
    srv.start()
    try:
        with connect(path) as sock:
            sock.sendall(events.encode(start_event()))
            wait_for(lambda: rec.events)
    finally:
        srv.stop()
    assert not os.path.exists(path)


def test_live_agent_is_not_replaced(server):
    other = IngestServer(server.path, lambda e: None, lambda r: None)
    with pytest.raises(AgentAlreadyRunning, match="already listening"):
        other.start()
    # The running server still owns and serves its socket.
    with connect(server.path) as sock:
        sock.sendall(events.encode(start_event()))
        wait_for(lambda: server.rec.events)


def test_non_socket_file_is_never_deleted(sockdir):
    path = os.path.join(sockdir, "precious")
    with open(path, "w") as fh:
        fh.write("data")
    srv = IngestServer(path, lambda e: None, lambda r: None)
    with pytest.raises(IngestError, match="not a socket"):
        srv.start()
    with open(path) as fh:
        assert fh.read() == "data"


def test_stop_removes_only_our_socket(sockdir, no_thread_leak):
    path = os.path.join(sockdir, "mine.sock")
    srv = IngestServer(path, lambda e: None, lambda r: None)
    srv.start()
    os.unlink(path)                  # someone replaced the file meanwhile
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path)
    try:
        srv.stop()
        assert os.path.exists(path)
    finally:
        other.close()
    srv.stop()                       # idempotent


def test_stop_closes_connections_and_removes_socket(sockdir, no_thread_leak):
    path = os.path.join(sockdir, "s.sock")
    srv = IngestServer(path, lambda e: None, lambda r: None)
    srv.start()
    client = connect(path)
    wait_for(lambda: srv.connections == 1)
    srv.stop()
    client.settimeout(5)
    assert client.recv(1) == b""
    client.close()
    assert not os.path.exists(path)
    assert not srv.alive


def _can_unshare_pid() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs unshare --pid (root)")
def test_trainer_in_its_own_pid_namespace_is_accepted_with_its_node_pid(server):
    """A container without hostPID calls itself pid 1; the agent accepts the claim because
    the kernel says so (NSpid) and records the node-unique pid instead."""
    code = SENDER.format(root=os.path.dirname(os.path.dirname(os.path.abspath(events.__file__))),
                         path=server.path)
    for offset in ("0", "1"):   # an honest claim, then a lie from inside the namespace
        subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                        code, offset], check=True, timeout=30)
    wait_for(lambda: server.rec.events and server.rec.rejects)
    (event,) = server.rec.events
    assert event["pid"] > 1          # the agent-visible pid, not the container's 1
    assert server.rec.rejects == ["pid_mismatch"]


def test_peer_rights_read_the_innermost_nspid(tmp_path):
    # The namespace pid a connection's events may claim (monitor.verify.rights.peer_rights).
    from monitor.verify.rights import peer_rights

    def namespace_pid(pid, proc_root="/proc"):
        return peer_rights(pid, os.getuid(), os.getgid(), proc_root=proc_root)[1]

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("Name:\tpython\nNSpid:\t42\t7\t1\nPPid:\t1\n")
    assert namespace_pid(42, proc_root=str(tmp_path)) == 1
    assert namespace_pid(43, proc_root=str(tmp_path)) is None
    assert namespace_pid(os.getpid()) == os.getpid()   # innermost = what getpid() says


def test_backlog_above_the_limit_pauses_reading_until_the_consumer_catches_up(sockdir,
                                                                               no_thread_leak):
    got, rejects = [], []
    backlog = [10]   # the consumer's queue, as the daemon's Inbox would report it
    asked = [0]      # how often the server thread looked at the backlog

    def consumer_backlog() -> int:
        asked[0] += 1
        return backlog[0]

    srv = IngestServer(os.path.join(sockdir, "bp.sock"), got.extend, rejects.append,
                       backlog=consumer_backlog, max_backlog=5)
    srv.start()
    try:
        with connect(srv.path) as sock:
            sock.sendall(b"".join(events.encode(start_event(seq=i)) for i in range(50)))
            # Proving an absence: the server thread went round its loop many times with the
            # frames waiting on the socket, still backed up, and read none of them.
            seen = asked[0]
            wait_for(lambda: asked[0] >= seen + 20 or got, message="the server looping")
            assert got == []
            backlog[0] = 0
            wait_for(lambda: len(got) == 50, message="events after the backlog cleared")
        assert [e["seq"] for e in got] == list(range(50)) and rejects == []
    finally:
        srv.stop()


def test_backlog_limit_holds_with_many_busy_connections(sockdir, no_thread_leak):
    """Back-pressure must bound what one turn of the server reads, not only when it starts:
    with 12 connections each holding a full socket buffer of frames, the events handed over
    past max_backlog are at most one read's worth (one chunk), not every connection's 8 reads
    (the soak saw 140,000 queued events, 170 MB, at a limit of 20,000)."""
    got, rejects = [], []
    paused = [True]
    asked = [0]

    def consumer_backlog() -> int:      # a consumer that never takes anything
        asked[0] += 1
        return 10 ** 9 if paused[0] else len(got)

    limit = 1000
    srv = IngestServer(os.path.join(sockdir, "bm.sock"), got.extend, rejects.append,
                       backlog=consumer_backlog, max_backlog=limit)
    srv.start()
    frame = events.encode(start_event())
    socks = [connect(srv.path) for _ in range(12)]
    try:
        queued = 0
        for sock in socks:              # fill every socket buffer while the server is paused
            sock.setblocking(False)
            try:
                while True:
                    queued += sock.send(frame * 64) // len(frame)
            except BlockingIOError:
                pass
        assert queued > 4 * limit
        paused[0] = False
        wait_for(lambda: len(got) > limit, message="the server reading up to the limit")
        seen = asked[0]
        wait_for(lambda: asked[0] >= seen + 20, message="the server looping, backed up")
        one_chunk = 256 * 1024 // len(frame) + 1
        assert limit < len(got) <= limit + one_chunk, (len(got), queued)
    finally:
        for sock in socks:
            sock.close()
        srv.stop()


def test_a_quiet_connection_is_not_starved_by_busy_ones_at_the_backlog_limit(
        sockdir, no_thread_leak):
    """At the backlog limit a turn reads only the first ready connections; the next turn must
    start with the ones it skipped. Otherwise the same busy connections come first every time
    (epoll reports them in a stable order) and a hook's event, ready last, waits for the
    flood to end (the soak saw real collisions reported 10 to 19 s late)."""
    got, rejects, quiet_seen = [], [], threading.Event()
    taken = [0]
    limit = 500

    def on_events(batch):
        got.extend(batch)
        if any(e["seq"] == 424242 for e in batch):
            quiet_seen.set()

    def consumer_backlog() -> int:
        return len(got) - taken[0]

    srv = IngestServer(os.path.join(sockdir, "fair.sock"), on_events, rejects.append,
                       backlog=consumer_backlog, max_backlog=limit)
    srv.start()
    stop = threading.Event()
    busy = [connect(srv.path) for _ in range(8)]
    chunk = b"".join(events.encode(start_event(seq=1)) for _ in range(200))

    def flood(sock):
        try:
            while not stop.is_set():
                sock.sendall(chunk)
        except OSError:
            pass

    def consume():                      # a consumer slower than the flood
        while not stop.is_set():
            taken[0] = min(len(got), taken[0] + 200)
            stop.wait(0.005)

    threads = [threading.Thread(target=flood, args=(s,)) for s in busy]
    threads.append(threading.Thread(target=consume))
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(got) > 20 * limit, message="the flood flowing")
        with connect(srv.path) as quiet:
            quiet.sendall(events.encode(start_event(seq=424242)))
            wait_for(quiet_seen.is_set, timeout=10,
                     message="the quiet connection's event during the flood")
    finally:
        stop.set()
        for sock in busy:
            sock.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(10)
        for sock in busy:
            sock.close()
        srv.stop()


def test_batched_delivery_hands_over_lists_of_valid_events_only(sockdir, no_thread_leak):
    batches, rejects = [], []
    srv = IngestServer(os.path.join(sockdir, "b.sock"), batches.append, rejects.append)
    srv.start()
    try:
        with connect(srv.path) as sock:
            frames = [events.encode(start_event(seq=i)) for i in range(100)]
            frames.insert(50, events.encode(start_event(pid=1)))   # a spoofed one in between
            sock.sendall(b"".join(frames))
            wait_for(lambda: sum(map(len, batches)) == 100 and rejects)
        assert all(isinstance(b, list) and b for b in batches)
        assert [e["seq"] for b in batches for e in b] == list(range(100))
        assert rejects == ["pid_mismatch"]
    finally:
        srv.stop()


FORK_SENDER = r"""
import os, socket, sys, time
sys.path.insert(0, {root!r})
from ckptwatch import events
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({path!r})
parent = os.getpid()
def ev(seq):
    return events.encode({{"v": 1, "type": "start", "node": "n1", "pid": parent, "seq": seq,
                          "path": "/ckpt/fork.pt", "wall": time.time(),
                          "mono": time.monotonic()}})
s.sendall(ev(1))                      # the parent's own event: accepted
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    os.read(r, 1)                     # returns b"" once the parent has exited
    s.sendall(ev(2) + ev(3))          # the child speaks as its exited parent
    print("child sent", flush=True)
    os._exit(0)
os._exit(0)                           # the parent exits; the child keeps the connection
"""


def test_forked_child_cannot_speak_as_its_exited_parent(server):
    """A forked child inherits its parent's connection: its events claim the parent's pid,
    which SO_PEERCRED vouches for. The kernel's per-message credentials name the real
    sender, so they are rejected and the connection closed (issue 8 item 7c)."""
    code = FORK_SENDER.format(
        root=os.path.dirname(os.path.dirname(os.path.abspath(events.__file__))),
        path=server.path)
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                          timeout=30)
    assert proc.returncode == 0
    wait_for(lambda: server.rec.rejects or len(server.rec.events) > 1,
             message="the child's events judged")
    # Whatever else the child sent has been read once its connection is gone (closed by the
    # server, or at the child's exit: both processes have exited by now).
    wait_for(lambda: server.connections == 0, message="the child's connection read to its end")
    assert [e["seq"] for e in server.rec.events] == [1]
    assert server.rec.rejects == ["pid_mismatch"]
    assert server.evicted["foreign_writer"] == 1


def test_a_peer_that_hangs_up_is_reported_after_its_events_when_asked(sockdir, no_thread_leak):
    """hangups=True (the agent): a connection ended by its process gives one more batch, a
    hang-up naming the peer's pid and when the end was read, after that connection's events.
    A sender cannot send one itself: the type is unknown on the wire."""
    rec = Recorder()
    srv = IngestServer(os.path.join(sockdir, "h.sock"), rec.on_events, rec.on_reject,
                       hangups=True)
    srv.start()
    try:
        before = time.monotonic()
        with connect(srv.path) as sock:
            sock.sendall(events.encode(start_event(seq=3))
                         + events.encode({**start_event(seq=4), "type": "hangup"}))
            wait_for(lambda: rec.events and rec.rejects)
        wait_for(lambda: len(rec.events) == 2)
        started, hangup = rec.events
        assert started["type"] == "start" and started["seq"] == 3
        assert hangup["type"] == HANGUP and hangup["pid"] == os.getpid()
        assert before <= hangup["mono"] <= time.monotonic()
        assert abs(hangup["wall"] - time.time()) < 60
        assert rec.rejects == ["incomplete"]        # the forged one
    finally:
        srv.stop()


def test_no_hangups_unless_asked(server):
    with connect(server.path) as sock:
        sock.sendall(events.encode(start_event(seq=1)))
        wait_for(lambda: server.rec.events)
    with connect(server.path) as sock:          # a later connection's event comes after
        sock.sendall(events.encode(start_event(seq=2)))
        wait_for(lambda: len(server.rec.events) == 2)
    assert [e["type"] for e in server.rec.events] == ["start", "start"]


class _TimedSelector:
    """Wraps the server's selector: when each select() was entered and returned, and whether
    it returned a connection (a turn that reads)."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = []         # (entered, returned, read a connection)

    def select(self, timeout=None):
        entered = time.monotonic()
        ready = self._inner.select(timeout)
        self.calls.append((entered, time.monotonic(),
                           any(key.data is not None for key, _ in ready)))
        return ready

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_after_a_turn_that_read_the_server_pauses_before_selecting_again(sockdir,
                                                                          no_thread_leak):
    # Issue 22: each frame a hook sends wakes a reader waiting on its socket, paid in the
    # saving process's system time. After a turn that read, the server lets read_pause pass
    # before it waits on the sockets again; frames sent meanwhile are all delivered.
    pause = 0.05
    batches = []
    srv = IngestServer(os.path.join(sockdir, "pace.sock"), batches.append, lambda r: None,
                       read_pause=pause)
    srv.start()
    timed = srv._selector = _TimedSelector(srv._selector)
    try:
        with connect(srv.path) as sock:
            for i in range(40):
                sock.sendall(events.encode(start_event(seq=i)))
                if i % 8 == 0:
                    wait_for(lambda: sum(map(len, batches)) == i + 1)
            wait_for(lambda: sum(map(len, batches)) == 40)
        assert [e["seq"] for b in batches for e in b] == list(range(40))
        wait_for(lambda: len(timed.calls) >= 2)
        calls = list(timed.calls)
        turns = [(calls[k][1], calls[k + 1][0]) for k in range(len(calls) - 1) if calls[k][2]]
        assert len(turns) >= 5
        for returned, entered_next in turns:
            assert entered_next - returned >= pause
    finally:
        srv.stop()



def test_a_new_connection_ends_the_pause_and_its_frames_are_read_at_once(sockdir,
                                                                        no_thread_leak):
    # The pause keeps an established connection's frames from waking the server; a new
    # connection -- a resume guard's query, which has 5 ms for its answer -- ends it, and the
    # turn that accepted it is not followed by a pause, so its first frame is read at once
    # (here: well within a pause of 30 s).
    batches = []
    srv = IngestServer(os.path.join(sockdir, "pause.sock"), batches.append, lambda r: None,
                       read_pause=30.0)
    srv.start()
    try:
        with connect(srv.path) as first:
            first.sendall(events.encode(start_event(seq=1)))
            wait_for(lambda: sum(map(len, batches)) == 1, message="the first frame")
            # the server now pauses for 30 s after the turn that read it
            with connect(srv.path) as second:
                second.sendall(events.encode(start_event(seq=2)))
                wait_for(lambda: sum(map(len, batches)) == 2, timeout=10,
                         message="the new connection's frame, within the pause")
    finally:
        srv.stop()
    assert [e["seq"] for b in batches for e in b] == [1, 2]
