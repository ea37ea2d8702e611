"""`ckptwatch report --format html`: the journal as one self-contained timeline page.

For an incident review: per checkpoint path, one chart per burst of writes ("episode"), a bar
per write on a time axis, one row per process (rank, node, pid), rows grouped by node; where
two or more writes of a concurrent collision were in flight at once the interval is shaded
across every row and the colliding bars are red (orange for a redundant collision). Hovering
a bar shows who, when, bytes, outcome and call site (SVG <title>: no script needed). Below:
collisions with the fix `report` prints, hazards, findings, each file's latest verification
verdict (an ok one says which bad verdict it superseded), and any record type this version
does not know, shown generically.

The page fetches nothing (inline CSS and SVG, system fonts, no script) and says so to the
browser: its Content-Security-Policy forbids scripts and every fetch, a second line of defence
behind escaping. Every string on it comes from training processes and file names on a shared
node, so every one goes through _text (escaped, control characters shown, length bounded),
and the page is bounded whatever the journal holds (MAX_* below; a note says what was left
out). The input is journalview.JournalSummary; the page is a pure function of it and a
clock.
"""
from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass, field

from exporters.logline import call_sites, clean
from monitor.cli.advice import suggest_fix
from monitor.cli.journalview import JournalSummary, write_identity
from monitor.cli.textfmt import human_bytes
from monitor.detect.model import KIND_CONCURRENT, KIND_REDUNDANT, Collision, Write

# Geometry of a chart, in CSS pixels. The SVG is drawn at this size (it shrinks, never grows,
# on narrower screens and in print), so at 1200 px and wider a second on the axis is
# PLOT_W / span pixels exactly: the browser test relies on it.
LABEL_W = 250            # the row labels
PLOT_W = 860             # the time axis
RIGHT_PAD = 20
CHART_W = LABEL_W + PLOT_W + RIGHT_PAD
AXIS_H = 30              # tick labels above the rows
ROW_H = 20
BAR_H = 12
MIN_BAR_W = 2            # a 1 ms save on a 10 s axis must still be visible
EPISODE_GAP = 2.0        # seconds between writes of one path that start a new episode
AXIS_PAD = 0.04          # of the episode's span, either side

COLOR_WRITE = "#4f7fb8"
COLOR_CONCURRENT = "#d0342c"
COLOR_REDUNDANT = "#e08a00"
COLOR_OVERLAP = "#f8cfcb"

# Bounds on what one page shows.
MAX_PATHS = 30           # charted paths (those with collisions first)
MAX_EPISODES = 4         # charts per path (those with collisions first, newest first)
MAX_ROWS = 96            # processes per chart
MAX_BARS = 600           # bars per chart
MAX_TABLE_ROWS = 200     # rows per table
MAX_TEXT = 240           # characters of any one string (paths keep their tail)
MAX_WRITERS_LISTED = 16  # writers named in one collision's table cell
MAX_FIELDS = 12          # fields shown of a record of unknown type

CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
       "base-uri 'none'; form-action 'none'")


# ---------------------------------------------------------------------------- escaping

def _text(value, limit: int = MAX_TEXT, tail: bool = False) -> str:
    """Any value from the journal, safe in HTML text and in a quoted attribute: control
    characters shown as escapes, cut to `limit` characters (keeping the tail of a path),
    then escaped (& < > " ')."""
    text = clean("" if value is None else value)
    if len(text) > limit:
        text = ("..." + text[-(limit - 3):]) if tail else (text[:limit - 3] + "...")
    return html.escape(text, quote=True)


def _when(wall, with_date: bool = False) -> str:
    if not isinstance(wall, (int, float)) or isinstance(wall, bool) or \
            not 1 <= wall <= 1e11:
        return "-"
    ms = int((wall % 1) * 1000)
    fmt = "%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S"
    return time.strftime(fmt, time.localtime(int(wall))) + f".{ms:03d}"


def _seconds(s: float | None) -> str:
    if s is None:
        return "open"
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s" if s < 100 else f"{s:.0f}s"


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith('ss') else 's'}"


# ---------------------------------------------------------------------------- model

