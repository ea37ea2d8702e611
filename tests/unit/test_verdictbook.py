"""monitor/agent/verdictbook.py: what the agent tells a load about a file, by query (through the
real ingest server and the guard's own client) and stored with the file (a real xattr)."""
from __future__ import annotations

import json
import os
import types

import pytest

from ckptwatch import events, resumeguard, verdicts
from monitor.agent.verdictbook import VerdictBook
from monitor.ingest.server import IngestServer
from monitor.verify.worker import Verification

ME = types.SimpleNamespace(uid=os.getuid())
OTHER = types.SimpleNamespace(uid=4242)
ROOT = types.SimpleNamespace(uid=0)
WRITERS = [{"rank": 0, "pid": 11, "node": "n1", "site": "train.py:9"},
           {"rank": 1, "pid": 12, "node": "n1", "site": "train.py:9"}]


def ask(book, path, who=ME):
    frame = book.answer({"qid": 7, "path": path}, who)
    (length,) = events.HEADER.unpack(frame[:4])
    assert length == len(frame) - 4 <= verdicts.MAX_BYTES
    body = json.loads(frame[4:])
    assert body["type"] == "verdict" and body["qid"] == 7
    return verdicts.from_dict(body, "verdict")


def file(tmp_path, name="last.pt", data=b"x" * 100):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def verification(path, result="corrupt", cause="torn", collision_id=""):
    return Verification(path, result, "torch-zip", "record data/0: torn" if cause else "",
                        cause, collision_id=collision_id)


def test_a_save_in_progress_then_its_collision_then_the_verdict(tmp_path):
    book = VerdictBook()
    path = file(tmp_path)
    assert ask(book, path).state == verdicts.UNKNOWN
    book.write_started(path, ("n1", 11, 1), ME.uid)
    book.write_started(path, ("n1", 12, 1), ME.uid)
    assert ask(book, path).state == verdicts.WRITING
    book.write_ended(path, ("n1", 11, 1))
    assert ask(book, path).state == verdicts.WRITING      # one still writes
    book.write_ended(path, ("n1", 12, 1))
    book.collided(path, "c0ffee", WRITERS)
    known = ask(book, path)
    assert known.state == verdicts.COLLISION and known.collision == "c0ffee"
    assert known.writers == ("rank 0 pid 11 on n1 at train.py:9",
                             "rank 1 pid 12 on n1 at train.py:9")
    st = os.stat(path)
    assert book.stamp(path, st, verification(path, collision_id="c0ffee"), owned=True)
    known = ask(book, path)
    assert (known.state, known.cause, known.collision) == ("corrupt", "torn", "c0ffee")
    assert known.identity == verdicts.identity_of(st)
    stored = verdicts.decode(os.getxattr(path, verdicts.XATTR))
    assert stored == known           # one verdict, by query and with the file


def test_the_next_write_forgets_the_previous_version(tmp_path):
    book = VerdictBook()
    path = file(tmp_path)
    book.collided(path, "c0ffee", WRITERS)
    book.stamp(path, os.stat(path), verification(path, collision_id="c0ffee"), owned=True)
    book.write_started(path, ("n1", 13, 2), ME.uid)
    book.write_ended(path, ("n1", 13, 2))
    assert ask(book, path).state == verdicts.UNKNOWN


def test_last_verified_ok_checkpoint_of_the_directory(tmp_path):
    book = VerdictBook()
    good, bad = file(tmp_path, "step-100.pt"), file(tmp_path, "step-200.pt")
    book.write_started(bad, ("n1", 1, 1), ME.uid)
    book.write_ended(bad, ("n1", 1, 1))
    book.stamp(good, os.stat(good), verification(good, "ok", ""), owned=True)
    book.stamp(bad, os.stat(bad), verification(bad), owned=True)
    assert ask(book, bad).last_ok == good
    assert verdicts.decode(os.getxattr(bad, verdicts.XATTR)).last_ok == good
    text = verdicts.describe(bad, ask(book, bad))
    assert f"resume from {good}" in text


def test_only_the_writers_user_or_root_is_told(tmp_path):
    book = VerdictBook()
    path = file(tmp_path)
    book.write_started(path, ("n1", 11, 1), ME.uid)
    assert ask(book, path, OTHER).state == verdicts.UNKNOWN
    assert ask(book, path, ROOT).state == verdicts.WRITING
    assert book.counts["answered_unknown"] == 1


