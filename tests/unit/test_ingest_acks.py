"""monitor.ingest.server's acknowledgements: a hook that asked (hello "ack": true) is told how many of
its frames the agent has taken in -- handed on and finished by the consumer -- and nothing more.

Real IngestServer, real Unix socket clients in this process (their pid is ours, so the server's
pid check passes). The consumer's progress is the test's to set (processed=)."""
import os
import socket
import time

import pytest

from ckptwatch import events
from monitor.ingest import server as ingest
from monitor.ingest.server import IngestServer
from helpers import wait_for
from wire import Recorder, connect, start_event


class Consumer(Recorder):
    """on_events + processed(): batches are handed on, and finished when the test says."""

    def __init__(self):
        super().__init__()
        self.batches = 0
        self.finished = 0

    def on_events(self, batch):
        with self.lock:
            self.events.extend(batch)
            self.batches += 1

    def processed(self) -> int:
        return self.finished


@pytest.fixture
def consumer():
    return Consumer()


@pytest.fixture
def server(sockdir, consumer, no_thread_leak):
    srv = IngestServer(os.path.join(sockdir, "agent.sock"), consumer.on_events,
                       consumer.on_reject, processed=consumer.processed)
    srv.start()
    yield srv
    srv.stop()


def hello(**extra) -> bytes:
    return events.encode({"v": 1, "type": "hello", "node": "n1", "pid": os.getpid(),
                          "ack": True, **extra})


# How long a test listens to prove that no ack comes: an owed ack goes out within one
# ACK_INTERVAL of its frames being finished (the server's loop turns at least that often while
# one is owed), so three intervals and slack without one mean there is none.
NO_ACK_WITHIN = 3 * ingest.ACK_INTERVAL + 0.2


def acks_in(sock: socket.socket, wait: float) -> list[int]:
    """The ack counts that arrive within `wait` seconds (every frame must be an ack)."""
    reader = events.FrameReader(events.MAX_NOTICE_BYTES)
    got = []
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except socket.timeout:
            break
        if not data:
            break
        for payload in reader.feed(data):
            kind, value = events.decode_agent_frame(payload)
            assert kind == "ack", payload
            got.append(value)
    return got


def test_frames_are_acknowledged_only_once_the_consumer_has_finished_them(server, consumer):
    with connect(server.path) as sock:
        sock.sendall(hello() + b"".join(events.encode(start_event(seq=i)) for i in (1, 2, 3)))
        wait_for(lambda: consumer.batches == 1, message="a batch handed on")
        # Handed on, not finished: an agent killed now would lose them, so no ack yet.
        assert acks_in(sock, NO_ACK_WITHIN) == []
        consumer.finished = 1
        # hello + 3 events; the hello is not an event (not handed on).
        assert acks_in(sock, 1.0)[-1:] == [4]
        assert [e["type"] for e in consumer.events] == ["start"] * 3


def test_acks_are_cumulative_and_count_rejected_frames(server, consumer):
    with connect(server.path) as sock:
        sock.sendall(hello() + events.encode(start_event(seq=1)))
        wait_for(lambda: consumer.batches == 1, message="first batch")
        consumer.finished = 1
        assert acks_in(sock, 1.0)[-1:] == [2]
        # A frame that is rejected is taken in too: sending it again would change nothing.
        sock.sendall(events.frame(b"not json") + events.encode(start_event(seq=2)))
        wait_for(lambda: consumer.batches == 2, message="second batch")
        consumer.finished = 2
        assert acks_in(sock, 1.0)[-1:] == [4]
        assert consumer.rejects == [events.REJECT_MALFORMED]


def test_a_connection_that_did_not_ask_is_never_acknowledged(server, consumer):
    # An older hook, or one that never reads: nothing may pile up in its socket.
    with connect(server.path) as sock:
        sock.sendall(events.encode(start_event(seq=1)))
        wait_for(lambda: consumer.batches == 1, message="a batch")
        consumer.finished = 1
        assert acks_in(sock, NO_ACK_WITHIN) == []


@pytest.mark.parametrize("claim", ["yes", 1, None])
def test_only_a_literal_true_asks_for_acks(server, consumer, claim):
    with connect(server.path) as sock:
        if claim is None:
            sock.sendall(events.encode({"v": 1, "type": "hello", "node": "n", "pid": os.getpid()}))
        else:
            sock.sendall(hello(ack=claim))
        sock.sendall(events.encode(start_event(seq=1)))
        wait_for(lambda: consumer.batches == 1, message="a batch")
        consumer.finished = 1
        assert acks_in(sock, NO_ACK_WITHIN) == []
    if claim in ("yes", 1):
        assert consumer.rejects == [events.REJECT_INCOMPLETE]   # a wrongly typed hello


def test_a_hello_in_another_processes_name_is_rejected(server, consumer):
    with connect(server.path) as sock:
        sock.sendall(events.encode({"v": 1, "type": "hello", "node": "n", "pid": 1,
                                    "ack": True}))
        sock.sendall(events.encode(start_event(seq=1)))
        wait_for(lambda: consumer.batches == 1, message="a batch")
        consumer.finished = 1
        assert acks_in(sock, NO_ACK_WITHIN) == []
    assert consumer.rejects == [events.REJECT_PID_MISMATCH]


def test_acks_are_rate_limited_per_connection(server, consumer):
    # A hook saving in a tight loop gets one ack per ACK_INTERVAL, not one per read.
    with connect(server.path) as sock:
        sock.sendall(hello())
        started = time.monotonic()
        for seq in range(1, 201):
            sock.sendall(events.encode(start_event(seq=seq)))
            consumer.finished = consumer.batches
            time.sleep(0.002)       # a save every ~2 ms: many reads, that must share few acks
        consumer.finished = 10 ** 9
        got = acks_in(sock, 0.5)
        elapsed = time.monotonic() - started
    assert got == sorted(got) and got[-1] == 201
    assert len(got) <= elapsed / ingest.ACK_INTERVAL + 2


def test_a_hook_that_never_reads_its_acks_cannot_block_the_agent(server, consumer):
    # Acks go out with a non-blocking send, like notices: once the hook's socket is full (here
    # with notices it never reads) an ack that does not fit is counted as deferred -- the
    # next one carries the whole count -- and the agent goes on taking events in.
    big = events.encode({"v": 1, "type": "notice", "kind": "concurrent",
                         "path": "/ckpt/" + "x" * 1000, "site": "t.py:1", "others": []})
    consumer.finished = 10 ** 9
    with connect(server.path) as sock:
        sock.sendall(hello(notices=True) + events.encode(start_event(seq=1000)))
        wait_for(lambda: server.acks["sent"] == 1, message="the hello acknowledged")
        for _ in range(ingest.MAX_NOTICES):
            server.notify(os.getpid(), big, [(1000, "/ckpt/last.pt")])
        wait_for(lambda: server.notices["dropped"] > 0, message="a full socket")
        for seq in range(1, 301):
            sock.sendall(events.encode(start_event(seq=seq)))
            if seq % 50 == 0:          # an ack falls due, does not fit, and events go on in
                deferred = server.acks["deferred"]
                wait_for(lambda: server.acks["deferred"] > deferred,
                         message=f"an ack deferred after {seq} events")
        wait_for(lambda: len(consumer.events) == 301, message="every event handed on")
        wait_for(lambda: server.acks["deferred"] > 0, message="an ack that did not fit")