@dataclass
class Episode:
    """A burst of writes on one path: writes less than EPISODE_GAP apart, and every write
    of a collision together."""

    start: float
    end: float
    writes: list = field(default_factory=list)
    collisions: list = field(default_factory=list)


def _end(w: Write) -> float:
    """Where the bar ends: its end, or its start while it has none (in flight, lost)."""
    if w.duration is not None:
        return w.start_wall + w.duration
    return w.end_wall if w.end_wall is not None else w.start_wall


def episodes(writes: list, collisions: list) -> list[Episode]:
    """The path's writes cut into episodes, oldest first."""
    spans = [(w.start_wall, _end(w), w, None) for w in writes]
    spans += [(c.first.start_wall, max(_end(w) for w in c.writes), None, c) for c in collisions]
    spans.sort(key=lambda s: (s[0], s[1]))
    out: list[Episode] = []
    for start, end, w, c in spans:
        if not out or start > out[-1].end + EPISODE_GAP:
            out.append(Episode(start, end))
        ep = out[-1]
        ep.end = max(ep.end, end)
        if w is not None:
            ep.writes.append(w)
        else:
            ep.collisions.append(c)
    return out


def overlap_intervals(c: Collision) -> list[tuple[float, float]]:
    """Where two or more of a collision's writes were in flight at once (wall times)."""
    points = []
    for w in c.writes:
        points += [(w.start_wall, 1), (_end(w), -1)]
    points.sort(key=lambda p: (p[0], p[1]))
    out, depth, since = [], 0, 0.0
    for t, delta in points:
        if depth < 2 <= depth + delta:
            since = t
        elif depth >= 2 > depth + delta and t > since:
            out.append((since, t))
        depth += delta
    return out


def _row_key(w: Write) -> tuple:
    r = w.writer
    return (str(r.node), r.rank if r.rank is not None else math.inf, r.pid)


def _row_label(key: tuple) -> str:
    node, rank, pid = key
    who = f"rank {rank}" if rank != math.inf else "no rank"
    return f"{who} · {node} · pid {pid}"


@dataclass
class Axis:
    """Wall time to x pixel in a chart."""

    t0: float
    t1: float

    @classmethod
    def around(cls, start: float, end: float) -> "Axis":
        span = max(end - start, 1e-3)
        pad = span * AXIS_PAD
        return cls(start - pad, end + pad)

    def x(self, t: float) -> float:
        return LABEL_W + (t - self.t0) / (self.t1 - self.t0) * PLOT_W

    def ticks(self) -> tuple[float, list[float]]:
        """A 1-2-5 step giving 5 to 10 ticks, and the ticks inside the axis."""
        span = self.t1 - self.t0
        step = 10 ** math.floor(math.log10(span / 10))
        for mult in (1, 2, 5, 10):
            if span / (step * mult) <= 10:
                step *= mult
                break
        first = math.ceil(self.t0 / step) * step
        return step, [first + i * step for i in range(int((self.t1 - first) / step) + 1)]


def _tick_label(t: float, step: float) -> str:
    base = time.strftime("%H:%M:%S", time.localtime(int(t)))
    if step >= 1:
        return base
    digits = 1 if step >= 0.1 else 2 if step >= 0.01 else 3
    return base + f"{t % 1:.{digits}f}"[1:]


# ---------------------------------------------------------------------------- chart

def _bar_title(w: Write, role: str, collision: Collision | None) -> str:
    r = w.writer
    who = f"rank {r.rank}" if r.rank is not None else "no rank"
    lines = [f"{who} on {r.node}, pid {r.pid}" + (f", job {r.job}" if r.job else ""),
             f"{_when(w.start_wall)} to {_when(_end(w)) if w.duration is not None else '?'}"
             f" ({_seconds(w.duration)})",
             f"{human_bytes(w.bytes)}, outcome {w.outcome or '?'}, via {w.source}",
             f"call site {w.site or '?'}" + (f" ({w.func})" if w.func else "")]
    if collision is not None:
        lines.append(f"{role} collision {collision.id}".rstrip())
    return "\n".join(_text(line, 400) for line in lines)


