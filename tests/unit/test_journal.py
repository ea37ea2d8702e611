"""Journal: JSON lines for writes and collisions, appends across restarts, rotation, errors."""
import json
import os

import pytest

from exporters.journal import (SYSTEM_JOURNAL_PATH, Journal, JournalError, ReadStats,
                               default_journal_path, journal_files, read_records)
from monitor.detect.model import Collision, Write, Writer


def make_write(pid=11, rank=0, start=1000.0, dur=0.5, path="/ckpt/last.pt", seq=1):
    return Write(writer=Writer(node="n1", pid=pid, rank=rank, job="j1", restart=0), path=path,
                 seq=seq, start_wall=start, start_mono=start, end_wall=start + dur,
                 end_mono=start + dur, bytes=4096, outcome="ok", site="train.py:42",
                 func="save_checkpoint")


def make_collision():
    writes = (make_write(11, 0, 1000.0), make_write(12, 1, 1000.25))
    return Collision(path="/ckpt/last.pt", kind="concurrent", writes=writes,
                     detected_wall=1002.0, id="abc123")


def test_writes_collisions_and_dicts_round_trip(tmp_path):
    path = tmp_path / "sub" / "journal.jsonl"          # parent is created
    journal = Journal(str(path), wall_clock=lambda: 5.0)
    w, c = make_write(), make_collision()
    assert journal.write(w) and journal.write(c) and journal.write({"type": "agent", "x": 1})
    journal.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["ts"] == 5.0 for line in lines)
    records = list(read_records(str(path)))
    assert [r["type"] for r in records] == ["write", "collision", "agent"]
    assert Write.from_record(records[0]).writer == w.writer
    assert records[0]["rank"] == 0 and records[0]["site"] == "train.py:42"
    back = Collision.from_record(records[1])
    assert [x.writer.pid for x in back.writes] == [11, 12]
    assert records[1]["first"]["rank"] == 0 and records[1]["last"]["rank"] == 1
    with pytest.raises(TypeError):
        journal.write(object())


def test_appends_across_restarts(tmp_path):
    path = str(tmp_path / "j.jsonl")
    with Journal(path) as journal:
        journal.write(make_write(seq=1))
    with Journal(path) as journal:
        journal.write(make_write(seq=2))
    assert [r["seq"] for r in read_records(path)] == [1, 2]


def test_rotation_keeps_backups_and_reads_oldest_first(tmp_path):
    path = str(tmp_path / "j.jsonl")
    one_line = len(json.dumps({"type": "write", **make_write().to_record(), "ts": 1.0},
                              separators=(",", ":"))) + 1
    journal = Journal(path, max_bytes=one_line * 2 + 10, backups=2, wall_clock=lambda: 1.0)
    for seq in range(10):
        journal.write(make_write(seq=seq))
    journal.close()
    assert journal_files(path) == [path + ".2", path + ".1", path]
    assert not os.path.exists(path + ".3")
    assert all(os.path.getsize(p) <= one_line * 2 + 10 for p in journal_files(path))
    assert [r["seq"] for r in read_records(path)] == [4, 5, 6, 7, 8, 9]
    assert journal.rotations == 4 and journal.errors == 0


def test_backups_zero_truncates(tmp_path):
    path = str(tmp_path / "j.jsonl")
    journal = Journal(path, max_bytes=1500, backups=0)
    for seq in range(20):
        journal.write(make_write(seq=seq))
    journal.close()
    assert journal_files(path) == [path]
    seqs = [r["seq"] for r in read_records(path)]
    assert seqs and seqs[-1] == 19 and len(seqs) < 20
    assert os.path.getsize(path) <= 1500


def test_unusable_path_raises_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(JournalError, match="cannot open journal"):
        Journal(str(blocker / "journal.jsonl"))
    with pytest.raises(JournalError):
        Journal(str(tmp_path))          # a directory
    with pytest.raises(ValueError):
        Journal(str(tmp_path / "j"), max_bytes=0)
    with pytest.raises(ValueError):
        Journal(str(tmp_path / "j"), backups=-1)


def test_write_errors_are_counted_not_raised():
    # /dev/full accepts the open and fails every write with ENOSPC: a full disk.
    journal = Journal("/dev/full")
    assert journal.write(make_write()) is False
    assert journal.write(make_collision()) is False
    journal.flush()
    journal.close()
    assert journal.errors == 2 and journal.records == 0


def test_buffered_write_errors_surface_at_flush():
    journal = Journal("/dev/full", buffered=True)
    journal.write(make_write())
    journal.flush()
    assert journal.errors == 1


def test_reader_skips_malformed_lines_and_repairs_partial_line(tmp_path):
    path = tmp_path / "j.jsonl"
    good = json.dumps({"type": "write", "seq": 1})
    path.write_text(f"{good}\nnot json\n[1, 2]\n{{\"no\": \"type\"}}\n\n{good}\n{{\"type\": \"wr")
    stats = ReadStats()
    assert [r["seq"] for r in read_records(str(path), stats)] == [1, 1]
    assert stats.malformed == 4 and stats.records == 2 and stats.files == 1
    # the agent restarts after a crash mid-line: the next record is still readable
    with Journal(str(path)) as journal:
        journal.write({"type": "write", "seq": 2})
    assert [r["seq"] for r in read_records(str(path))] == [1, 1, 2]


