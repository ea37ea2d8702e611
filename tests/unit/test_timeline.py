"""`ckptwatch report --format html`: the timeline page, from real journals.

Unit tests read the HTML back with the stdlib parser (escaping, bar geometry, overlap shading,
bounds); the e2e test renders it in headless Chromium and finds the bars in the screenshot's
pixels where the journal's times say they are.
"""
import argparse
import io
import json
import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest

from exporters.journal import Journal
from monitor.cli import timeline
from monitor.cli.report import add_arguments, run, summarize
from monitor.cli.timeline import (AXIS_H, AXIS_PAD, COLOR_CONCURRENT, COLOR_OVERLAP,
                                  COLOR_WRITE, LABEL_W, PLOT_W, ROW_H, render_html)
import incident
from incident import LAST, LAST_WRITES, WALL0, write, write_incident_journal


class Page(HTMLParser):
    """Every element's tag and attributes, the text, and each element's text (for <title>)."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.elements, self.text, self._stack = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.elements.append(el)
        if tag not in ("meta", "br", "line", "input", "link"):
            self._stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, "attrs": dict(attrs), "text": ""})

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        self.text.append(data)
        for el in self._stack:
            el["text"] += data

    def find(self, tag, cls=None):
        return [e for e in self.elements if e["tag"] == tag and
                (cls is None or cls in e["attrs"].get("class", "").split())]


def report_html(journal, *extra):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--journal", str(journal), "--format", "html", *extra])
    out, err = io.StringIO(), io.StringIO()
    code = run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def expected_x(t, starts, ends):
    """Where the page must put wall time t: the episode's span padded by AXIS_PAD each side,
    mapped onto PLOT_W pixels after the LABEL_W label column."""
    lo, hi = min(starts), max(ends)
    pad = (hi - lo) * AXIS_PAD
    return LABEL_W + (t - (lo - pad)) / ((hi + pad) - (lo - pad)) * PLOT_W


@pytest.fixture
def incident_page(tmp_path):
    journal = tmp_path / "journal.jsonl"
    write_incident_journal(journal)
    code, out, err = report_html(journal)
    assert code == 0 and err == ""
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
    assert "hazard=shared_path_no_guard" in text and "ranks=4" in text
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
    assert code == 0
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
    assert code == 0 and out == "" and f"wrote {out_file}" in err
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

def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def run_chromium(binary, tmp_path, *args):
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--force-device-scale-factor=1",
           *args]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def read_png(path):
    """(width, height, rows of (r, g, b)) of an 8-bit RGB/RGBA non-interlaced PNG, stdlib only."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif f == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif f == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) \
                    & 0xFF
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(width)])
        prev = line
    return width, height, rows


def rgb(hex_colour):
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def runs(row, wanted, tolerance=12):
    """[start, end) pixel columns where row's colour is within tolerance of wanted."""
    out, start = [], None
    for x, px in enumerate(row + [(-999, -999, -999)]):
        hit = all(abs(a - b) <= tolerance for a, b in zip(px, wanted))
        if hit and start is None:
            start = x
        elif not hit and start is not None:
            out.append((start, x))
            start = None
    return out


MEASURE = """<script>
addEventListener('load', () => {
  const r = document.querySelector('svg.chart').getBoundingClientRect();
  document.body.setAttribute('data-chart', JSON.stringify([r.left, r.top, r.width]));
});
</script>"""


@pytest.mark.e2e
def test_chromium_draws_the_bars_where_the_journal_says(tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    journal = tmp_path / "journal.jsonl"
    write_incident_journal(journal)
    page_file = tmp_path / "timeline.html"
    code, _, _ = report_html(journal, "-o", str(page_file))
    assert code == 0
    shot = tmp_path / "shot.png"
    size = "--window-size=1400,1000"
    run_chromium(binary, tmp_path, f"--screenshot={shot}", size, page_file.as_uri())
    width, height, pixels = read_png(shot)
    assert (width, height) == (1400, 1000)

    # Not blank: a real share of the page is ink, in many colours.
    flat = [px for row in pixels[::4] for px in row[::4]]
    ink = sum(1 for px in flat if min(px) < 235)
    assert ink / len(flat) > 0.05, f"only {ink} of {len(flat)} sampled pixels are not white"
    assert len(set(flat)) > 30

    # Where the chart is on the page: measured by the browser in a copy whose policy lets a
    # measuring script run (the page itself runs no script). Same window, same layout.
    measured = tmp_path / "measure.html"
    text = page_file.read_text()
    measured.write_text(text.replace("default-src 'none'", "default-src 'none'; "
                                     "script-src 'unsafe-inline'")
                        .replace("</body>", MEASURE + "</body>"))
    dom = run_chromium(binary, tmp_path, "--dump-dom", "--virtual-time-budget=2000", size,
                       measured.as_uri())
    left, top, chart_width = json.loads(Page(dom).find("body")[0]["attrs"]["data-chart"])
    assert chart_width == timeline.CHART_W          # drawn at its own size: 1 px per unit

    starts = [WALL0 + s for _, s, _ in LAST_WRITES]
    ends = [WALL0 + s + d for _, s, d in LAST_WRITES]
    red = rgb(COLOR_CONCURRENT)
    for rank, start, duration in LAST_WRITES:
        y = round(top + AXIS_H + ROW_H * rank + ROW_H / 2)
        found = runs(pixels[y], red)
        assert len(found) == 1, (rank, y, found)
        x0, x1 = found[0]
        want0 = left + expected_x(WALL0 + start, starts, ends)
        want1 = left + expected_x(WALL0 + start + duration, starts, ends)
        # the bar's 1 px outline is darker than its fill: the fill starts and ends within 2 px
        assert abs(x0 - want0) <= 3 and abs(x1 - want1) <= 3, (rank, found, want0, want1)

    # The overlap shading fills the rows where no bar is, e.g. row 1 (rank 1) after its end
    # and before rank 0's: from rank 1's end to the third end.
    y = round(top + AXIS_H + ROW_H * 1 + ROW_H / 2)
    shade = runs(pixels[y], rgb(COLOR_OVERLAP), tolerance=6)
    rank1_end = left + expected_x(WALL0 + 0.12 + 2.05, starts, ends)
    third_end = left + expected_x(sorted(ends)[2], starts, ends)
    assert any(abs(a - rank1_end) <= 3 and abs(b - third_end) <= 3 for a, b in shade), \
        (shade, rank1_end, third_end)
    # and the plain write of optimizer.pt is blue, somewhere below
    assert any(runs(row, rgb(COLOR_WRITE)) for row in pixels[int(top):])