def render_chart(ep: Episode, roles: dict) -> str:
    """One episode as an SVG: rows of bars, overlap shading, a time axis."""
    writes = sorted(ep.writes, key=lambda w: w.start_wall)[-MAX_BARS:]
    rows = sorted({_row_key(w) for w in writes})
    hidden_rows = max(0, len(rows) - MAX_ROWS)
    rows = rows[:MAX_ROWS]
    index = {key: i for i, key in enumerate(rows)}
    axis = Axis.around(ep.start, ep.end)
    height = AXIS_H + ROW_H * len(rows) + 6
    plot_bottom = AXIS_H + ROW_H * len(rows)
    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" '
           f'height="{height}" viewBox="0 0 {CHART_W} {height}" '
           f'data-t0="{axis.t0!r}" data-t1="{axis.t1!r}" role="img" '
           f'shape-rendering="crispEdges">']
    # Node groups: a light band behind each node's rows, every other node.
    prev_node, shade = None, False
    for i, key in enumerate(rows):
        if key[0] != prev_node:
            shade, prev_node = not shade, key[0]
            if i:
                y = AXIS_H + ROW_H * i
                out.append(f'<line class="node-sep" x1="0" x2="{CHART_W}" y1="{y}" y2="{y}"/>')
        if shade:
            out.append(f'<rect class="node-band" x="0" y="{AXIS_H + ROW_H * i}" '
                       f'width="{CHART_W}" height="{ROW_H}"/>')
        out.append(f'<text class="row-label" x="{LABEL_W - 8}" '
                   f'y="{AXIS_H + ROW_H * i + ROW_H / 2 + 4}">{_text(_row_label(key), 60)}</text>')
    step, ticks = axis.ticks()
    for t in ticks:
        x = axis.x(t)
        out.append(f'<line class="tick" x1="{x:.2f}" x2="{x:.2f}" y1="{AXIS_H - 4}" '
                   f'y2="{plot_bottom}"/>')
        out.append(f'<text class="tick-label" x="{x:.2f}" y="{AXIS_H - 9}">'
                   f'{_text(_tick_label(t, step))}</text>')
    for c in ep.collisions:
        if c.kind != KIND_CONCURRENT:
            continue
        for a, b in overlap_intervals(c):
            x0, x1 = axis.x(a), axis.x(b)
            out.append(f'<rect class="overlap" x="{x0:.2f}" y="{AXIS_H}" '
                       f'width="{max(MIN_BAR_W, x1 - x0):.2f}" height="{ROW_H * len(rows)}" '
                       f'data-start="{a!r}" data-end="{b!r}"><title>'
                       f'{_text(f"{len(c.writes)} writes in flight at once for {_seconds(b - a)}")}'
                       f'</title></rect>')
    for w in writes:
        row = index.get(_row_key(w))
        if row is None:
            continue
        role, collision = roles.get(write_identity(w), ("write", None))
        x0, x1 = axis.x(w.start_wall), axis.x(_end(w))
        classes = ["bar", role]
        if w.outcome == "lost" or w.duration is None:
            classes.append("lost")
        elif w.outcome not in (None, "ok"):
            classes.append("failed")
        y = AXIS_H + ROW_H * row + (ROW_H - BAR_H) / 2
        out.append(f'<rect class="{" ".join(classes)}" x="{x0:.2f}" y="{y:.1f}" '
                   f'width="{max(MIN_BAR_W, x1 - x0):.2f}" height="{BAR_H}" '
                   f'data-start="{w.start_wall!r}" data-end="{_end(w)!r}" '
                   f'data-row="{row}"><title>{_bar_title(w, role, collision)}</title></rect>')
    out.append(f'<line class="axis" x1="{LABEL_W}" x2="{LABEL_W + PLOT_W}" y1="{AXIS_H}" '
               f'y2="{AXIS_H}"/>')
    out.append("</svg>")
    notes = []
    if hidden_rows:
        notes.append(f"{_plural(hidden_rows, 'more process')} not shown")
    if len(ep.writes) > len(writes):
        notes.append(f"{_plural(len(ep.writes) - len(writes), 'earlier write')} not shown")
    if notes:
        out.append(f'<p class="more">{"; ".join(notes)}</p>')
    return "\n".join(out)


