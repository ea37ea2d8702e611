"""`ckptwatch report --format html`: the timeline page, from real journals.

Read back with the stdlib parser (escaping, bar geometry, overlap shading, bounds); the bars in
headless Chromium's pixels are tests/e2e/test_timeline.py.
"""
import json

import pytest

from monitor.cli import timeline
from monitor.cli.report import summarize
from monitor.cli.timeline import AXIS_H, ROW_H, render_html
import incident
from incident import LAST_WRITES, WALL0, write, write_incident_journal
from timelinepage import Page, expected_x, report_html


@pytest.fixture
def incident_page(tmp_path):
    journal = tmp_path / "journal.jsonl"
    write_incident_journal(journal)
    code, out, err = report_html(journal)
    assert code == 1 and err == ""      # it shows collisions: exit 1, as the table and JSON
    return out


def last_pt_chart(page):
    """The <svg> of last.pt and the bars inside it (the first chart: it is the worst path)."""
    svgs = [i for i, e in enumerate(page.elements) if e["tag"] == "svg"]
    start, end = svgs[0], (svgs[1] if len(svgs) > 1 else len(page.elements))
    inside = page.elements[start:end]
    return page.elements[start], [e for e in inside if e["tag"] == "rect"]


def test_bars_sit_where_the_journal_times_say(incident_page):
    page = Page(incident_page)
    svg, rects = last_pt_chart(page)
    bars = [r for r in rects if "bar" in r["attrs"]["class"].split()]
    assert len(bars) == 4
    starts = [WALL0 + s for _, s, _ in LAST_WRITES]
    ends = [WALL0 + s + d for _, s, d in LAST_WRITES]
    by_row = {int(b["attrs"]["data-row"]): b for b in bars}
    # rows are rank 0..3 (node gpu-a17 first), one per process
    for rank, start, duration in LAST_WRITES:
        bar = by_row[rank]["attrs"]
        assert float(bar["x"]) == pytest.approx(expected_x(WALL0 + start, starts, ends), abs=0.01)
        width = expected_x(WALL0 + start + duration, starts, ends) - \
            expected_x(WALL0 + start, starts, ends)
        assert float(bar["width"]) == pytest.approx(width, abs=0.02)
        assert float(bar["y"]) == pytest.approx(AXIS_H + ROW_H * rank + (ROW_H - 12) / 2)
        assert bar["class"] == "bar concurrent"
    labels = [e["text"] for e in page.find("text", "row-label")][:4]
    assert labels == ["rank 0 · gpu-a17 · pid 40211", "rank 1 · gpu-a17 · pid 40212",
                      "rank 2 · gpu-b03 · pid 51877", "rank 3 · gpu-b03 · pid 51878"]


def test_overlap_is_shaded_across_rows_from_second_start_to_second_to_last_end(incident_page):
    page = Page(incident_page)
    _, rects = last_pt_chart(page)
    [band] = [r["attrs"] for r in rects if r["attrs"]["class"] == "overlap"]
    starts = sorted(WALL0 + s for _, s, _ in LAST_WRITES)
    ends = sorted(WALL0 + s + d for _, s, d in LAST_WRITES)
    # two or more in flight: from the second start (0.12) to the third end (rank 0, 2.41)
    assert float(band["data-start"]) == pytest.approx(starts[1])
    assert float(band["data-end"]) == pytest.approx(ends[2])
    assert float(band["x"]) == pytest.approx(expected_x(starts[1], starts, ends), abs=0.01)
    assert float(band["height"]) == 4 * ROW_H and float(band["y"]) == AXIS_H
    # the redundant collision's writes never overlapped: no band in its chart
    svgs = page.find("svg")
    assert len(svgs) == 3 and incident_page.count('class="overlap"') == 1
    assert incident_page.count('class="bar redundant"') == 2
    assert incident_page.count('class="bar write"') == 1


def test_hover_text_collision_findings_verdicts_and_unknown_records(incident_page):
    page = Page(incident_page)
    titles = [e["text"] for e in page.find("title")]
    hover = next(t for t in titles if t.startswith("rank 2 on gpu-b03, pid 51877"))
    assert "3.1GiB, outcome ok" in hover and "/workspace/train.py:212 (save_checkpoint)" in hover
    assert "concurrent collision c7e1a0f4b2d95e38" in hover
    text = " ".join(" ".join(page.text).split())
    assert "guard this call site with a global-rank-0 check" in text
    assert "LOCAL_RANK == 0 is one writer per node" in text
    assert "finished sizes differ: 3,370,000,000 bytes then 3,369,995,904 bytes" in text
    assert "record last/data.pkl: the CRC written after its data differs" in text
    assert "CORRUPT: torn" in text
    # the hazard record (job scope) has a table of its own
    [hazards] = [t for t in page.find("table", "hazards")]
    assert "shared_storage_multi_writer" in text and "0, 1, 2, 3" in text
    assert "mount:nfs4" in text and "rank 0 on gpu-a17 (pid 40211)" in text
    assert "2 collisions on 2 paths" in text and "llama-7b-0412" in text
    assert "7 on 3 paths, by 4 processes" in text


def test_self_contained_no_fetch_no_script(incident_page):
    page = Page(incident_page)
    assert not page.find("script") and not page.find("link") and not page.find("img")
    assert "http://" not in incident_page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in incident_page and "@import" not in incident_page
    assert "url(" not in incident_page
    [csp] = [m for m in page.find("meta")
             if m["attrs"].get("http-equiv") == "Content-Security-Policy"]
    assert "default-src 'none'" in csp["attrs"]["content"]


HOSTILE = "<script>alert(1)</script>"


