"""`ckptwatch report` shows every finding a journal holds (collisions, hazards, verification
verdicts, size fluctuations, torn reads) in table, JSON and HTML alike, exits 1 when it shows a
collision, a hazard or an unusable checkpoint, and reads odd or hostile journals without a
traceback, a hang or raw control characters (issue 16 item 5, issue 17 item 6)."""
import argparse
import io
import json
import os
import subprocess
import sys

import pytest

import exporters.journal
from exporters.journal import Journal, JournalExporter, ReadStats, read_records
from monitor.cli.report import add_arguments, run, summarize
from monitor.detect.model import Collision, Finding, Write, Writer

WALL0 = 1_764_457_487.0
LAST = "/mnt/shared/ckpt/last.pt"
STEP = "/mnt/shared/ckpt/step-100.pt"
SETDIR = "/mnt/shared/ckpt/dcp-200"
# The line bound (4 MiB); read from the module so this file also runs on older trees.
MAX_LINE_BYTES = getattr(exporters.journal, "MAX_LINE_BYTES", 4 << 20)
ESC = "\x1b[2J\x1b]0;owned\x07"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def report(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = run(parser.parse_args(list(argv)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def write(rank, path, start, dur=1.0, pid=None):
    return Write(writer=Writer(node="n1", pid=pid or 100 + rank, rank=rank, job="j1",
                               restart=0),
                 path=path, seq=1, start_wall=WALL0 + start, start_mono=start,
                 end_wall=WALL0 + start + dur, end_mono=start + dur, bytes=1 << 20,
                 outcome="ok", site="train.py:42", func="save")


def verdict(path, result, wall, cause=None, reason="", fmt="torch-zip", collision_id=""):
    return Finding(kind="verification", path=path, job="j1", wall=WALL0 + wall,
                   details={"result": result, "format": fmt, "reason": reason,
                            "cause": cause, "deep": False, "bytes": 1 << 20, "seconds": 0.01,
                            "collision_id": collision_id, "pickle": None,
                            "refused_globals": []})


def journal_of(path, *, collision=False, hazard=False, corrupt=False, superseded=False,
               incomplete=False, fluctuation=False, torn=False, unverifiable=False):
    """A journal written through the agent's JournalExporter (its verdict policy included)."""
    exporter = JournalExporter(Journal(str(path)))
    exporter.publish_write(write(0, STEP, 0.0))
    if collision:
        ws = (write(0, LAST, 1.0), write(1, LAST, 1.5))
        for w in ws:
            exporter.publish_write(w)
        exporter.publish_collision(Collision(path=LAST, kind="concurrent", writes=ws,
                                             detected_wall=WALL0 + 3, id="c0ffee"))
    if hazard:
        exporter.publish_finding(Finding(
            kind="hazard", path=LAST, job="j1", wall=WALL0 + 4, node="n1", source="hook",
            writers=({"node": "n1", "pid": 100, "rank": 0, "site": "train.py:42"},),
            details={"hazard": "shared_storage_multi_writer", "shared": "mount:nfs4",
                     "ranks": [0, 1], "nodes": ["n1", "n2"], "reported_by": 100}))
    if corrupt or superseded:
        exporter.publish_finding(verdict(STEP, "corrupt", 5, cause="torn",
                                         reason="record data/3: CRC differs"))
    if superseded:
        exporter.publish_finding(verdict(STEP, "ok", 60))
    if unverifiable:
        exporter.publish_finding(verdict("/mnt/shared/ckpt/odd.bin", "unverifiable", 6,
                                         reason="not a format the agent knows"))
    if incomplete:
        exporter.publish_finding(verdict(SETDIR, "incomplete", 7, cause="missing_metadata",
                                         fmt="dcp", reason=".metadata never came"))
    if fluctuation:
        exporter.publish_finding(Finding(
            kind="size_fluctuation", path=LAST, job="j1", wall=WALL0 + 8, node="n1",
            source="fs", writers=({"pid": 100, "rank": 0}, {"pid": 101, "rank": 1}),
            details={"rule": "finished sizes differ", "size_before": 4096,
                     "size_after": 1024}))
    if torn:
        exporter.publish_finding(Finding(
            kind="torn_read", path=LAST, job="j1", wall=WALL0 + 9, node="n1", source="fs",
            writers=({"pid": 100, "rank": 0},), details={"reader": {"pid": 4242}}))
    exporter.close()
    return str(path)


def test_every_finding_is_in_table_json_and_html(tmp_path):
    journal = journal_of(tmp_path / "j.jsonl", collision=True, hazard=True, superseded=True,
                         incomplete=True, fluctuation=True, torn=True, unverifiable=True)
    code, table, err = report("--journal", journal)
    assert code == 1 and err == ""
    flat = " ".join(table.split())
    assert "concurrent collision, 2 writers" in flat
    assert "hazard shared_storage_multi_writer" in flat
    assert "incomplete (missing_metadata), dcp" in flat and ".metadata never came" in flat
    assert "unverifiable" in flat and "not a format the agent knows" in flat
    # The ok verdict of the later save is shown, and what it superseded.
    assert "verdict: ok, torch-zip" in flat
    assert "supersedes: corrupt (torn)" in flat
    assert "size fluctuation" in flat and "4.0KiB then 1.0KiB" in flat
    assert "torn read" in flat and "read by pid 4242" in flat
    assert all(len(line) <= 80 for line in table.splitlines())

    code, text, _ = report("--journal", journal, "--format", "json")
    doc = json.loads(text)
    assert code == 1 and doc["exit_code"] == 1
    assert [c["id"] for c in doc["collisions"]] == ["c0ffee"]
    assert [h["hazard"] for h in doc["hazards"]] == ["shared_storage_multi_writer"]
    by_path = {v["path"]: v for v in doc["verifications"]}
    assert by_path[STEP]["result"] == "ok"
    assert by_path[STEP]["supersedes"]["result"] == "corrupt"
    assert by_path[STEP]["supersedes"]["cause"] == "torn"
    assert by_path[SETDIR]["result"] == "incomplete"
    assert by_path[SETDIR]["cause"] == "missing_metadata"
    assert [f["size_after"] for f in doc["size_fluctuations"]] == [1024]
    assert [f["reader"]["pid"] for f in doc["torn_reads"]] == [4242]
    assert doc["counts"]["collisions"] == 1 and doc["counts"]["hazards"] == 1
    assert doc["counts"]["unusable_checkpoints"] == 1      # the incomplete set

    code, page, _ = report("--journal", journal, "--format", "html")
    assert code == 1
    text = " ".join(page.split())
    for needle in ("shared_storage_multi_writer", "missing_metadata", ".metadata never came",
                   "supersedes corrupt (torn)", "4242", "finished sizes differ"):
        assert needle in text, needle


@pytest.mark.parametrize("found, code", [
    ({}, 0),
    ({"collision": True}, 1),
    ({"hazard": True}, 1),
    ({"corrupt": True}, 1),
    ({"incomplete": True}, 1),
    # A corrupt file saved again and verified whole: nothing unusable is left.
    ({"superseded": True}, 0),
    # Findings that are not a collision, a hazard or an unusable checkpoint.
    ({"fluctuation": True, "torn": True, "unverifiable": True}, 0),
])
@pytest.mark.parametrize("fmt", ["table", "json", "html"])
def test_exit_code_follows_what_the_report_shows(tmp_path, found, code, fmt):
    journal = journal_of(tmp_path / "j.jsonl", **found)
    got, out, err = report("--journal", journal, "--format", fmt)
    assert (got, err) == (code, "")
    assert out


def run_report(*argv, timeout=120):
    """`ckptwatch report` as a user runs it: its own process, so a hang is a failure."""
    return subprocess.run([sys.executable, "-m", "monitor.cli", "report", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_what_is_not_a_journal_file_is_refused_in_one_line(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    folder = tmp_path / "nodes"
    folder.mkdir()
    journal_of(folder / "a.jsonl", collision=True)
    os.mkfifo(folder / "b.jsonl")
    for name in (fifo, zero, folder):
        proc = run_report("--journal", str(name))
        assert proc.returncode == 2, (name, proc.stderr)
        assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "is not a regular file" in proc.stderr or "not a journal file" in proc.stderr


def hostile_journal(path, group):
    """A good journal (one collision) plus records of one hostile group: "nested" (lines
    nested beyond the parser's recursion limit), "types" (fields of every wrong type),
    "escape" (terminal control sequences where text or numbers belong). Returns the journal
    and how many of the added lines are unreadable."""
    good = journal_of(path, collision=True)
    coll = next(r for r in read_records(good) if r["type"] == "collision")
    lines, odd, unreadable = [], [], 0
    if group == "nested":
        lines = ["[" * 3000 + "]" * 3000,
                 '{"type": "hazard", "path": ' + "[" * 3000 + "]" * 3000 + "}",
                 '{"type": "verification", "x": ' + '{"a":' * 900 + "1" + "}" * 900 + "}"]
        unreadable = 3
    elif group == "types":
        odd = [
            {"type": "hazard", "path": "/h1", "ranks": "0,1", "writers": "rank0",
             "hazard": ["k"], "shared": {"x": 1}, "job": ["j"], "wall": "soon"},
            {"type": "hazard", "path": {"a": 1}},
            {"type": "verification", "path": "/v1", "result": ["corrupt"], "cause": 7,
             "wall": float("nan"), "bytes": "big", "collision_id": {}},
            {"type": "verification", "path": "/v2", "result": "corrupt", "wall": 1e300,
             "supersedes": "x"},
            {"type": "size_fluctuation", "path": "/s1", "size_before": "1", "size_after": [2],
             "writers": {"rank": 1}, "reader": 5},
            {"type": "torn_read", "path": "/t1", "reader": [1], "wall": -1},
            {"type": "collision", **{**coll, "id": ["x"]}},
            {"type": "collision", **{**coll, "id": "k1", "kind": 5}},
            {"type": "collision", **{**coll, "id": "k2", "sources": "hook"}},
            {"type": "collision", **{**coll, "id": "k3", "detected_wall": "now"}},
            {"type": "collision", **{**coll, "id": "k4", "writers": "all"}},
            {"type": "collision", **{**coll, "id": "k5",
                                     "writers": [{**coll["writers"][0], "site": ["a"]}]}},
            {"type": "collision", **{**coll, "id": "k6",
                                     "writers": [{**coll["writers"][0], "job": {"a": 1}}]}},
            {"type": "write", "path": "/w", "pid": 1, "node": "n", "start_wall": "x"},
        ]
        unreadable = 1 + 7 + 1          # the dict path, the collisions, the write
    else:
        odd = [
            {"type": "hazard", "path": "/h1" + ESC, "ranks": ESC, "hazard": ESC,
             "shared": ESC, "job": ESC},
            {"type": "hazard", "path": "/h2", "ranks": [ESC, 1, True, 2 ** 80],
             "nodes": [1, ESC], "writers": [ESC, {"rank": ESC, "pid": ESC, "site": ESC}]},
            {"type": "verification", "path": "/v2" + ESC, "result": "corrupt", "cause": ESC,
             "reason": ESC * 3, "collision_id": ESC, "format": ESC},
            {"type": "size_fluctuation", "path": "/s1" + ESC, "rule": ESC, "job": ESC,
             "writers": [{"rank": ESC, "pid": ESC}]},
            {"type": "torn_read", "path": "/t1", "reader": {"pid": ESC}},
            {"type": ESC, "path": ESC, ESC: ESC},
        ]
    with open(path, "a") as fh:
        for line in lines:
            fh.write(line + "\n")
        for rec in odd:
            fh.write(json.dumps(rec) + "\n")
    return good, unreadable


@pytest.mark.parametrize("group", ["nested", "types", "escape"])
@pytest.mark.parametrize("fmt", ["table", "json", "html"])
def test_odd_and_hostile_records_make_no_traceback_nor_raw_escape(tmp_path, fmt, group):
    journal, unreadable = hostile_journal(tmp_path / "j.jsonl", group)
    code, out, err = report("--journal", journal, "--format", fmt)
    assert code == 1 and err == ""         # the good collision still shows
    assert "\x1b" not in out and "\x07" not in out
    if fmt == "json":
        doc = json.loads(out)
        assert [c["id"] for c in doc["collisions"]] == ["c0ffee"]
        assert all(isinstance(r, int) and not isinstance(r, bool)
                   for h in doc["hazards"] for r in h.get("ranks", []))
        if group == "escape":
            hazards = {h["path"]: h for h in doc["hazards"]}
            assert hazards["/h2"]["ranks"] == [1] and hazards["/h2"]["nodes"] == [ESC]
    assert summarize(journal).malformed == unreadable


def test_a_line_longer_than_the_bound_is_skipped_whole(tmp_path):
    path = tmp_path / "j.jsonl"
    journal_of(path, hazard=True)
    with open(path, "ab") as fh:
        fh.write(b'{"type": "hazard", "path": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n')
        fh.write(b"\0" * (3 * MAX_LINE_BYTES))                  # no newline at all
        fh.write(b"\n")
    journal_of(tmp_path / "more.jsonl", collision=True)
    with open(path, "ab") as fh, open(tmp_path / "more.jsonl", "rb") as more:
        fh.write(more.read())
    stats = ReadStats()
    types = [r["type"] for r in read_records(str(path), stats)]
    assert types.count("hazard") == 1 and types.count("collision") == 1
    assert stats.too_long == 2 and stats.malformed == 2


def test_lists_are_bounded_newest_kept_counts_exact(tmp_path, monkeypatch):
    journalview = sys.modules[summarize.__module__]
    monkeypatch.setattr(journalview, "MAX_RECORDS_KEPT", 5)
    monkeypatch.setattr(journalview, "MAX_VERDICT_PATHS", 4)
    monkeypatch.setattr(journalview, "MAX_WRITES_KEPT", 3)
    path = tmp_path / "j.jsonl"
    with Journal(str(path)) as journal:
        for i in range(40):
            journal.write({"type": "hazard", "path": f"/p{i}", "job": "j", "hazard": "k",
                           "wall": WALL0 + i})
            journal.write({"type": "verification", "path": f"/v{i}", "result": "corrupt",
                           "cause": "torn", "wall": WALL0 + i})
            journal.write(write(0, f"/w{i}", float(i), pid=1000 + i))
            ws = (write(0, f"/c{i}", float(i)), write(1, f"/c{i}", i + 0.5))
            journal.write(Collision(path=f"/c{i}", kind="concurrent", writes=ws,
                                    id=f"id{i}"))
    summary = summarize(str(path))
    assert summary.counts["hazards"] == 40 and summary.counts["collisions"] == 40
    assert [h["path"] for h in summary.hazards] == [f"/p{i}" for i in range(35, 40)]
    assert [c.path for c in summary.collisions] == [f"/c{i}" for i in range(35, 40)]
    assert list(summary.verdicts_by_path) == [f"/v{i}" for i in range(36, 40)]
    assert len(summary.kept_writes) == 3
    assert summary.writes == 40 and summary.total_dropped > 0
    code, out, _ = report("--journal", str(path))
    assert code == 1 and "40 collisions" in out and "40 hazards" in out


def test_kept_records_are_bounded_by_weight_too(tmp_path, monkeypatch):
    """Heavy records (the most a record may keep) are kept up to a weight, not only a count;
    a record heavier than that is unreadable."""
    journalview = sys.modules[summarize.__module__]
    monkeypatch.setattr(journalview, "MAX_KEPT_BYTES", 1 << 20)
    path = tmp_path / "j.jsonl"
    heavy = {f"f{i}": "x" * 4000 for i in range(50)}              # ~200 KB kept
    with open(path, "w") as fh:
        for i in range(30):
            fh.write(json.dumps({"type": "hazard", "path": f"/p{i}", "hazard": "k",
                                 "job": "j", **heavy}) + "\n")
            fh.write(json.dumps({"type": "verification", "path": f"/v{i}",
                                 "result": "corrupt", **heavy}) + "\n")
        too_heavy = {"writers": [{f"f{i}": "y" * 4000 for i in range(60)}] * 10}
        fh.write(json.dumps({"type": "torn_read", "path": "/t", **too_heavy}) + "\n")
    summary = summarize(str(path))
    assert summary.counts["hazards"] == 30 and summary.counts["torn_reads"] == 0
    assert 1 <= len(summary.hazards) <= 6                          # 1 MiB / 200 KB
    assert [h["path"] for h in summary.hazards][-1] == "/p29"      # the newest kept
    assert 1 <= len(summary.verdicts_by_path) <= 6
    assert summary.malformed == 1


@pytest.mark.parametrize("ranks", [4, "0,1,2,3", {"0": 1}, None, 2.5, True])
def test_a_hazard_whose_ranks_is_not_a_list_is_shown_without_them(tmp_path, ranks):
    """tests/support/incident.py's hazard with `ranks` of the wrong type (an int where the
    agent writes a list): the field is unreadable and left out; the hazard is still shown,
    in every format, and no traceback."""
    sys.path.insert(0, os.path.join(REPO, "tests", "support"))
    from incident import incident_items, write_incident_journal
    items = incident_items()
    (hazard,) = [i for i in items if isinstance(i, dict) and i.get("type") == "hazard"]
    hazard["ranks"] = ranks
    journal = str(tmp_path / "j.jsonl")
    write_incident_journal(journal, items)
    outputs = {}
    for fmt in ("table", "json", "html"):
        code, outputs[fmt], err = report("--journal", journal, "--format", fmt)
        assert code == 1 and err == "", err
    table = outputs["table"]
    assert "hazard shared_storage_multi_writer" in table
    assert "ranks writing it" not in table
    (shown,) = json.loads(outputs["json"])["hazards"]
    assert shown["path"] == hazard["path"] and "ranks" not in shown
    assert summarize(journal).malformed == 0      # one unreadable field, not a bad record
