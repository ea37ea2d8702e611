"""ckptwatch.emitter: acknowledgements, resending, and whatever an agent may send back (the
hook must survive all of it).

In-process Emitters against real Unix sockets: the test Receiver (tests/support/receiver.py, acking
like an agent when asked) or a hand-driven server socket."""
import os
import socket
import time

import pytest

from helpers import wait_for
from ckptwatch import emitter as emitter_mod
from ckptwatch import events
from receiver import Receiver
from wire import end_event, start_event


class Server:
    """A hand-driven agent: accepts one connection at a time and reads what the test asks."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.settimeout(10)
        self.conn = None
        self.reader = events.FrameReader()

    def accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(10)
        self.reader = events.FrameReader()

    def read(self, count: int) -> list[dict]:
        """The next `count` frames, decoded."""
        got = []
        while len(got) < count:
            data = self.conn.recv(65536)
            assert data, f"connection closed after {len(got)} of {count} frames"
            got += [events.decode(p) for p in self.reader.feed(data)]
        assert len(got) == count, got
        return got

    def send(self, data: bytes) -> None:
        self.conn.sendall(data)

    def drop(self) -> None:
        """Die as a killed agent does: frames still unread on the connection are lost."""
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        self.conn.close()
        self.listener.close()


def test_every_connection_opens_with_a_hello_asking_for_acks(sock, make_emitter):
    with Receiver(sock) as rx:
        emitter = make_emitter(sock)
        emitter.emit(end_event(1))
        rx.wait_count("end", 1)
        assert rx.hellos == [{"v": 1, "type": "hello", "node": rx.hellos[0]["node"],
                              "pid": os.getpid(), "ack": True}]


def test_acknowledged_frames_are_forgotten(sock, make_emitter):
    with Receiver(sock, ack=True) as rx:
        emitter = make_emitter(sock)
        for seq in range(1, 101):
            emitter.emit(end_event(seq))
        rx.wait_count("end", 100)
        wait_for(lambda: emitter.stats()["unacked"] == 0, timeout=5,
                 message="every frame acknowledged")


def test_frames_the_agent_did_not_acknowledge_go_again_to_the_next_one(sock, make_emitter):
    server = Server(sock)
    emitter = make_emitter(sock)
    for seq in range(1, 11):
        emitter.emit(end_event(seq))
    server.accept()
    assert [f["type"] for f in server.read(11)] == ["hello"] + ["end"] * 10
    server.send(events.ack_frame(5))         # the hello and ends 1-4 were taken in
    wait_for(lambda: emitter.stats()["unacked"] == 6, message="the ack read")
    server.drop()                           # killed before taking in 5-10
    with Receiver(sock, ack=True) as rx:
        ends = rx.wait_count("end", 6, timeout=10)
        assert [e["seq"] for e in ends] == [5, 6, 7, 8, 9, 10]
        assert emitter.stats()["resent"] == 6
        emitter.emit(end_event(11))       # and the new connection carries on
        assert [e["seq"] for e in rx.wait_count("end", 7)][-1] == 11
        assert len(rx.hellos) == 1


def test_an_agent_that_never_acknowledges_gets_nothing_twice(sock, make_emitter):
    # An older agent: what was written is taken as delivered, as before acks existed.
    server = Server(sock)
    emitter = make_emitter(sock)
    for seq in range(1, 4):
        emitter.emit(end_event(seq))
    server.accept()
    server.read(4)
    server.drop()
    with Receiver(sock) as rx:
        emitter.emit(end_event(4))
        emitter.emit(end_event(5))
        rx.wait_count("end", 2)      # one connection keeps order: a resend would come first
        assert [e["seq"] for e in rx.events] == [4, 5]
        assert emitter.stats()["resent"] == 0


def test_what_is_kept_for_resending_is_bounded(sock, make_emitter, monkeypatch):
    monkeypatch.setattr(emitter_mod, "MAX_UNACKED", 50)
    server = Server(sock)
    emitter = make_emitter(sock)
    emitter.emit(end_event(1))
    server.accept()
    server.read(2)
    server.send(events.ack_frame(1))
    wait_for(lambda: emitter.stats()["unacked"] == 1, message="the first ack")
    for seq in range(2, 302):
        emitter.emit(end_event(seq))
    server.read(300)
    wait_for(lambda: emitter.stats()["sent"] == 301, message="all written and counted")
    stats = emitter.stats()
    assert stats["unacked"] == 50
    assert stats["unconfirmed"] == 301 - 50
    server.drop()


@pytest.mark.parametrize("garbage", [
    events.frame(b'{"v":1,"type":"ack","n":-1}'),
    events.frame(b'{"v":1,"type":"ack","n":99999999999999999999999}'),
    events.frame(b'{"v":1,"type":"ack","n":1e9}'),
    events.frame(b'{"v":2,"type":"ack","n":3}'),
    events.frame(b'{"v":1,"type":"ack"}'),
    events.frame(b'[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[['),
    events.frame(b"\xff\xfe not utf-8"),
    events.frame(b'{"v":1,"type":"notice","kind":"concurrent"}'),
    b"\x00\x00\x10\x01" + b"x" * 4097,          # oversized: reading stops on this connection
    b"\x00\x00\x00",                             # a cut header
], ids=["negative", "huge", "float", "version", "missing", "deep", "bytes", "notice",
        "oversized", "cut"])
def test_whatever_the_agent_sends_the_hook_carries_on(sock, make_emitter, garbage):
    server = Server(sock)
    emitter = make_emitter(sock)
    emitter.emit(end_event(1))
    server.accept()
    server.read(2)
    server.send(garbage)
    server.send(events.ack_frame(10 ** 6))     # more than was ever sent: no harm either
    for seq in range(2, 5):
        emitter.emit(end_event(seq))
    assert [f["seq"] for f in server.read(3)] == [2, 3, 4]
    stats = emitter.stats()
    assert stats["errors"] == 0 and stats["unacked"] >= 0
    server.drop()


def test_an_ack_forgets_exactly_the_frames_it_counts():
    # An ack says how many frames of the connection the agent has taken in, from its start:
    # a repeated or smaller count forgets nothing more, a count beyond what is kept forgets
    # all that is kept, and later counts are read against the running total (the frames a
    # partial ack left are the ones sent again after a lost connection).
    emitter = emitter_mod.Emitter("/nonexistent/ckptwatch.sock")
    frames = [b"frame-%d" % i for i in range(1, 8)]
    emitter._unacked.extend(frames[:5])
    emitter._acknowledged(2)
    assert list(emitter._unacked) == frames[2:5]
    emitter._acknowledged(2)
    emitter._acknowledged(1)
    assert list(emitter._unacked) == frames[2:5]
    emitter._acknowledged(4)
    assert list(emitter._unacked) == frames[4:5]
    emitter._unacked.extend(frames[5:])
    emitter._acknowledged(6)
    assert list(emitter._unacked) == frames[6:]
    emitter._acknowledged(7)
    assert not emitter._unacked
    emitter._unacked.append(b"frame-8")
    emitter._acknowledged(7)
    assert list(emitter._unacked) == [b"frame-8"]
    emitter._acknowledged(20)                 # beyond what is kept: all of it
    assert not emitter._unacked
    emitter.shutdown(0)
