"""The timeline page in headless Chromium: the bars are found in the screenshot's pixels where
the journal's times say they are (the HTML itself, read back with the standard library's
parser, is tests/unit/test_timeline.py)."""
import json
import shutil
import struct
import subprocess
import zlib

import pytest

from incident import LAST_WRITES, WALL0, write_incident_journal
from monitor.cli import timeline
from monitor.cli.timeline import AXIS_H, COLOR_CONCURRENT, COLOR_OVERLAP, COLOR_WRITE, ROW_H
from timelinepage import Page, expected_x, report_html


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


def test_chromium_draws_the_bars_where_the_journal_says(tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    journal = tmp_path / "journal.jsonl"
    write_incident_journal(journal)
    page_file = tmp_path / "timeline.html"
    code, _, _ = report_html(journal, "-o", str(page_file))
    assert code == 1            # the incident's collisions
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