# ---------------------------------------------------------------------------- sections

def _roles(collisions: list) -> dict:
    roles = {}
    for c in collisions:
        role = "concurrent" if c.kind == KIND_CONCURRENT else \
            "redundant" if c.kind == KIND_REDUNDANT else "write"
        for w in c.writes:
            if roles.get(write_identity(w), ("",))[0] != "concurrent":
                roles[write_identity(w)] = (role, c)
    return roles


def _path_section(path: str, writes: list, collisions: list, verdicts: list,
                  number: int) -> str:
    eps = episodes(writes, collisions)
    chosen = sorted(eps, key=lambda e: (bool(e.collisions), e.start), reverse=True)[:MAX_EPISODES]
    chosen.sort(key=lambda e: e.start)
    roles = _roles(collisions)
    writers = {w.writer.key for w in writes}
    facts = [_plural(len(writes), "write"), _plural(len(writers), "process"),
             _plural(len(collisions), "collision")]
    out = [f'<section class="path" id="path-{number}">',
           f'<h2><span class="label">path</span> <code>{_text(path, tail=True)}</code></h2>',
           f'<p class="facts">{", ".join(facts)}']
    for v in verdicts[-3:]:
        out.append(f' &middot; <span class="verdict {_text(v.get("result"), 20)}">'
                   f'{_text(str(v.get("result", "")).upper(), 20)}: {_text(v.get("cause"), 40)}'
                   f'</span>')
    out.append("</p>")
    for ep in chosen:
        head = f"{_when(ep.start, with_date=True)} to {_when(ep.end)} ({_seconds(ep.end - ep.start)})"
        tag = "".join(f' <span class="tag {_text(c.kind, 20)}">{_text(c.kind, 20)} collision'
                      f'</span> {_text(_collision_how(c))}' for c in ep.collisions[:3])
        out.append(f'<figure><figcaption>{_text(head)}, '
                   f'{_plural(len(ep.writes), "write")}{tag}</figcaption>')
        out.append(render_chart(ep, roles))
        out.append("</figure>")
    if len(eps) > len(chosen):
        rest = [e for e in eps if e not in chosen]
        out.append(f'<p class="more">{_plural(len(rest), "more episode")} of this path '
                   f'({_plural(sum(len(e.writes) for e in rest), "write")}) not shown</p>')
    out.append("</section>")
    return "\n".join(out)


def _table(headers: list, rows: list, total: int, cls: str) -> str:
    """rows are lists of already-escaped cell HTML."""
    out = [f'<table class="{cls}"><thead><tr>'
           + "".join(f"<th>{h}</th>" for h in headers) + "</tr></thead><tbody>"]
    for row in rows[:MAX_TABLE_ROWS]:
        out.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>")
    out.append("</tbody></table>")
    if total > min(len(rows), MAX_TABLE_ROWS):
        out.append(f'<p class="more">{total - min(len(rows), MAX_TABLE_ROWS)} more not shown '
                   f'(the newest are listed; see ckptwatch report --format json)</p>')
    return "\n".join(out)


def _collision_how(c: Collision) -> str:
    """4 writers overlapped 154ms / 2 writers one after another over 3.00s"""
    n = _plural(len(c.writers), "writer")
    if c.kind == KIND_CONCURRENT:
        last = c.last.writer
        who = f"rank {last.rank}" if last.rank is not None else f"pid {last.pid}"
        return (f"{n} overlapped {_seconds(c.overlap_seconds)}, last to finish {who} on "
                f"{last.node}")
    span = max(_end(w) for w in c.writes) - c.first.start_wall
    return f"{n} one after another over {_seconds(span)}"