def test_not_stored_on_a_file_that_is_not_its_readers(tmp_path):
    book = VerdictBook()
    path = file(tmp_path)
    assert not book.stamp(path, os.stat(path), verification(path), owned=False)
    with pytest.raises(OSError):
        os.getxattr(path, verdicts.XATTR)


def test_not_stored_on_a_file_changed_while_it_was_read(tmp_path):
    book = VerdictBook()
    path = file(tmp_path)
    st = os.stat(path)
    with open(path, "ab") as f:
        f.write(b"more")
    assert not book.stamp(path, st, verification(path), owned=True)
    with pytest.raises(OSError):
        os.getxattr(path, verdicts.XATTR)


def test_not_stored_when_turned_off(tmp_path):
    book = VerdictBook(store=False)
    path = file(tmp_path)
    assert not book.stamp(path, os.stat(path), verification(path), owned=True)
    assert ask(book, path, ROOT).state == verdicts.CORRUPT     # the query still knows


def test_long_texts_still_make_a_bounded_answer(tmp_path):
    book = VerdictBook()
    path = "/ckpt/" + "é" * 2000     # never opened: the book answers from its table
    many = [{"rank": r, "pid": r + 1, "node": "n" * 900, "site": "s" * 900} for r in range(64)]
    book.write_started(path, ("n1", 1, 1), ME.uid)
    book.write_ended(path, ("n1", 1, 1))
    book.collided(path, "x" * 2000, many)
    assert ask(book, path).state == verdicts.COLLISION


def test_the_guard_asks_the_real_ingest_server(tmp_path, sockdir, no_thread_leak):
    book = VerdictBook()
    path = file(tmp_path)
    book.write_started(path, ("n1", 11, 1), os.getuid())
    sock = os.path.join(sockdir, "agent.sock")
    rejected = []
    server = IngestServer(sock, lambda batch: None, rejected.append, on_query=book.answer)
    server.start()
    try:
        answer = resumeguard.ask_agent(path, wait=10.0, socket_path=sock)
        assert answer is not None and answer.state == verdicts.WRITING
        assert book.counts["queries"] == 1 and not rejected
    finally:
        server.stop()


def test_a_directory_is_answered_with_its_worst_file(tmp_path):
    book = VerdictBook()
    directory = tmp_path / "step-9"
    directory.mkdir()
    shard, meta = file(directory, "__0_0.distcp"), file(directory, ".metadata")
    other = file(tmp_path, "elsewhere.pt")
    for path in (shard, meta, other):
        book.write_started(path, ("n1", 1, hash(path)), ME.uid)
        book.write_ended(path, ("n1", 1, hash(path)))
    book.stamp(meta, os.stat(meta), verification(meta, "ok", ""), owned=True)
    book.stamp(other, os.stat(other), verification(other), owned=True)
    assert ask(book, str(directory)).state == verdicts.UNKNOWN    # nothing bad in it
    book.stamp(shard, os.stat(shard), verification(shard), owned=True)
    known = ask(book, str(directory))
    assert known.state == verdicts.CORRUPT and known.reason.startswith("__0_0.distcp: ")
    assert known.identity is None
    assert ask(book, str(directory), OTHER).state == verdicts.UNKNOWN


def test_an_end_names_its_writers_user_whether_or_not_the_start_did(tmp_path):
    """write_ended takes a shortcut when it has nothing to add but the end of the write
    (issue 22); an end whose user the book does not know yet still records that user: a short
    save's lone end, and an end by another user of a path whose start this one made."""
    book = VerdictBook()
    path, lone = file(tmp_path), file(tmp_path, "lone.pt")
    book.write_started(path, ("n1", 11, 1), ME.uid)
    book.write_ended(path, ("n1", 11, 1), ME.uid)         # the shortcut: ME already known
    book.write_ended(path, ("n1", 12, 1), OTHER.uid)      # OTHER is new: recorded
    book.collided(path, "c0ffee", WRITERS)
    assert ask(book, path, OTHER).state == verdicts.COLLISION
    assert ask(book, path, ME).state == verdicts.COLLISION
    book.write_ended(lone, ("n1", 13, 1), OTHER.uid)      # no start: the end makes the entry
    book.collided(lone, "5eed", WRITERS)
    assert ask(book, lone, OTHER).state == verdicts.COLLISION
    third = types.SimpleNamespace(uid=4343)
    assert ask(book, lone, third).state == verdicts.UNKNOWN   # not that user's file
