"""ckptwatch.emitter: bounded non-blocking queue, reconnect, drops, fork, exit flush.

In-process tests use private Emitter instances and shut them down (no thread may leak);
fork and exit behaviour run in fresh subprocesses.
"""
import json
import os
import subprocess
import sys
import time


from helpers import REPO_ROOT, subprocess_env, wait_for
from ckptwatch import emitter as emitter_mod
from ckptwatch import events
from receiver import Receiver
from wire import start_event

PY = sys.executable


def seqs(rx: Receiver, kind: str = "start") -> list[int]:
    return [e["seq"] for e in rx.of_type(kind)]


def test_events_arrive_in_order_with_our_pid(sock, make_emitter):
    with Receiver(sock) as rx:
        emitter = make_emitter(sock)
        for seq in range(1, 101):
            emitter.emit(start_event(seq))
        rx.wait_count("start", 100)
        assert seqs(rx) == list(range(1, 101))
        assert set(rx.peer_pids) == {os.getpid()}
        assert rx.connections == 1
        assert rx.rejects == []
        wait_for(lambda: emitter.stats()["sent"] == 100, message="sent counter")
        stats = emitter.stats()
        assert stats["dropped"] == 0 and stats["queued"] == 0 and stats["connected"]


def test_agent_absent_events_wait_and_arrive_when_it_starts(sock, make_emitter):
    emitter = make_emitter(sock)
    started = time.monotonic()
    for seq in range(1, 11):
        emitter.emit(start_event(seq))
    # Loose: emit() returns without waiting for any connect attempt or timeout.
    assert time.monotonic() - started < 1.0
    wait_for(lambda: emitter.stats()["errors"] == 0 and not emitter.stats()["connected"])
    assert emitter.flush(5.0) is False          # returns at once: nobody is listening
    assert emitter.stats()["queued"] == 10
    with Receiver(sock) as rx:
        rx.wait_count("start", 10)
        assert seqs(rx) == list(range(1, 11))


def test_agent_restart_mid_run(sock, make_emitter):
    emitter = make_emitter(sock)
    rx = Receiver(sock).start()
    try:
        for seq in range(1, 6):
            emitter.emit(start_event(seq))
        rx.wait_count("start", 5)
    finally:
        rx.stop()                                 # the agent dies, closing our connection
    for seq in range(6, 11):                      # saves while it is down
        emitter.emit(start_event(seq))
    with Receiver(sock) as rx2:                   # the agent comes back on the same path
        rx2.wait_count("start", 5)
        for seq in range(11, 16):
            emitter.emit(start_event(seq))
        rx2.wait_count("start", 10)
        assert seqs(rx2) == list(range(6, 16))
    assert seqs(rx) == [1, 2, 3, 4, 5]


def test_queue_full_drops_and_reports_the_count(sock, make_emitter):
    emitter = make_emitter(sock, max_queue=5)
    for seq in range(1, 21):
        emitter.emit(start_event(seq))
    assert emitter.stats()["dropped"] == 15
    assert emitter.stats()["queued"] == 5
    with Receiver(sock) as rx:
        dropped = rx.wait_count("dropped", 1)
        rx.wait_count("start", 5)
        assert dropped[0]["count"] == 15
        assert dropped[0]["pid"] == os.getpid()
        assert seqs(rx) == [1, 2, 3, 4, 5]        # the oldest were kept, the newest dropped
        # Reported once: more traffic does not repeat the drop report.
        emitter.emit(start_event(21))
        rx.wait_count("start", 6)
        assert len(rx.of_type("dropped")) == 1


def test_oversized_and_unserialisable_events_are_dropped_not_raised(sock, make_emitter):
    with Receiver(sock) as rx:
        emitter = make_emitter(sock)
        huge = start_event(1)
        huge["path"] = "/" + "x" * (events.MAX_FRAME_BYTES + 10)
        weird = start_event(2)
        weird["func"] = object()
        emitter.emit(huge)
        emitter.emit(weird)
        emitter.emit(start_event(3))
        dropped = rx.wait_count("dropped", 1)
        rx.wait_count("start", 1)
        assert dropped[0]["count"] == 2
        assert seqs(rx) == [3]
        assert rx.rejects == []