def _collision_rows(collisions: list, anchors: dict) -> list:
    rows = []
    newest = sorted(collisions, key=lambda c: c.first.start_wall, reverse=True)
    for c in newest[:MAX_TABLE_ROWS]:
        writers = c.writers
        names = ", ".join(_text(w.label, 60) + f" (pid {_text(w.pid, 12)})"
                          for w in writers[:MAX_WRITERS_LISTED])
        if len(writers) > MAX_WRITERS_LISTED:
            names += f", and {len(writers) - MAX_WRITERS_LISTED} more"
        how = _collision_how(c).split(" ", 2)[2].split(", last")[0]
        anchor = anchors.get(c.path)
        path = f"<code>{_text(c.path, tail=True)}</code>"
        if anchor:
            path = f'<a href="#{anchor}">{path}</a>'
        rows.append([_text(_when(c.first.start_wall, with_date=True)), path,
                     f'<span class="tag {_text(c.kind, 20)}">{_text(c.kind, 20)}</span>',
                     _text(c.scope, 20), f"{len(writers)}: {names}", _text(how),
                     "<br>".join(f"<code>{_text(s, tail=True)}</code>" for s in call_sites(c)[:8]),
                     _text(suggest_fix(c), 400), f"<code>{_text(c.id, 40)}</code>"])
    return rows


def _finding_rows(findings: list) -> list:
    rows = []
    for f in reversed(findings):
        writers = f.get("writers") if isinstance(f.get("writers"), list) else []
        names = ", ".join(
            _text(f"rank {w.get('rank')}" if w.get("rank") is not None else "no rank", 20)
            + f" pid {_text(w.get('pid'), 12)}" for w in writers[:MAX_WRITERS_LISTED]
            if isinstance(w, dict))
        if f.get("type") == "size_fluctuation":
            before, after = _int(f.get("size_before")), _int(f.get("size_after"))
            sizes = (human_bytes(before), human_bytes(after))
            if sizes[0] == sizes[1] and before is not None:
                sizes = (f"{before:,} bytes", f"{after:,} bytes")   # 3.1GiB then 3.1GiB
            what = (f"{_text(f.get('rule') or 'shrank while written', 80)}: "
                    f"{_text(sizes[0])} then {_text(sizes[1])}")
        else:
            reader = f.get("reader") if isinstance(f.get("reader"), dict) else {}
            what = f"read by pid {_text(reader.get('pid', '?'), 12)} while written"
        rows.append([_text(_when(f.get("wall"), with_date=True)),
                     _text(str(f.get("type")).replace("_", " "), 40),
                     f"<code>{_text(f.get('path'), tail=True)}</code>", names, what,
                     _text(f.get("job"), 60)])
    return rows


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _verdict_cell(v: dict) -> str:
    result = f'<span class="verdict {_text(v.get("result"), 20)}">{_text(v.get("result"), 20)}</span>'
    old = v.get("supersedes")
    if isinstance(old, dict):
        result += (f'<br><span class="superseded">supersedes '
                   f'{_text(old.get("result"), 20)}'
                   f'{" (" + _text(old.get("cause"), 40) + ")" if old.get("cause") else ""}'
                   f' of {_text(_when(old.get("wall"), with_date=True))}</span>')
    return result


def _verdict_rows(verdicts: list) -> list:
    rows = []
    for v in reversed(verdicts):
        rows.append([_text(_when(v.get("wall"), with_date=True)),
                     f"<code>{_text(v.get('path'), tail=True)}</code>", _verdict_cell(v),
                     _text(v.get("cause"), 40), _text(v.get("reason"), 400),
                     _text(v.get("format"), 40), _text(human_bytes(_int(v.get("bytes")))),
                     f"<code>{_text(v.get('collision_id'), 40)}</code>"])
    return rows


def _hazard_rows(hazards: list) -> list:
    rows = []
    for h in reversed(hazards):
        writers = h.get("writers") or [{}]
        w = writers[0]
        who = f"rank {w.get('rank')} on {w.get('node')} (pid {w.get('pid')})"
        ranks = ", ".join(str(r) for r in (h.get("ranks") or [])[:64])
        rows.append([_text(_when(h.get("wall"), with_date=True)),
                     f"<code>{_text(h.get('path'), tail=True)}</code>",
                     f'<span class="tag">{_text(h.get("hazard"), 40)}</span>',
                     _text(h.get("shared"), 60), _text(who),
                     f"<code>{_text(w.get('site'), tail=True)}</code>", _text(ranks),
                     _text(h.get("job"), 60)])
    return rows


