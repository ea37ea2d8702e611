"""ckptwatch.policy (CKPTWATCH_POLICY=warn), the notice wire contract, and the emitter reading
notices from a real (hostile) agent socket."""
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import warnings

import pytest

from ckptwatch import events, policy
from ckptwatch.emitter import Emitter
from helpers import subprocess_env, wait_for
from monitor.ingest.notices import notices_for


@pytest.fixture(autouse=True)
def fresh_sites():
    policy._reset_for_tests()
    yield
    policy._reset_for_tests()
    policy.own_site = None


@pytest.fixture
def train_py(tmp_path):
    """A real call-site file the hook reported a save from (policy.own_site says so)."""
    path = tmp_path / "train.py"
    path.write_text("".join(f"x{n} = {n}\n" for n in range(1, 60)))
    site = f"{path}:42"
    policy.own_site = lambda s: site if s == site else None
    return str(path)


def notice_bytes(**fields) -> bytes:
    body = {"v": 1, "type": "notice", "kind": "concurrent", "path": "/ckpt/last.pt",
            "site": "/train.py:42", "id": "abc",
            "others": [{"rank": 1, "pid": 11, "node": "n1", "site": "/train.py:42"}]}
    body.update(fields)
    return json.dumps(body).encode()


# ---- warning once per call site ---------------------------------------------------------

def test_one_warning_and_one_log_line_per_call_site_naming_path_ranks_and_fix(caplog,
                                                                             train_py):
    detail = events.decode_notice(notice_bytes(site=f"{train_py}:42"))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING,
                                                                          "ckptwatch"):
        warnings.simplefilter("default")
        assert policy.notice_unsafe(f"{train_py}:42", detail) is True
        assert policy.notice_unsafe(f"{train_py}:42", detail) is False
        assert policy.notice_unsafe("/other.py:7", "another rank writes /x.pt") is True
    assert [w.category for w in caught] == [policy.CheckpointCollisionWarning] * 2
    first, second = caught
    # Our own call site: the warning points at it, and Python shows its source line.
    assert (first.filename, first.lineno) == (train_py, 42)
    assert "x42 = 42" in warnings.formatwarning(first.message, first.category,
                                                first.filename, first.lineno)
    # Not a site this process saved from: named in the text only, never opened.
    assert (second.filename, second.lineno) == (policy.NOWHERE, 0)
    text = str(first.message)
    assert f"{train_py}:42" in text and "/ckpt/last.pt" in text and "rank 1" in text
    assert "dist.get_rank() == 0" in text
    assert [r.getMessage() for r in caplog.records if r.name == "ckptwatch"] == \
        [str(w.message) for w in caught]
    assert issubclass(policy.CheckpointCollisionWarning, UserWarning)


def test_an_error_filter_does_not_turn_the_warning_into_an_exception():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.notice_unsafe("/t.py:1", "x") is False
    assert policy.stats()["errors"] >= 1


@pytest.mark.parametrize("detail", [None, 3, {"kind": 5, "others": "x"}, {"others": [None]},
                                    object()])
def test_odd_details_still_warn_naming_the_site_and_the_fix(detail):
    # notice_unsafe never raises whatever happens inside it (an error is only counted), so
    # what can break is the user's warning: an odd detail from the agent must still give it.
    errors = policy.stats()["errors"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy.notice_unsafe("/t.py:9", detail) is True
    assert policy.stats()["errors"] == errors
    (warning,) = [w for w in caught if w.category is policy.CheckpointCollisionWarning]
    text = str(warning.message)
    assert text.startswith("unsafe checkpoint save at /t.py:9") and "dist.get_rank() == 0" in text


# ---- a notice is input: nothing in it is opened, read or printed raw (issue 17 item 1) ------

def _warn_in_thread(site, detail, timeout=5.0):
    """notice_unsafe on a thread of its own, as the emitter's sender thread runs it: (finished
    within `timeout`, the warnings it gave)."""
    caught, done = [], threading.Event()

    def run():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            policy.notice_unsafe(site, detail)
        for w in got:   # what Python's default showwarning does: format, with linecache
            warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
        caught.extend(got)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout), caught


_DEV_ZERO_CHILD = r"""
import json, resource, sys, threading, warnings
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))   # the old code must not eat the host
from ckptwatch import events, policy
notice = events.decode_notice(json.dumps({"v": 1, "type": "notice", "kind": "concurrent",
    "path": "/ckpt/a.pt", "site": "/dev/zero:1", "others": []}).encode())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
caught, done = [], threading.Event()
def run():
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        policy.notice_unsafe("/dev/zero:1", notice)
    for w in got:       # what Python's default showwarning does: format, with linecache
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
    caught.extend(got)
    done.set()
threading.Thread(target=run, daemon=True).start()
finished = done.wait(10)
print(json.dumps({"finished": finished, "errors": policy.stats()["errors"],
                  "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
                  "files": [w.filename for w in caught]}))
"""