def test_missing_journal_reads_empty(tmp_path):
    stats = ReadStats()
    assert list(read_records(str(tmp_path / "nope.jsonl"), stats)) == []
    assert stats.files == 0


def test_default_journal_path(tmp_path):
    assert default_journal_path({}, euid=0) == SYSTEM_JOURNAL_PATH
    if not os.access("/var/lib/ckptwatch", os.W_OK):
        assert default_journal_path({"XDG_STATE_HOME": "/s"}, euid=1000) == \
            "/s/ckptwatch/journal.jsonl"
        assert default_journal_path({"HOME": "/h"}, euid=1000) == \
            "/h/.local/state/ckptwatch/journal.jsonl"


def test_write_record_keeps_the_journal_format():
    """The "write" line is built from Writer.to_record and Write.to_record: its keys (and
    their order) are the journal format `ckptwatch report` and older journals rely on."""
    from exporters.journal import write_record
    from monitor.detect.model import Write, Writer
    for writer in (Writer(node="n", pid=3), Writer("n2", 4, 1, 1, 8, 4, 0, "j", "h:1", 2)):
        for end in (None, 12.5):
            w = Write(writer=writer, path="/c/x.pt", seq=7, start_wall=100.0, start_mono=10.0,
                      end_wall=None if end is None else 102.5, end_mono=end, bytes=5,
                      outcome="ok", site="t.py:1", func="f")
            rec = write_record(w)
            assert list(rec) == ["type", "node", "pid", "rank", "local_rank", "world_size",
                                 "local_world_size", "node_rank", "job", "master", "restart",
                                 "path", "seq", "start_wall", "end_wall", "duration", "bytes",
                                 "outcome", "site", "func", "source"]
            assert rec["duration"] == (None if end is None else 2.5)
            assert Write.from_record(rec).writer == writer


@pytest.mark.parametrize("over", [
    {}, {"start_wall": float("nan")}, {"end_wall": float("inf")}, {"bytes": 2 ** 70},
    {"path": "/ckpt/\udcff-undecodable.pt"}, {"path": "/ckpt/ünï路径.pt"},
    {"site": "null.py:1"}, {"end_mono": 1000.0000005}, {"start_wall": 1e-05},
    {"end_mono": float("inf")}, {"start_mono": float("nan")}, {"end_wall": None},
    {"outcome": None, "bytes": None}])
def test_write_line_reads_back_as_the_json_encoder_wrote_it(tmp_path, over):
    """Write lines may be encoded by orjson (faster); each must read back to the record the
    stdlib encoder would have written -- NaN stays NaN, not null -- and the same holds
    without orjson."""
    import math
    from dataclasses import replace

    from exporters import journal as journal_module
    from exporters.journal import _ENCODER, write_record
    w = make_write()
    fields = {k: v for k, v in over.items() if k in w.__dataclass_fields__}
    w = replace(w, **fields)
    expected = write_record(w)
    expected["ts"] = 5.0
    expected = json.loads(_ENCODER.encode(expected))
    for orjson in (journal_module.orjson, None):
        saved, journal_module.orjson = journal_module.orjson, orjson
        try:
            path = tmp_path / f"j{orjson is None}.jsonl"
            with Journal(str(path), wall_clock=lambda: 5.0) as journal:
                assert journal.write(w)
            (got,) = list(read_records(str(path)))
        finally:
            journal_module.orjson = saved
        assert list(got) == list(expected)
        for key in expected:
            a, b = got[key], expected[key]
            assert type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a)
                                                      and math.isnan(b))), key


def test_write_lines_are_the_records_encoding_for_every_writer():
    """write_line encodes a writer's fields once and keeps them (exporters.journal
    _writer_prefix): with writers alternating, each line must still be its own record,
    byte for byte as orjson encodes the whole record, and read back as json writes it."""
    pytest.importorskip("orjson")
    import orjson

    from exporters.journal import _ORJSON_OPTIONS, _WRITE_PREFIX, write_line, write_record
    writers = [Writer(node="n1", pid=11, rank=0, job="j1", restart=0),
               Writer(node="n2", pid=12, rank=1, job="j2", master="h:1", restart=3),
               Writer(node="n1", pid=11, rank=0, job="j1", restart=1),
               Writer(node="ünï", pid=13), Writer(node="n1", pid=14, rank=2 ** 70),
               Writer(node="n1\udcff", pid=15)]
    for round_ in range(3):
        for i, writer in enumerate(writers):
            w = Write(writer=writer, path=f"/c/{i}.pt", seq=round_, start_wall=10.0 + i,
                      start_mono=5.0 + i, end_wall=11.0 + i, end_mono=5.5 + i, bytes=i,
                      outcome="ok", site="t.py:1", func="f")
            record = write_record(w)
            record["ts"] = 7.0
            line = write_line(w, 7.0)
            try:
                whole = _WRITE_PREFIX + orjson.dumps(
                    {k: v for k, v in record.items() if k != "type"}, option=_ORJSON_OPTIONS)[1:]
            except TypeError:       # beyond orjson: the json encoder's line
                whole = None
            if whole is not None:
                assert line == whole
            assert json.loads(line) == json.loads(json.dumps(record)), writer