def _records_section(title: str, sub: str, records: list, css: str) -> list:
    """A heading, a line on what it holds and a table of raw records; nothing if none."""
    if not records:
        return []
    return [f"<h2>{title}</h2>", f'<p class="sub">{sub}</p>',
            _table(["when", "type", "path", "fields"], _other_rows(records[-MAX_TABLE_ROWS:]),
                   len(records), css)]


def _other_rows(others: list) -> list:
    rows = []
    for rec in reversed(others):
        wall = rec.get("wall", rec.get("ts"))
        fields = [(k, v) for k, v in rec.items() if k not in ("type", "path", "wall", "ts")]
        shown = "; ".join(f"{_text(k, 40)}={_text(v, 120)}" for k, v in fields[:MAX_FIELDS])
        if len(fields) > MAX_FIELDS:
            shown += f"; and {len(fields) - MAX_FIELDS} more fields"
        rows.append([_text(_when(wall, with_date=True)), _text(rec.get("type"), 60),
                     f"<code>{_text(rec.get('path'), tail=True)}</code>", shown])
    return rows


# ---------------------------------------------------------------------------- page

STYLE = """
:root { --ink:#1d232b; --muted:#5c6670; --rule:#d6dbe0; --band:#f3f5f8; }
* { box-sizing: border-box; }
body { margin: 24px auto; max-width: 1560px; padding: 0 24px; color: var(--ink);
  font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Helvetica, Arial,
  sans-serif; -webkit-print-color-adjust: exact; print-color-adjust: exact; }
code { font: 12.5px/1.3 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace;
  overflow-wrap: anywhere; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 28px 0 4px; font-weight: 600; }
h2 .label { color: var(--muted); font-weight: 400; font-size: 13px; text-transform: uppercase; }
.sub { color: var(--muted); margin: 0 0 14px; }
dl.summary { display: grid; grid-template-columns: max-content 1fr; gap: 2px 18px;
  margin: 0 0 12px; }
dl.summary dt { color: var(--muted); } dl.summary dd { margin: 0; }
.legend { display: flex; gap: 18px; align-items: center; color: var(--muted); font-size: 13px;
  margin: 10px 0; flex-wrap: wrap; }
.legend i { display: inline-block; width: 22px; height: 11px; vertical-align: -1px;
  margin-right: 6px; }
.facts { color: var(--muted); margin: 0 0 6px; }
figure { margin: 6px 0 14px; break-inside: avoid; }
figcaption { font-size: 13px; color: var(--muted); margin-bottom: 2px; }
svg.chart { display: block; max-width: 100%; height: auto; }
svg .row-label { font-size: 12px; text-anchor: end; fill: var(--ink); }
svg .tick-label { font-size: 11px; text-anchor: middle; fill: var(--muted); }
svg .tick { stroke: #e4e8ec; stroke-width: 1; }
svg .axis { stroke: #9aa4ae; stroke-width: 1; }
svg .node-band { fill: var(--band); }
svg .node-sep { stroke: var(--rule); }
svg .overlap { fill: COLOR_OVERLAP; }
svg .bar { fill: COLOR_WRITE; }
svg .bar.concurrent { fill: COLOR_CONCURRENT; stroke: #6d120d; stroke-width: 1; }
svg .bar.redundant { fill: COLOR_REDUNDANT; stroke: #7a4a00; stroke-width: 1; }
svg .bar.lost { fill-opacity: .45; stroke-dasharray: 3 2; stroke: #333; }
svg .bar.failed { stroke: #000; stroke-width: 2; }
.tag { display: inline-block; white-space: nowrap; padding: 0 6px; border-radius: 3px; font-size: 12px;
  color: #fff; background: #69737d; }
.tag.concurrent { background: COLOR_CONCURRENT; } .tag.redundant { background: COLOR_REDUNDANT; }
.verdict.corrupt { color: #a01d16; font-weight: 600; }
.verdict.unverifiable { color: #8a5a00; font-weight: 600; }
.verdict.incomplete { color: #a01d16; font-weight: 600; }
.superseded { color: var(--muted); font-size: 12px; }
table { border-collapse: collapse; width: 100%; margin: 6px 0 4px; font-size: 13px; }
th, td { text-align: left; vertical-align: top; padding: 4px 8px;
  border-bottom: 1px solid var(--rule); }
th { background: var(--band); font-weight: 600; white-space: nowrap; }
td { overflow-wrap: break-word; }
td:first-child { white-space: nowrap; }
table.collisions td:nth-child(2) { min-width: 16em; }
table.collisions td:nth-child(7) { min-width: 13em; }
table.collisions td:last-child code { white-space: nowrap; font-size: 11.5px; }
.more { color: var(--muted); font-style: italic; margin: 2px 0 10px; }
.none { color: var(--muted); }
@media print {
  body { margin: 0; max-width: none; padding: 0; font-size: 10pt; }
  section.path, table tr { break-inside: avoid; }
  a { color: inherit; text-decoration: none; }
}
""".replace("COLOR_OVERLAP", COLOR_OVERLAP).replace("COLOR_WRITE", COLOR_WRITE) \
   .replace("COLOR_CONCURRENT", COLOR_CONCURRENT).replace("COLOR_REDUNDANT", COLOR_REDUNDANT)