def test_a_notice_naming_dev_zero_reads_nothing():
    # Old code: warnings.warn_explicit("/dev/zero", 1) made linecache read /dev/zero until
    # memory ran out (a victim's RSS 223 MiB -> 2.6 GiB in 13 s). Here in a child capped at
    # 1 GiB of address space, so the old code fails the test instead of the host.
    out = subprocess.run([sys.executable, "-c", _DEV_ZERO_CHILD], env=subprocess_env(),
                         capture_output=True, text=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["finished"] and result["errors"] == 0, result
    assert result["grew_kib"] < 32 << 10, result
    assert result["files"] == [policy.NOWHERE], result


@pytest.mark.parametrize("own", [False, True])
def test_a_notice_naming_a_fifo_never_blocks(tmp_path, own):
    # Old code: the sender thread blocked in open() for good, and the process's next saves
    # never reached the agent. Even a site of our own whose file became a FIFO is not opened
    # blocking.
    fifo = str(tmp_path / "train.py")
    os.mkfifo(fifo)
    site = f"{fifo}:3"
    if own:
        policy.own_site = lambda s: site if s == site else None
    try:
        finished, caught = _warn_in_thread(site, events.decode_notice(notice_bytes(site=site)))
        assert finished, "notice_unsafe blocked on a FIFO"
        (warning,) = caught
        assert warning.filename == policy.NOWHERE
    finally:
        # Release an open() that did block (the old code), so no thread stays behind.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_control_characters_from_a_notice_are_escaped_and_texts_are_cut(caplog):
    evil = "\x1b[2J\x1b]0;pwned\x07\n2026-12-04 INFO forged log line\u202e"
    detail = events.decode_notice(notice_bytes(
        kind=evil, path="/ckpt/" + evil + "p" * 900, site=evil,
        others=[{"rank": None, "pid": 7, "node": evil, "site": evil}]))
    assert detail is not None
    with caplog.at_level(logging.WARNING, "ckptwatch"):
        finished, caught = _warn_in_thread(evil, detail)
    assert finished
    (warning,) = caught
    text = str(warning.message)
    logged = [r.getMessage() for r in caplog.records if r.name == "ckptwatch"]
    assert logged == [text]
    for shown in (text, warnings.formatwarning(warning.message, warning.category,
                                               warning.filename, warning.lineno)):
        assert "\x1b" not in shown and "\n" not in shown.rstrip("\n")
        assert "\x07" not in shown and "\u202e" not in shown
    assert "\\x1b[2J" in text and "\\u202e" in text
    # Each text is cut: the 900-character path shows at most MAX_SHOWN of its characters.
    assert "p" * (policy.MAX_SHOWN + 1) not in text
    assert len(text) < 8 * policy.MAX_SHOWN


def test_the_hook_trusts_only_sites_it_reported_saves_from(tmp_path):
    from ckptwatch import hook
    code = compile("x = 1\n", str(tmp_path / "train.py"), "exec")
    assert hook._own_site(f"{tmp_path}/train.py:7") is None
    known = hook._learn_code(code)                  # as a save from line 7 of it does
    hook._learn_site(code, 2, 7, known[1])
    try:
        assert hook._own_site(f"{tmp_path}/train.py:7") == f"{tmp_path}/train.py:7"
        assert hook._own_site(f"{tmp_path}/train.py:8") is None
        assert hook._own_site("/dev/zero:1") is None
    finally:
        hook._codes.pop(id(code), None)


# ---- the notice contract -----------------------------------------------------------------

def test_a_valid_notice_decodes_to_its_fields_only():
    notice = events.decode_notice(notice_bytes(extra="ignored"))
    assert notice == {"kind": "concurrent", "path": "/ckpt/last.pt", "site": "/train.py:42",
                      "id": "abc",
                      "others": [{"rank": 1, "pid": 11, "node": "n1", "site": "/train.py:42"}]}


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xfe", b"[]", b"null", b"[" * 100000, b"{" * 5000,
    notice_bytes(v=2), notice_bytes(v=True), notice_bytes(v=1.0), notice_bytes(type="start"),
    notice_bytes(kind=None), notice_bytes(path=3), notice_bytes(path="p" * 5000),
    notice_bytes(site=["x"]), notice_bytes(others={}), notice_bytes(others=[1]),
    notice_bytes(others=[{"rank": "0"}]), notice_bytes(others=[{"rank": True}]),
    notice_bytes(others=[{}] * 17), b"x" * (events.MAX_NOTICE_BYTES + 1),
])
def test_malformed_notices_are_none_never_an_exception(payload):
    assert events.decode_notice(payload) is None


def test_the_agent_builds_one_notice_per_local_writer_within_bounds():
    writers = [{"node": "n1", "pid": 100 + i, "rank": i, "site": "/t.py:" + "9" * 2000,
                "seq": 1, "source": "hook"}
               for i in range(40)] + [{"node": "other", "pid": 5, "rank": 99, "seq": 1,
                                       "source": "job"}]
    record = {"type": "collision", "kind": "concurrent", "path": "/ckpt/" + "a" * 3000,
              "id": "c", "writers": writers}
    built = notices_for(record, "n1")
    assert [pid for pid, _, _ in built] == [100 + i for i in range(40)]
    assert all(writes == ((1, record["path"]),) for _, writes, _ in built)
    for pid, _, frame in built:
        payload = frame[events.HEADER.size:]
        assert len(payload) <= events.MAX_NOTICE_BYTES
        notice = events.decode_notice(payload)
        assert notice is not None and notice["kind"] == "concurrent"
        assert pid not in [o["pid"] for o in notice["others"]]
    assert notices_for({"type": "write", "path": "/x"}, "n1") == []
    assert notices_for({"type": "collision", "path": "/x", "writers": "no"}, "n1") == []


@pytest.mark.parametrize("victim", [
    {"source": "job", "seq": 3},        # a remote report named a local pid (issue 17 item 1)
    {"source": "fs", "seq": 3},         # the watcher attributed the write: the process said
    {"source": "hook"},                 # nothing itself; no seq: no write of its own named
])
def test_only_writers_whose_hook_reported_the_write_get_a_notice(victim):
    record = {"type": "collision", "kind": "concurrent", "path": "/ckpt/a.pt", "id": "c",
              "writers": [{"node": "n1", "pid": 10, "seq": 1, "source": "hook"},
                          {"node": "n1", "pid": 66, **victim}]}
    assert [(pid, writes) for pid, writes, _ in notices_for(record, "n1")] == \
        [(10, ((1, "/ckpt/a.pt"),))]
    hazard = {"type": "hazard", "path": "/ckpt/a.pt", "source": "hook",
              "writers": [{"node": "n1", "pid": 10, "seq": 4}]}
    assert [(pid, writes) for pid, writes, _ in notices_for(hazard, "n1")] == \
        [(10, ((4, "/ckpt/a.pt"),))]


# ---- the emitter reads notices from a real socket ----------------------------------------

class HostileAgent:
    """Accepts one connection, then sends whatever the test says, on command."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.conn = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.conn, _ = self.listener.accept()

    def send(self, data: bytes) -> None:
        wait_for(lambda: self.conn is not None, message="the hook's connection")
        self.conn.sendall(data)

    def close(self):
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()


def frame(payload: bytes) -> bytes:
    return events.HEADER.pack(len(payload)) + payload


@pytest.fixture
def hostile(sockdir):
    agent = HostileAgent(os.path.join(sockdir, "agent.sock"))
    emitter = Emitter(os.path.join(sockdir, "agent.sock"))
    got = []
    emitter.on_notice = got.append
    yield agent, emitter, got
    emitter.shutdown(0.5)
    agent.close()


def connect(emitter):
    emitter.emit({"v": 1, "type": "dropped", "node": "n", "pid": os.getpid(), "count": 1})
    assert emitter.flush(5)


def test_the_sender_thread_hands_valid_notices_on_and_survives_garbage(hostile):
    agent, emitter, got = hostile
    connect(emitter)
    garbage = [frame(b"{not json"), frame(notice_bytes(v=9)), frame(b"[" * 4000),
               frame(notice_bytes(others=[{"rank": []}]))]
    agent.send(b"".join(garbage) + frame(notice_bytes()))
    wait_for(lambda: got, timeout=5, message="the valid notice")
    assert got == [events.decode_notice(notice_bytes())]
    assert emitter.notices["malformed"] == 4
    # A half frame, then its rest: framing survives split reads.
    data = frame(notice_bytes(path="/ckpt/b.pt"))
    agent.send(data[:7])
    agent.send(data[7:])
    wait_for(lambda: len(got) == 2, timeout=5, message="the split notice")
    connect(emitter)                 # still sending events
    assert emitter.stats()["errors"] == 0


def test_an_oversized_frame_ends_notice_reading_but_not_sending(hostile):
    agent, emitter, got = hostile
    connect(emitter)
    agent.send(events.HEADER.pack(10 ** 9) + b"x" * 100)
    wait_for(lambda: emitter.notices["oversized"] == 1, timeout=5, message="oversized")
    agent.send(frame(notice_bytes()))
    connect(emitter)
    assert got == []


def test_a_failing_handler_is_counted(hostile):
    agent, emitter, got = hostile

    def broken(notice):
        raise RuntimeError("handler bug")

    emitter.on_notice = broken
    connect(emitter)
    agent.send(frame(notice_bytes()))
    wait_for(lambda: emitter.notices["errors"] == 1, timeout=5, message="handler error")
    connect(emitter)


def test_the_warning_class_is_reachable_from_the_package():
    import ckptwatch
    assert ckptwatch.CheckpointCollisionWarning is policy.CheckpointCollisionWarning


def test_notices_are_read_on_a_descriptor_above_1023(sockdir):
    # Training processes hold many files (data loaders, shards); select() cannot watch a
    # descriptor above 1023, poll() can.
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        agent = HostileAgent(os.path.join(sockdir, "agent.sock"))
        emitter = Emitter(os.path.join(sockdir, "agent.sock"))
        got = []
        emitter.on_notice = got.append
        connect(emitter)
        assert emitter._sock.fileno() > 1023
        agent.send(frame(notice_bytes()))
        wait_for(lambda: got, timeout=5, message="the notice")
        emitter.shutdown(0.5)
        agent.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
