"""monitor.ingest.server's one outgoing path: notices to hooks that asked for them (warn policy).

Real IngestServer, real Unix socket clients in this process (their pid is ours, so the
server's pid check passes)."""
import os
import socket

import pytest

from ckptwatch import events
from monitor.ingest import server as ingest
from monitor.ingest.server import IngestServer
from helpers import wait_for
from wire import Recorder, connect, start_event


@pytest.fixture
def server(sockdir, no_thread_leak):
    rec = Recorder()
    srv = IngestServer(os.path.join(sockdir, "agent.sock"), rec.on_events, rec.on_reject)
    srv.start()
    srv.rec = rec
    yield srv
    srv.stop()


MADE = [(1, "/ckpt/last.pt")]      # start_event()'s write: what the notices here are about


def notice(n: int = 0) -> bytes:
    return events.encode({"v": 1, "type": "notice", "kind": "concurrent",
                          "path": f"/ckpt/{n}.pt", "site": "t.py:1", "others": []})


def frames_in(sock: socket.socket, timeout: float = 2.0) -> list[bytes]:
    """The frames that arrive, the first within `timeout`, until the socket is quiet for 0.3 s:
    the server sends what it has in one turn, so a pause that long means no more is coming."""
    reader = events.FrameReader(events.MAX_NOTICE_BYTES)
    got = []
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                break
            got += reader.feed(data)
            sock.settimeout(0.3)
    except (socket.timeout, BlockingIOError):
        pass
    assert not reader.pending(), "a notice frame was cut"
    return got


def test_only_connections_that_asked_get_notices_and_the_flag_is_not_passed_on(server):
    asking, silent = connect(server.path), connect(server.path)
    asking.sendall(events.encode(start_event(notices=True)))
    silent.sendall(events.encode(start_event(seq=2)))
    wait_for(lambda: len(server.rec.events) == 2, message="two starts")
    assert all("notices" not in e for e in server.rec.events)
    server.notify(os.getpid(), notice(), MADE)
    assert [events.decode_notice(f)["path"] for f in frames_in(asking)] == ["/ckpt/0.pt"]
    silent.setblocking(False)
    with pytest.raises(BlockingIOError):
        silent.recv(10)
    assert server.notices["sent"] == 1
    server.notify(os.getpid() + 1, notice(), MADE)       # nobody of that pid: counted
    wait_for(lambda: server.notices["no_reader"] == 1, message="no reader")
    asking.close()
    silent.close()


def test_a_hook_that_never_reads_cannot_block_the_agent_nor_break_its_stream(server):
    client = connect(server.path)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.sendall(events.encode(start_event(notices=True)))
    wait_for(lambda: server.rec.events, message="start")
    for n in range(3000):
        server.notify(os.getpid(), notice(n), MADE)
    wait_for(lambda: server.notices["sent"] + server.notices["dropped"] == 3000,
             timeout=10, message="every notice sent or dropped")
    assert server.notices["dropped"] > 0
    # The agent kept serving: a new event is still taken in at once.
    client.sendall(events.encode(start_event(seq=2)))
    wait_for(lambda: len(server.rec.events) == 2, message="the agent still reads")
    # What did arrive is whole frames only, each a valid notice (a partly sent frame was
    # finished before the next one).
    got = frames_in(client)
    assert got and all(events.decode_notice(f) is not None for f in got)
    client.close()


def test_the_notice_queue_is_bounded(sockdir):
    srv = IngestServer(os.path.join(sockdir, "idle.sock"), lambda e: None, lambda r: None)
    for n in range(ingest.MAX_NOTICES + 50):     # not serving: nothing drains the queue
        srv.notify(1, notice(n), MADE)
    assert len(srv._notices) == ingest.MAX_NOTICES
    assert srv.notices["dropped"] == 50


@pytest.mark.parametrize("claim", [1, "true", [True], None])
def test_only_a_literal_true_asks_for_notices(server, claim):
    client = connect(server.path)
    client.sendall(events.encode(start_event(notices=claim)))
    wait_for(lambda: server.rec.events, message="start")
    assert "notices" not in server.rec.events[0]
    server.notify(os.getpid(), notice(), MADE)
    wait_for(lambda: server.notices["no_reader"] == 1, message="no reader")
    client.close()


# ---- a notice reaches only the connection that made the write (issue 17 item 1) -----------

def test_a_notice_goes_only_to_the_connection_that_made_the_write(server):
    # Three connections of one process (the pid check passes for all): only the one whose
    # own frame named (seq 1, /ckpt/a.pt) gets the notice about it. On the old code every
    # connection of the pid that asked for notices got it, so a process that reused a dead
    # writer's pid, or one a forged "remote" report named, was told about a write it never
    # made.
    maker, other, idle = (connect(server.path) for _ in range(3))
    maker.sendall(events.encode(start_event(seq=1, path="/ckpt/a.pt", notices=True)))
    other.sendall(events.encode(start_event(seq=1, path="/ckpt/b.pt", notices=True)))
    idle.sendall(events.encode({"v": 1, "type": "hello", "node": "n1", "pid": os.getpid(),
                                "notices": True}))
    wait_for(lambda: len(server.rec.events) == 2, message="two starts")
    server.notify(os.getpid(), notice(1), [(1, "/ckpt/a.pt")])
    assert [events.decode_notice(f)["path"] for f in frames_in(maker)] == ["/ckpt/1.pt"]
    for sock in (other, idle):
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(10)
    server.notify(os.getpid(), notice(2), [(2, "/ckpt/a.pt")])     # a write nobody made
    wait_for(lambda: server.notices["no_reader"] == 1, message="no reader")
    assert server.notices["sent"] == 1
    for sock in (maker, other, idle):
        sock.close()


def test_a_connection_remembers_a_bounded_number_of_its_writes(server):
    from monitor.ingest.connections import MAX_WRITES_REMEMBERED
    client = connect(server.path)
    total = MAX_WRITES_REMEMBERED + 40
    client.sendall(b"".join(events.encode(start_event(seq=n, notices=True))
                            for n in range(1, total + 1)))
    wait_for(lambda: len(server.rec.events) == total, message="every start")
    (conn,) = server._conns.by_fd.values()
    assert len(conn.writes) == MAX_WRITES_REMEMBERED
    server.notify(os.getpid(), notice(1), [(1, "/ckpt/last.pt")])           # forgotten
    server.notify(os.getpid(), notice(2), [(total, "/ckpt/last.pt")])       # remembered
    assert [events.decode_notice(f)["path"] for f in frames_in(client)] == ["/ckpt/2.pt"]
    assert server.notices["no_reader"] == 1
    client.close()