def _legend() -> str:
    items = [(COLOR_WRITE, "write"), (COLOR_CONCURRENT, "write in a concurrent collision"),
             (COLOR_REDUNDANT, "write in a redundant collision"),
             (COLOR_OVERLAP, "two or more writes in flight at once")]
    return ('<div class="legend">' + "".join(f'<span><i style="background:{color}"></i>'
                                             f'{label}</span>' for color, label in items)
            + "<span>hover a bar for its call site, pid, bytes and outcome</span></div>")


def _paths(summary: JournalSummary) -> list:
    """(path, writes, collisions) to chart: paths with a concurrent collision or a corrupt
    verdict first, then those with redundant collisions (most recent collision first), then
    the others by their last write, newest first."""
    by_path: dict = {}
    for w in summary.kept_writes.values():
        by_path.setdefault(w.path, ([], []))[0].append(w)
    for c in summary.collisions:
        by_path.setdefault(c.path, ([], []))[1].append(c)

    corrupt = {v.get("path") for v in summary.unusable}

    def order(item):
        path, (writes, collisions) = item
        last = max((_end(w) for w in writes), default=0.0)
        latest = max((c.first.start_wall for c in collisions), default=0.0)
        severity = 2 if path in corrupt or any(c.kind == KIND_CONCURRENT for c in collisions) \
            else 1 if collisions else 0
        return (severity, latest, last)

    return [(p, ws, cs) for p, (ws, cs) in sorted(by_path.items(), key=order, reverse=True)]


