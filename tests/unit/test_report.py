"""`ckptwatch report`: table and JSON from a real journal written from real detector output."""
import argparse
import io
import json
import os
import time

import pytest

from exporters.journal import Journal
from monitor.detect.detector import Detector
from monitor.detect.model import Collision, Write, Writer
from monitor.cli.advice import GUARD_FIX, LOCAL_RANK_NOTE, OWN_PATH_FIX, suggest_fix
from monitor.cli.journalview import JournalSummary, load, summarize
from monitor.cli.report import add_arguments, render_json, render_table, run, summary_line
from monitor.cli.textfmt import clock_time, human_bytes

WALL0 = 1_764_457_487.0
PATH = "/mnt/shared/ckpt/last.pt"


def event(kind, rank, node, t0, t1=None, path=PATH, site="train.py:42", local_rank=None,
          job="j1"):
    ev = {"v": 1, "type": kind, "node": node, "pid": 100 + rank, "seq": 1, "path": path,
          "rank": rank, "local_rank": local_rank, "job": job, "restart": 0,
          "site": site, "func": "save_checkpoint",
          "wall": WALL0 + (t0 if kind == "start" else t1), "mono": t0 if kind == "start" else t1}
    if kind == "end":
        ev.update(start_wall=WALL0 + t0, start_mono=t0, bytes=16 * 1024 * 1024, outcome="ok")
    return ev


def journal_from_detector(path, ranks_nodes, extra_writes=0, **kw):
    """Run a Detector over ranks writing one path at once; journal what it returns."""
    clock = [0.0]
    det = Detector(clock=lambda: clock[0], wall_clock=lambda: WALL0 + clock[0])
    items = []
    # ranks start in a scrambled order: the report must list them by start time
    for rank, node, t0 in ranks_nodes:
        items += det.observe(event("start", rank, node, t0, **kw))
    for rank, node, t0 in ranks_nodes:
        clock[0] = t0 + 1.0
        items += det.observe(event("end", rank, node, t0, t0 + 1.0, **kw))
    for i in range(extra_writes):
        ev_s = event("start", 50 + i, "n9", 10.0 + i, path=f"/own/{i}.pt")
        ev_e = event("end", 50 + i, "n9", 10.0 + i, 10.5 + i, path=f"/own/{i}.pt")
        items += det.observe(ev_s) + det.observe(ev_e)
    clock[0] = 100.0
    items += det.tick() + det.flush()
    with Journal(str(path)) as journal:
        for item in items:
            journal.write(item)
    return items


def report(args_list):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(args_list)
    out, err = io.StringIO(), io.StringIO()
    code = run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_table_lists_writers_in_start_order_with_the_fix(sockdir):
    # A short directory: the summary line cuts a journal path too long for 80 columns, and
    # tmp_path's length depends on the runner (pytest-xdist adds a popen-gwN level).
    journal = os.path.join(sockdir, "journal.jsonl")
    journal_from_detector(journal, [(2, "n1", 0.3), (0, "n1", 0.1), (3, "n2", 0.4),
                                    (1, "n2", 0.2)], extra_writes=2)
    code, out, err = report(["--journal", str(journal)])
    assert code == 1 and err == ""          # it shows a collision
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), [l for l in lines if len(l) > 80]
    assert lines[0] == PATH
    rows = [line for line in lines if line.lstrip().startswith("rank") and "@" in line
            and ":" in line.split()[-1] and "MiB" in line]
    assert [row.split()[0] for row in rows] == ["rank0@n1", "rank1@n2", "rank2@n1", "rank3@n2"]
    assert clock_time(WALL0 + 0.1) in rows[0] and "1.00s" in rows[0] and "16.0MiB" in rows[0]
    text = " ".join(line.strip() for line in lines)
    assert "concurrent collision, 4 writers, overlapped 1.10s" in text   # 0.2 .. 1.3
    assert "last to finish: rank3@n2 (pid 103); the file on disk may mix" in text
    assert GUARD_FIX in text and LOCAL_RANK_NOTE in text       # ranks on two nodes
    # The closing line, after the last blank line (the path moves to a line of its own when
    # both do not fit).
    assert out.rstrip("\n").split("\n\n")[-1].replace("\n  ", " ") == \
        f"1 collision on 1 path in 6 writes recorded in {journal}"