def test_emit_never_raises_even_on_garbage(sock, make_emitter):
    emitter = make_emitter(sock)
    emitter.emit(None)
    emitter.emit("not a dict")
    emitter.emit({"v": 1})
    # Nothing to assert but survival of the caller and the sender thread:
    with Receiver(sock) as rx:
        emitter.emit(start_event(9))
        rx.wait_count("start", 1)
        # The garbage encodes as JSON, so the agent receives and rejects it; the sender keeps
        # going and the real event behind it arrives.
        assert seqs(rx) == [9]
        assert rx.rejects == [events.REJECT_MALFORMED, events.REJECT_MALFORMED,
                              events.REJECT_INCOMPLETE]


def test_shutdown_is_idempotent_and_later_emits_are_counted(sock, make_emitter):
    with Receiver(sock) as rx:
        emitter = make_emitter(sock)
        emitter.emit(start_event(1))
        assert emitter.shutdown(5.0) is True
        assert emitter.shutdown(5.0) is True
        rx.wait_count("start", 1)
        emitter.emit(start_event(2))
        assert emitter.stats()["dropped"] == 1
        assert not emitter.stats()["connected"]


def _child(code: str, sock: str, **env) -> subprocess.CompletedProcess:
    out = subprocess.run([PY, "-c", code], env=subprocess_env(CKPTWATCH_SOCKET=sock, **env),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


EVENT_CODE = """
import os, time
def ev(seq):
    return {"v": 1, "type": "start", "node": "n", "pid": os.getpid(), "seq": seq,
            "path": "/tmp/x.pt", "wall": time.time(), "mono": time.monotonic()}
"""


def test_exit_flush_delivers_events_of_a_short_lived_process(sock):
    # The child queues events while no agent listens, so its sender sits in connect backoff.
    # The agent appears and the child exits at once: only the exit flush, which retries
    # immediately, can deliver the events before the process is gone. The child's backoff is
    # set to 30 s, so no scheduled retry can deliver them instead (the real backoff, which
    # grows from 0.05 s to 1 s, took a 1.6 s sleep to get a retry a second away), and it says
    # "ready" as soon as its first connect has failed.
    child = subprocess.Popen(
        [PY, "-c", EVENT_CODE + """
import sys
from ckptwatch import emitter
emitter.BACKOFF_MIN = emitter.BACKOFF_MAX = 30.0
for seq in range(1, 51):
    emitter.get_emitter().emit(ev(seq))
while not emitter.get_emitter()._unreachable:
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.readline()
"""], env=subprocess_env(CKPTWATCH_SOCKET=sock), cwd=REPO_ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with Receiver(sock) as rx:
            child.stdin.write("exit\n")
            child.stdin.flush()
            assert child.wait(30) == 0
            rx.wait_count("start", 50)
            assert seqs(rx) == list(range(1, 51))
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
        child.stderr.close()


def test_exit_without_agent_does_not_wait_for_the_flush_timeout(sock):
    started = time.monotonic()
    out = _child(EVENT_CODE + """
from ckptwatch.emitter import get_emitter
get_emitter().emit(ev(1))
print(get_emitter().stats()["queued"])
""", sock, CKPTWATCH_FLUSH_TIMEOUT="30")
    # Loose bound far below the 30 s flush timeout: an absent agent is not waited for.
    assert time.monotonic() - started < 15
    assert out.stdout.strip() in ("0", "1")


def test_fork_child_gets_fresh_connection_and_its_own_pid(sock):
    with Receiver(sock) as rx:
        out = _child(EVENT_CODE + """
import sys
from ckptwatch.emitter import get_emitter
em = get_emitter()
em.emit(ev(1))
assert em.flush(5)
pid = os.fork()
if pid == 0:
    em.emit(ev(2))            # same object, re-initialised in the child
    ok = em.flush(5)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
em.emit(ev(3))
print(pid, os.waitstatus_to_exitcode(status))
""", sock)
        child_pid, child_status = map(int, out.stdout.split())
        assert child_status == 0
        rx.wait_count("start", 3)
        by_seq = {e["seq"]: e for e in rx.of_type("start")}
        parent_pid = by_seq[1]["pid"]
        assert by_seq[2]["pid"] == child_pid != parent_pid
        assert by_seq[3]["pid"] == parent_pid
        # The child's events came on the child's own connection (peer pid checked).
        peer_of = {e["seq"]: p for e, p in zip(rx.events, rx.peer_pids)}
        assert peer_of == {1: parent_pid, 2: child_pid, 3: parent_pid}
        assert rx.connections == 2
        assert rx.rejects == []


def test_get_emitter_uses_ckptwatch_socket(sock):
    out = _child("""
from ckptwatch.emitter import get_emitter
print(get_emitter().socket_path, get_emitter() is get_emitter())
""", sock)
    assert out.stdout.split() == [sock, "True"]


def test_flush_timeout_env_override(sock):
    out = _child("""
from ckptwatch.emitter import _flush_timeout_from_env
print(_flush_timeout_from_env(0.5))
""", sock, CKPTWATCH_FLUSH_TIMEOUT="2.5")
    assert out.stdout.strip() == "2.5"
    out = _child("""
from ckptwatch.emitter import _flush_timeout_from_env
print(_flush_timeout_from_env(0.5))
""", sock, CKPTWATCH_FLUSH_TIMEOUT="soon")
    assert out.stdout.strip() == "0.5"


def test_stats_fields(sock, make_emitter):
    emitter = make_emitter(sock)
    assert set(emitter.stats()) == {"sent", "dropped", "queued", "connected", "errors",
                                    "unacked", "resent", "unconfirmed", "direct", "fallback"}
    assert set(emitter.stats()["fallback"]) == set(emitter_mod.FALLBACK_REASONS)
    assert json.dumps(emitter.stats())


def test_deferred_events_are_built_by_the_sender(sock, make_emitter):
    # The hook passes (builder, *args) so that dict building happens off the save path.
    def broken(seq):
        raise RuntimeError("builder bug")

    with Receiver(sock) as rx:
        emitter = make_emitter(sock)
        emitter.emit((start_event, 1))
        emitter.emit((broken, 2))                 # a failing builder is a counted drop
        emitter.emit((start_event, 3))
        rx.wait_count("start", 2)
        dropped = rx.wait_count("dropped", 1)
        assert seqs(rx) == [1, 3]
        assert dropped[0]["count"] == 1
        assert emitter.stats()["dropped"] == 1


def test_agent_that_stops_reading_never_blocks_the_caller(sock, make_emitter):
    import socket as socketlib
    server = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    server.bind(sock)
    server.listen(1)              # accepted by the kernel, never read: the buffer fills up
    try:
        emitter = make_emitter(sock, max_queue=1000)
        for seq in range(1, 20001):
            event = start_event(seq)
            event["path"] = "/tmp/" + "p" * 400
            emitter.emit(event)
        wait_for(lambda: emitter.stats()["dropped"] > 0, message="drops under back-pressure")
        assert emitter.flush(0.2) is False
        stats = emitter.stats()
        assert stats["queued"] <= 1000
        assert stats["sent"] + stats["dropped"] + stats["queued"] <= 20000
    finally:
        # The listener first: closing it resets the unaccepted connection, so the sender,
        # blocked in sendall on a full buffer, fails at once instead of after SEND_TIMEOUT
        # (2 s), and shutdown() need not wait for it.
        server.close()
        emitter.shutdown(0.1)