def test_every_journal_string_is_escaped(tmp_path):
    journal = tmp_path / "journal.jsonl"
    path = f"/ckpt/{HOSTILE}\"onmouseover=alert(2) x='.pt"
    node = f"n<img src=x onerror=alert(3)>"
    ws = [write(0, path, 0.0, 1.0, site=f"train.py:1 {HOSTILE}"),
          write(1, path, 0.5, 1.0, site="x.py:2\x1b[31m")]
    ws[1] = ws[1].__class__(**{**ws[1].__dict__,
                               "writer": ws[1].writer.__class__(
                                   **{**ws[1].writer.__dict__, "node": node, "job": HOSTILE})})
    items = ws + [incident.Collision(path=path, kind="concurrent", writes=tuple(ws),
                                     id=HOSTILE),
                  {"type": "verification", "path": path, "result": "corrupt",
                   "cause": HOSTILE, "reason": HOSTILE, "collision_id": HOSTILE,
                   "wall": WALL0 + 3},
                  {"type": "size_fluctuation", "path": path, "rule": HOSTILE,
                   "writers": [{"rank": HOSTILE, "pid": HOSTILE}], "wall": WALL0 + 2},
                  {"type": f"hazard{HOSTILE}", "path": path, HOSTILE: HOSTILE,
                   "wall": HOSTILE}]
    write_incident_journal(journal, items)
    code, out, _ = report_html(journal)
    assert code == 1
    assert "<script" not in out.lower() and "<img" not in out.lower()
    assert "onmouseover=alert(2)" not in out.replace("&quot;onmouseover=alert(2)", "")
    page = Page(out)
    assert not page.find("script") and not page.find("img")
    for el in page.elements:     # no attribute the journal could have opened
        assert not any(name.startswith("on") for name in el["attrs"])
    text = "".join(page.text)
    assert HOSTILE in text                       # shown, as text
    assert "\x1b" not in out and "\\x1b[31m" in text
    assert node in text


def test_hostile_values_do_not_break_the_page(tmp_path):
    journal = tmp_path / "journal.jsonl"
    good = write(0, "/ok.pt", 0.0, 1.0)
    records = [{"type": "write", **good.to_record()}]
    for bad in ({"start_wall": "soon"}, {"start_wall": float("nan")}, {"duration": -5},
                {"start_wall": 1e300}, {"pid": "1"}, {"path": ["/x"]}, {"end_wall": 0},
                {"rank": 1.5}, {"start_wall": 1e300, "end_wall": None, "duration": None}):
        records.append({"type": "write", **{**good.to_record(), **bad}})
    bad_collision = incident.Collision(path="/ok.pt", kind="concurrent",
                                       writes=(good, good)).to_record()
    bad_collision["writers"][0]["start_wall"] = float("inf")
    records.append(bad_collision)
    records.append({"type": "hazard", "path": 7})
    with open(journal, "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    summary = summarize(str(journal))
    assert len(summary.kept_writes) == 1 and summary.collisions == []
    assert summary.malformed == 11
    page = render_html(summary)
    assert "11 unreadable lines skipped" in page


def test_output_is_bounded_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "MAX_PATHS", 3)
    monkeypatch.setattr(timeline, "MAX_EPISODES", 2)
    monkeypatch.setattr(timeline, "MAX_ROWS", 5)
    monkeypatch.setattr(timeline, "MAX_TABLE_ROWS", 4)
    items = []
    for p in range(6):                         # 6 paths, each saved 5 times a minute apart
        for e in range(5):
            items.append(write(0, f"/ckpt/p{p}.pt", e * 60.0, 1.0, seq=e))
    wide = [write(0, "/ckpt/wide.pt", 0.0, 1.0)]
    for r in range(1, 8):                      # 8 processes at once on one path
        w = write(r % 4, "/ckpt/wide.pt", 0.01 * r, 1.0)
        wide.append(w.__class__(**{**w.__dict__, "writer": w.writer.__class__(
            **{**w.writer.__dict__, "pid": 1000 + r})}))
    items += wide + [incident.Collision(path="/ckpt/wide.pt", kind="concurrent",
                                        writes=tuple(wide), id=f"w{i}") for i in range(6)]
    journal = tmp_path / "journal.jsonl"
    write_incident_journal(journal, items)
    code, out, _ = report_html(journal)
    page = Page(out)
    assert len(page.find("section", "path")) == 3
    text = " ".join(" ".join(page.text).split())
    assert "4 more paths (20 writes, no newer collisions) not shown" in text
    assert "3 more episodes of this path (3 writes) not shown" in text
    assert "3 more processes not shown" in text
    assert "2 more not shown" in text           # 6 collisions, 4 rows
    assert len(page.find("table", "collisions")) == 1
    assert sum(1 for r in page.find("tr")) <= 1 + 4


def test_writes_to_file_and_reads_several_journals(tmp_path):
    journal = tmp_path / "journal.jsonl"
    write_incident_journal(journal)
    out_file = tmp_path / "timeline.html"
    code, out, err = report_html(journal, "-o", str(out_file))
    assert code == 1 and out == "" and f"wrote {out_file}" in err
    assert out_file.read_text().startswith("<!DOCTYPE html>")
    second = tmp_path / "other.jsonl"
    write_incident_journal(second, [write(1, "/elsewhere.pt", 100.0, 1.0)])
    summary = summarize(str(second), summarize(str(journal)))
    assert summary.writes == 8 and len(summary.collisions) == 2
    # the same journal twice: its writes and collisions counted once on the page
    again = summarize(str(journal), summarize(str(journal)))
    assert len(again.kept_writes) == 7 and len(again.collisions) == 2
    code, _, err = report_html(journal, "-o", str(tmp_path / "no" / "such" / "dir.html"))
    assert code == 2 and "cannot write" in err


# ------------------------------------------------------------------------- browser