def render_html(summary: JournalSummary, now: float | None = None) -> str:
    """The whole page for a summary (journalview.summarize)."""
    now = time.time() if now is None else now
    paths = _paths(summary)
    charted = paths[:MAX_PATHS]
    anchors = {path: f"path-{i}" for i, (path, _, _) in enumerate(charted)}
    verdicts = summary.verdicts
    verdicts_by_path: dict = {}
    for v in verdicts:
        verdicts_by_path.setdefault(v.get("path"), []).append(v)
    collisions = summary.collisions
    n_conc = summary.counts["concurrent"]
    results: dict = {}
    for v in verdicts:
        results[v.get("result")] = results.get(v.get("result"), 0) + 1
    counts = summary.counts
    title = (f"{_plural(len(collisions), 'collision')} on "
             f"{_plural(len({c.path for c in collisions}), 'path')}") if collisions \
        else "no collisions"
    rng = "-"
    if summary.first_wall is not None:
        rng = (f"{_when(summary.first_wall, with_date=True)} to "
               f"{_when(summary.last_wall, with_date=True)} "
               f"(local time, UTC{time.strftime('%z', time.localtime(int(summary.first_wall)))})")
    jobs = sorted(summary.jobs)
    facts = [("time range", _text(rng)),
             ("jobs", ", ".join(f"<code>{_text(j, 80)}</code>" for j in jobs[:20])
              + (f" and {len(jobs) - 20} more" if len(jobs) > 20 else "") or "-"),
             ("writes", f"{summary.writes} on {_plural(len(paths), 'path')}, by "
                        f"{_plural(len({w.writer.key for w in summary.kept_writes.values()}), 'process')}"),
             ("collisions", f"{summary.counts['collisions']} ({n_conc} concurrent, "
                            f"{summary.counts['redundant']} redundant)"),
             ("findings", f"{_plural(counts['size_fluctuations'], 'size fluctuation')}, "
                          f"{_plural(counts['torn_reads'], 'torn read')}, "
                          f"{_plural(counts['hazards'], 'hazard')}, "
                          f"{len(summary.others)} other"),
             ("verdicts", ", ".join(f"{results.get(r, 0)} {r}" for r in
                                    ("corrupt", "incomplete", "unverifiable", "ok"))
              + " (each file's latest)"),
             ("journal", ", ".join(f"<code>{_text(j, tail=True)}</code>"
                                   for j in summary.journals[:8])
              + f" ({_plural(summary.files, 'file')}"
              + (f", {summary.malformed} unreadable lines skipped" if summary.malformed else "")
              + (f", {summary.total_dropped} oldest records not loaded"
                 if summary.total_dropped else "")
              + ")")]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>ckptwatch timeline: {_text(title)}</title>",
           f"<style>{STYLE}</style></head><body>",
           f"<h1>ckptwatch timeline: {_text(title)}</h1>",
           f'<p class="sub">generated {_text(_when(now, with_date=True))} by '
           f"<code>ckptwatch report --format html</code></p>",
           '<dl class="summary">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
           + "</dl>", _legend()]
    for i, (path, writes, cs) in enumerate(charted):
        out.append(_path_section(path, writes, cs, verdicts_by_path.get(path, []), i))
    if len(paths) > len(charted):
        rest = paths[len(charted):]
        out.append(f'<p class="more">{_plural(len(rest), "more path")} '
                   f'({_plural(sum(len(ws) for _, ws, _ in rest), "write")}, no newer '
                   f"collisions) not shown</p>")
    if not paths:
        out.append('<p class="none">The journal holds no writes.</p>')
    out.append("<h2>Collisions</h2>")
    out.append(_table(["first write", "path", "kind", "scope", "writers", "timing",
                       "call sites", "fix", "id"],
                      _collision_rows(collisions, anchors), len(collisions), "collisions")
               if collisions else '<p class="none">none</p>')
    out.append("<h2>Findings: size fluctuations and torn reads</h2>")
    findings = list(summary.findings)
    out.append(_table(["when", "finding", "path", "writers", "what", "job"],
                      _finding_rows(findings[-MAX_TABLE_ROWS:]), len(findings), "findings")
               if findings else '<p class="none">none</p>')
    out.append("<h2>Verification verdicts</h2>")
    out.append('<p class="sub">Each file\'s latest verdict the agent journaled (corrupt, '
               'incomplete, unverifiable; ok when it supersedes one of those or is of a '
               'collision\'s file).</p>')
    out.append(_table(["verified", "path", "result", "cause", "reason", "format", "bytes",
                       "written by collision"],
                      _verdict_rows(verdicts[-MAX_TABLE_ROWS:]), len(verdicts), "verdicts")
               if verdicts else '<p class="none">none</p>')
    out.append("<h2>Hazards</h2>")
    out.append('<p class="sub">Saves that will collide under the right timing (job scope: '
               'a <code>local_rank == 0</code> guard, several ranks on shared storage).</p>')
    hazards = list(summary.hazards)
    out.append(_table(["reported", "path", "hazard", "shared storage", "reported by",
                       "call site", "ranks writing it", "job"],
                      _hazard_rows(hazards[-MAX_TABLE_ROWS:]), len(hazards), "hazards")
               if hazards else '<p class="none">none</p>')
    out += _records_section(
        "Other findings", "Record types this version of the report does not know, as recorded.",
        list(summary.others), "others")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