def same_record(a, b):
    """Equal, floats up to rounding (from_record rebuilds end times from start + duration)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_record(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_record(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, abs=1e-6)
    return a == b


def test_json_parses_and_round_trips(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal_from_detector(journal, [(0, "n1", 0.0), (1, "n1", 0.5)])
    code, out, _ = report(["--journal", str(journal), "--format", "json"])
    assert code == 1
    doc = json.loads(out)
    [rec] = doc["collisions"]
    assert rec["type"] == "collision" and rec["path"] == PATH
    assert [w["rank"] for w in rec["writers"]] == [0, 1]
    again = Collision.from_record(rec).to_record()
    assert json.loads(render_json([Collision.from_record(rec)]))["collisions"][0] == again
    assert same_record(again, rec)
    assert load(str(journal))[0].writers == Collision.from_record(rec).writers


def test_the_closing_line_gives_a_long_journal_path_a_line_of_its_own():
    # The report tests above use a short journal path; this is what a long one looks like.
    summary = JournalSummary(writes=4)
    head = "no collisions in 4 writes recorded in "
    assert summary_line(summary, "/j/journal.jsonl") == head + "/j/journal.jsonl"
    longer = "/var/lib/ckptwatch/" + "d" * 40 + "/journal.jsonl"     # 73 characters
    assert summary_line(summary, longer) == head.rstrip() + "\n  " + longer
    longest = "/" + "d" * 100 + "/journal.jsonl"
    line = summary_line(summary, longest)
    assert line == head.rstrip() + "\n  ..." + longest[-75:]
    assert all(len(part) <= 80 for part in line.splitlines())


def test_no_collisions_prints_a_summary(sockdir):
    journal = os.path.join(sockdir, "journal.jsonl")     # short: see the table test above
    journal_from_detector(journal, [(0, "n1", 0.0)], extra_writes=3)
    code, out, _ = report(["--journal", str(journal)])
    assert code == 0
    assert out.replace("\n  ", " ") == f"no collisions in 4 writes recorded in {journal}\n"
    assert all(len(line) <= 80 for line in out.splitlines())
    code, out, _ = report(["--journal", str(journal), "--format", "json"])
    doc = json.loads(out)
    assert code == 0 and doc["exit_code"] == 0
    assert {k: doc[k] for k in ("collisions", "hazards", "verifications",
                                "size_fluctuations", "torn_reads")} == dict.fromkeys(
        ("collisions", "hazards", "verifications", "size_fluctuations", "torn_reads"), [])
    assert doc["counts"]["writes"] == 4 and doc["counts"]["collisions"] == 0


def test_missing_or_unusable_journal_exits_2(tmp_path):
    code, out, err = report(["--journal", str(tmp_path / "nope.jsonl")])
    assert code == 2 and out == "" and "no journal at" in err
    code, out, err = report(["--journal", str(tmp_path)])
    assert code == 2 and "directory" in err


def test_malformed_lines_are_skipped_and_mentioned(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal_from_detector(journal, [(0, "n1", 0.0), (1, "n1", 0.5)])
    with open(journal, "a") as fh:
        fh.write('garbage\n{"type": "collision", "path": "/x"}\n')
    summary = summarize(str(journal))
    assert len(summary.collisions) == 1 and summary.malformed == 2
    code, out, _ = report(["--journal", str(journal)])
    assert code == 1 and out.rstrip().endswith("(2 unreadable lines skipped)")


def write(pid, rank, node, start, dur=1.0, site="train.py:42", local_rank=None, job="j1",
          restart=0, path=PATH, outcome="ok", master=None):
    return Write(writer=Writer(node=node, pid=pid, rank=rank, local_rank=local_rank, job=job,
                               restart=restart, master=master),
                 path=path, seq=1, start_wall=WALL0 + start, start_mono=start,
                 end_wall=WALL0 + start + dur, end_mono=start + dur, bytes=1000,
                 outcome=outcome, site=site, func="save")


def coll(*writes, kind="concurrent"):
    return Collision(path=writes[0].path, kind=kind, writes=tuple(writes), id="x")


def test_fix_depends_on_who_collided():
    one_node = suggest_fix(coll(write(1, 0, "n1", 0), write(2, 1, "n1", 0.1)))
    assert one_node == f"{GUARD_FIX}; or {OWN_PATH_FIX}"
    # local_rank == 0 guard on shared storage: one writer per node
    local_guard = suggest_fix(coll(write(1, 0, "n1", 0, local_rank=0),
                                   write(2, 8, "n2", 0.1, local_rank=0)))
    assert LOCAL_RANK_NOTE in local_guard and GUARD_FIX in local_guard
    assert "each of these call sites" in suggest_fix(
        coll(write(1, 0, "n1", 0, site="a.py:1"), write(2, 1, "n1", 0.1, site="b.py:2")))
    assert "different jobs" in suggest_fix(
        coll(write(1, 0, "n1", 0, job="a"), write(2, 0, "n1", 0.1, job="b")))
    assert "different jobs" in suggest_fix(
        coll(write(1, 0, "n1", 0, restart=0), write(2, 0, "n1", 0.1, restart=1)))
    assert "each process its own path" in suggest_fix(
        coll(write(1, None, "n1", 0, job=None), write(2, None, "n1", 0.1, job=None)))


def test_long_values_fit_80_columns_keeping_the_tail():
    long_path = "/mnt/" + "very-long-directory-name/" * 6 + "last.pt"
    long_site = "/home/alice/" + "deeply/nested/" * 5 + "train.py:123"
    ws = [write(4_000_000 + r, r, "ip-10-0-12-34.ec2.internal", r * 0.1, site=long_site,
                path=long_path, local_rank=r, outcome="OSError" if r == 2 else "ok")
          for r in range(3)]
    ws.append(write(7, 3, "n\x1b[31mred", 0.35, site=long_site, path=long_path,
                    outcome="lost"))
    table = render_table([coll(*ws), coll(write(1, 0, "n1", 50), write(2, 1, "n1", 52),
                                          kind="redundant")])
    lines = table.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].startswith("...") and lines[0].endswith("/last.pt")
    assert any(line.endswith("train.py:123") for line in lines)
    assert "\x1b" not in table
    assert "the save raised OSError" in table and "never seen" in table
    assert "redundant collision, 2 writers, one after another over 3.00s" in table
    assert table.index(long_path[-20:]) < table.index(PATH)        # oldest first
    for width in (60, 100):
        assert all(len(line) <= width for line in render_table([coll(*ws)], width).splitlines())


def test_small_formatters():
    assert human_bytes(None) == "-" and human_bytes(512) == "512B"
    assert human_bytes(4096) == "4.0KiB" and human_bytes(16 * 1024 ** 2) == "16.0MiB"
    t = time.mktime((2026, 11, 29, 23, 4, 47, 0, 0, -1)) + 0.1234
    assert clock_time(t) == "23:04:47.123"
    assert clock_time(time.mktime((2026, 11, 29, 23, 4, 47, 0, 0, -1)) + 0.9996) == \
        "23:04:48.000"


def test_a_collision_with_an_impossible_time_is_skipped_not_a_crash(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal_from_detector(journal, [(0, "n1", 0.0), (1, "n1", 0.5)])
    rec = load(str(journal))[0].to_record()
    rec["id"] = "other"
    rec["writers"][0]["start_wall"] = float("nan")     # json.loads accepts NaN
    with open(journal, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    code, out, err = report(["--journal", str(journal)])
    assert code == 1 and err == ""
    assert out.rstrip().endswith("(1 unreadable lines skipped)")
    assert "1 collision on 1 path" in out
