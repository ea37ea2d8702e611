"""`ckptwatch report`: who wrote which checkpoint path when, and how to fix it.

Reads the agent's journal (monitor/cli/journalview.py: exporters/journal.py's records back
into monitor/detect/model.py's collisions) and renders them for an 80-column terminal (table),
for tools (json) or as a timeline page (html: monitor/cli/timeline.py). The CLI wires it in
with add_arguments(parser) and run(args).

Several journals (`--journal A --journal B`, or a directory holding several nodes' *.jsonl)
merge into one picture per job: a job-scope collision recorded by every involved node's agent
carries the same id on each (derived from the job run, the path and the writes), so it is
shown once; a hazard is shown once per (job, path, kind).
"""
from __future__ import annotations

import json
import os
import sys
import time

from ckptwatch import verdicts as file_verdicts
from exporters.journal import SYSTEM_JOURNAL_PATH, default_journal_path
from exporters.logline import call_sites, clean
from monitor.cli.advice import FIX, suggest_fix
from monitor.cli.journalfiles import journal_paths
from monitor.cli.journalrecords import integer, number, text
from monitor.cli.journalview import MAX_RECORDS_KEPT, JournalSummary, summarize
from monitor.cli.style import NORMAL, VERBOSE, Painter, UsageError, verbosity
from monitor.cli.textfmt import clock_time, human_bytes, keep_head, keep_tail, wrapped
from monitor.detect.model import KIND_CONCURRENT, SOURCE_HOOK, SOURCE_JOB, Collision, Write

EXIT_OK = 0
EXIT_FOUND = 1          # a collision, a hazard or an unusable (corrupt, incomplete) checkpoint
EXIT_NO_JOURNAL = 2     # usage: no journal, or one that cannot be read

TABLE_ITEMS = 100       # newest items per section of the table (--format json lists more)


# ---------------------------------------------------------------------------- formatting

def _duration(w: Write) -> str:
    if w.duration is None:
        return "open"
    return f"{w.duration:.2f}s" if w.duration < 100 else f"{w.duration:.0f}s"


def _site(w: Write) -> str:
    return w.site or "?"


def writer_kinds(c: Collision) -> list:
    """The libraries that wrote, when a hook said which (events' `writer`; job scope passes
    another node's on): a hook's or job scope's write that does not say went through
    torch.save. Empty when no write says (torch.save only, or the filesystem's writes), so a
    plain torch.save report reads as it always did."""
    if all(w.writer_kind is None for w in c.writes):
        return []
    kinds = {w.writer_kind or ("torch.save" if w.source in (SOURCE_HOOK, SOURCE_JOB)
                               else None)
             for w in c.writes}
    return sorted(clean(kind) for kind in kinds if kind is not None)


def _who(w: Write) -> str:
    return f"{clean(w.writer.label)} (pid {w.writer.pid})"


def _columns(width: int) -> list:
    # (title, width); the call site takes what is left of the line.
    fixed = [("writer", 18), ("pid", 7), ("start", 12), ("dur", 7), ("bytes", 8)]
    used = 2 + sum(w + 1 for _, w in fixed)
    return fixed + [("call site", max(10, width - used))]


def _row(values: list, columns: list) -> str:
    cells = []
    for (title, w), value in zip(columns, values):
        if title == "call site":
            cells.append(keep_tail(value, w))
        elif title == "writer":
            cells.append(keep_head(value, w).ljust(w))
        else:
            cells.append(keep_head(value, w).rjust(w) if title in ("pid", "dur", "bytes")
                         else keep_head(value, w).ljust(w))
    return ("  " + " ".join(cells)).rstrip()


def found_in_file(c: Collision, record: dict | None) -> str:
    """What the agent found in the file collision `c` wrote, in the words of the resume guard
    and `ckptwatch scan` (ckptwatch.verdicts.describe): from the verdict stored with the file
    when it is still there and about this collision, else from the journal's verification
    record (`record`, a corrupt or unverifiable verdict linked to c.id). "" without either."""
    try:
        st = os.stat(c.path)
        stored = file_verdicts.decode(os.getxattr(c.path, file_verdicts.XATTR))
        if stored is not None and stored.collision == c.id and file_verdicts.same_file(stored, st):
            return file_verdicts.describe(c.path, stored)
    except (OSError, ValueError):
        pass
    if record is None or record.get("result") != file_verdicts.CORRUPT:
        return ""
    writers = tuple(file_verdicts.writer_text(w.writer.rank, w.writer.pid, w.writer.node, w.site)
                    for w in c.writes)[:file_verdicts.MAX_WRITERS]
    text = lambda v: v if isinstance(v, str) else ""     # noqa: E731
    verdict = file_verdicts.FileVerdict(file_verdicts.CORRUPT, text(record.get("cause")),
                                        text(record.get("reason")), c.id, writers)
    return file_verdicts.describe(c.path, verdict)


def render_collision(c: Collision, width: int = 80, found: str = "") -> list:
    """The lines for one collision (without the path heading); found: what the agent found
    in the file (found_in_file)."""
    lines = []
    first = c.first
    day = time.strftime("%Y-%m-%d", time.localtime(int(first.start_wall)))
    writers = len(c.writers)
    if c.kind == KIND_CONCURRENT:
        how = f"overlapped {c.overlap_seconds:.2f}s"
    else:
        last_end = max((w.end_wall or w.start_wall) for w in c.writes)
        how = f"one after another over {max(0.0, last_end - first.start_wall):.2f}s"
    head = f"{clean(c.kind)} collision, {writers} writers, {how}, {day}"
    if c.scope != "node":
        head += f", scope {clean(c.scope)}"
    lines += wrapped("", head, width)
    if c.kind != KIND_CONCURRENT:
        lines += wrapped("", "(the same job run wrote it from several processes: not "
                          "corrupt yet, the same bug waiting to happen)", width)
    columns = _columns(width)
    lines.append(_row([title for title, _ in columns], columns))
    for w in c.writes:
        lines.append(_row([w.writer.label, str(w.writer.pid), clock_time(w.start_wall),
                           _duration(w), human_bytes(w.bytes), _site(w)], columns))
    for w in c.writes:
        if w.outcome == "lost":
            lines += wrapped("", f"{_who(w)}: its end was never seen (the process died or "
                              "stalled); duration is up to its last sign of life", width)
        elif w.end_wall is None:
            lines += wrapped("", f"{_who(w)}: still writing when the collision was reported "
                              "(it held the report back for collision.max-hold)", width)
        elif w.outcome not in (None, "ok"):
            lines += wrapped("", f"{_who(w)}: the save raised {clean(w.outcome)}", width)
    last = c.last
    if c.kind == KIND_CONCURRENT:
        # Not "its bytes are on disk": every writer truncated and wrote the same file, so what
        # is on disk is usually a mix (the demo shows files that fail to load).
        lines += wrapped("last to finish: ", f"{_who(last)}; the file on disk may mix "
                          "bytes of every writer", width)
    else:
        lines += wrapped("last write: ", f"{_who(last)}, its bytes are on disk", width)
    kinds = writer_kinds(c)
    if kinds:
        lines += wrapped("written with: ", ", ".join(kinds), width)
    sites = call_sites(c)
    if sites:
        lines += wrapped("call site: " if len(sites) == 1 else "call sites: ",
                          ", ".join(sites), width)
    if found:
        lines += wrapped("found: ", found, width)
    lines += wrapped("fix: ", suggest_fix(c), width)
    if c.id:
        lines.append(keep_head(f"  id {c.id}", width))
    return lines


def render_table(collisions: list, width: int = 80, verdicts=()) -> str:
    """Every path with collisions, its collisions oldest first; every line <= width. With
    several jobs, one section per job (headed "== job <id> =="), each path in it. verdicts:
    the journal's verification records, for what the agent found in each file."""
    by_collision = {v.get("collision_id"): v for v in verdicts if v.get("collision_id")}
    by_path: dict[tuple, list] = {}
    ordered = sorted(collisions, key=lambda c: c.first.start_wall)
    several_jobs = len({c.job_label for c in ordered}) > 1
    for c in sorted(ordered, key=lambda c: c.job_label) if several_jobs else ordered:
        by_path.setdefault((c.job_label, c.path), []).append(c)
    lines = []
    job_shown = None
    for (job, path), group in by_path.items():
        if lines:
            lines.append("")
        if several_jobs and job != job_shown:
            job_shown = job
            lines.append(keep_head(f"== job {job or '(unknown)'} ==", width))
        lines.append(keep_tail(path, width))
        for index, c in enumerate(group):
            if index:
                lines.append("")
            found = found_in_file(c, by_collision.get(c.id)) if c.kind == KIND_CONCURRENT \
                else ""
            lines += render_collision(c, width, found)
    # A last guard: nothing may wrap in the terminal, whatever a value contained.
    return "\n".join(line if len(line) <= width else keep_head(line, width) for line in lines)


def render_json(collisions: list, hazards: list = (), summary: JournalSummary | None = None,
                exit_code: int | None = None) -> str:
    """A JSON document: {"collisions": [<journal collision record>, ...], "hazards": [...],
    "verifications": [<each file's latest verdict, with "supersedes">, ...],
    "size_fluctuations": [...], "torn_reads": [...], "counts": {...}, ...}. Records are the
    journal's, with only the fields a report reads, each of its expected type
    (monitor/cli/journalrecords.py); every list holds at most MAX_RECORDS_KEPT, the newest;
    "counts" are the totals."""
    doc = {"collisions": [c.to_record() for c in collisions], "hazards": list(hazards)}
    if summary is not None:
        doc["verifications"] = summary.verdicts
        doc["size_fluctuations"] = [f for f in summary.findings
                                    if f.get("type") == "size_fluctuation"]
        doc["torn_reads"] = [f for f in summary.findings if f.get("type") == "torn_read"]
        doc["counts"] = dict(summary.counts, writes=summary.writes,
                             unusable_checkpoints=len(summary.unusable))
        doc["malformed"] = summary.malformed
        doc["not_listed"] = summary.total_dropped
        doc["journals"] = list(summary.journals)
    if exit_code is not None:
        doc["exit_code"] = exit_code
    # Compact: the C encoder (indent= takes the pure-Python one, ~5x slower).
    return json.dumps(doc, sort_keys=False, allow_nan=False)


def _newest(items: list, limit: int, what: str, width: int) -> tuple:
    """The newest `limit` items and the line saying how many older ones are not shown."""
    if len(items) <= limit:
        return list(items), []
    return list(items)[-limit:], wrapped("", f"({len(items) - limit} older {what} not shown; "
                                             "--format json lists up to "
                                             f"{MAX_RECORDS_KEPT:,})", width)


def render_hazards(hazards: list, width: int = 80) -> str:
    """One block per hazard: the path, what is wrong, who, the fix (the newest TABLE_ITEMS)."""
    from exporters.logline import HAZARD_TEXT
    shown, more = _newest(hazards, TABLE_ITEMS, "hazards", width)
    lines = list(more)
    for h in shown:
        if lines:
            lines.append("")
        lines.append(keep_tail(text(h, "path") or "?", width))
        kind = text(h, "hazard") or "?"
        shared = h.get("shared")
        head = f"hazard {kind} (shared storage: {shared if shared is not None else '?'})"
        if text(h, "job"):
            head += f", job {text(h, 'job')}"
        lines += wrapped("", clean(head), width)
        lines += wrapped("", clean(HAZARD_TEXT.get(kind, kind)), width)
        writers = h.get("writers") or [{}]
        writer = writers[0]
        who = f"rank{writer.get('rank')}@{writer.get('node')} (pid {writer.get('pid')})"
        if writer.get("site"):
            who += f" at {writer.get('site')}"
        lines += wrapped("reported by: ", clean(who), width)
        ranks = h.get("ranks") or []
        if ranks:
            lines += wrapped("ranks writing it: ", ", ".join(str(r) for r in ranks), width)
        lines += wrapped("fix: ", FIX, width)
    return "\n".join(line if len(line) <= width else keep_head(line, width) for line in lines)


def _when(wall) -> str:
    return "at an unknown time" if wall is None or not 1 <= wall <= 1e11 else \
        time.strftime("%Y-%m-%d ", time.localtime(int(wall))) + clock_time(wall)


def _verdict_text(v: dict) -> str:
    result = text(v, "result") or "?"
    cause = text(v, "cause")
    what = f"{result} ({cause})" if cause else result
    if text(v, "format"):
        what += f", {text(v, 'format')}"
    return what + f", verified {_when(number(v, 'wall'))}"


def render_verdicts(verdicts: list, width: int = 80) -> str:
    """One block per file: its latest verdict (result, cause, when, why) and the bad one an
    ok verdict superseded."""
    shown, more = _newest(verdicts, TABLE_ITEMS, "verdicts", width)
    lines = list(more)
    for v in shown:
        if lines:
            lines.append("")
        lines.append(keep_tail(text(v, "path") or "?", width))
        lines += wrapped("verdict: ", clean(_verdict_text(v)), width)
        if text(v, "reason"):
            lines += wrapped("why: ", clean(text(v, "reason")), width)
        if text(v, "collision_id"):
            lines += wrapped("written by collision: ", clean(text(v, "collision_id")), width)
        old = v.get("supersedes")
        if old:
            lines += wrapped("supersedes: ", clean(_verdict_text(old)) + " (a later save "
                             "of this path was verified whole)", width)
    return "\n".join(line if len(line) <= width else keep_head(line, width) for line in lines)


def _finding_who(f: dict) -> str:
    names = []
    for w in (f.get("writers") or [])[:8]:
        rank, pid = w.get("rank"), w.get("pid")
        names.append(f"rank{rank} (pid {pid})" if rank is not None else f"pid {pid}")
    return ", ".join(names)


def render_findings(findings: list, width: int = 80) -> str:
    """One block per size fluctuation or torn read: the path, what was seen, by whom."""
    shown, more = _newest(findings, TABLE_ITEMS, "findings", width)
    lines = list(more)
    for f in shown:
        if lines:
            lines.append("")
        lines.append(keep_tail(text(f, "path") or "?", width))
        when = _when(number(f, "wall"))
        if f.get("type") == "size_fluctuation":
            before, after = integer(f, "size_before"), integer(f, "size_after")
            what = (f"size fluctuation {when}: {text(f, 'rule') or 'shrank while written'}, "
                    f"{human_bytes(before)} then {human_bytes(after)}")
        else:
            reader = f.get("reader") or {}
            what = (f"torn read {when}: read by pid {reader.get('pid', '?')} while it was "
                    "being written")
        lines += wrapped("", clean(what), width)
        who = _finding_who(f)
        if who:
            lines += wrapped("writers: ", clean(who), width)
        if text(f, "job"):
            lines += wrapped("job: ", clean(text(f, "job")), width)
    return "\n".join(line if len(line) <= width else keep_head(line, width) for line in lines)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def summary_line(summary: JournalSummary, journal: str, width: int = 80) -> str:
    """The closing line: what was found in how many writes, and where from (the journal path
    moves to a second line when both do not fit the width)."""
    counts = summary.counts
    n = counts["collisions"] or len(summary.collisions)
    if n:
        paths = len({c.path for c in summary.collisions})
        parts = [f"{_plural(n, 'collision')} on {_plural(paths, 'path')}"]
    else:
        parts = ["no collisions"]
    unusable = len(summary.unusable)
    for count, word in ((counts["hazards"], "hazard"),
                        (unusable, "unusable checkpoint"),
                        (len(summary.verdicts_by_path) - unusable, "other verdict"),
                        (counts["size_fluctuations"], "size fluctuation"),
                        (counts["torn_reads"], "torn read")):
        if count:
            parts.append(_plural(count, word))
    text_ = ", ".join(parts) + f" in {summary.writes} writes recorded in "
    notes = []
    if summary.malformed:
        notes.append(f"{summary.malformed} unreadable lines skipped")
    tail = f" ({'; '.join(notes)})" if notes else ""
    line = text_ + clean(journal) + tail
    if len(line) <= width:
        return line
    # The journal path is what a person copies next: give it a line of its own.
    return "\n".join(wrapped("", text_.rstrip(), width)).lstrip() + "\n  " + \
        keep_tail(journal + tail, width - 2)


def render_text(summary: JournalSummary, journal: str, width: int = 80, quiet: bool = False,
                paint: Painter | None = None) -> str:
    """The whole table report: collisions, hazards, verdicts, findings, the closing line
    (left out under -q; coloured when `paint` is enabled: a terminal without NO_COLOR)."""
    sections = []
    if summary.collisions:
        shown, more = _newest(summary.collisions, TABLE_ITEMS, "collisions", width)
        table = render_table(shown, width, verdicts=summary.verdicts)
        sections.append("\n".join(more + [table]))
    for title, render, items in (("hazards", render_hazards, summary.hazards),
                                 ("verification verdicts", render_verdicts, summary.verdicts),
                                 ("size fluctuations and torn reads", render_findings,
                                  summary.findings)):
        if items:
            sections.append(f"== {title} ==\n" + render(items, width))
    if not quiet:
        closing = summary_line(summary, journal, width)
        if paint is not None and paint.enabled:
            closing = paint(closing, "bad" if summary.unsafe else "good")
        sections.append(closing)
    return "\n\n".join(sections) + "\n" if sections else ""


# ---------------------------------------------------------------------------- command

def report_journal_path() -> str:
    """The journal `report` reads by default: this user's agent default, else the system one."""
    mine = default_journal_path()
    for candidate in (mine, SYSTEM_JOURNAL_PATH):
        if os.path.exists(candidate):
            return candidate
    return mine


def add_arguments(parser) -> None:
    """Add `ckptwatch report` options to an argparse parser."""
    parser.add_argument("--journal", metavar="PATH", default=None, action="append",
                        help="journal written by the agent (default: the agent's default, "
                             f"{default_journal_path()}); repeat it, or name a directory of "
                             "*.jsonl journals, to merge several nodes' journals into one "
                             "report per job")
    parser.add_argument("--format", choices=("table", "json", "html"), default="table",
                        help="table for people (80 columns), json for tools, html for an "
                             "incident review (a self-contained timeline page)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="write the report to FILE instead of standard output")


def exit_code(summary: JournalSummary) -> int:
    """1 when the report shows a collision, a hazard or an unusable checkpoint, else 0."""
    return EXIT_FOUND if summary.unsafe else EXIT_OK


def run(args, out=None, err=None) -> int:
    """Print the report. Exit 1 when it shows a collision, a hazard or a checkpoint whose
    latest verdict is corrupt or incomplete; 0 when it shows none; 2 without a readable
    journal (one line on standard error: UsageError from the checks, or a failure to read)."""
    out = out or sys.stdout
    err = err or sys.stderr
    journals = getattr(args, "journal", None) or [report_journal_path()]
    if isinstance(journals, str):
        journals = [journals]
    fmt = getattr(args, "format", "table") or "table"
    level = verbosity(args)
    try:
        paths = journal_paths(journals)
    except UsageError as exc:
        print(f"ckptwatch report: {exc}", file=err)
        return EXIT_NO_JOURNAL
    journal = paths[0] if len(paths) == 1 else f"{len(paths)} journals"
    try:
        summary = summarize(paths[0] if len(paths) == 1 else paths, details=(fmt == "html"))
    except OSError as exc:
        name = exc.filename if isinstance(exc.filename, str) else journal
        print(f"ckptwatch report: cannot read journal {clean(name)}: {exc.strerror or exc}",
              file=err)
        return EXIT_NO_JOURNAL
    if level >= VERBOSE:
        print(f"ckptwatch report: read {summary.files} file(s) of {len(paths)} journal(s): "
              + ", ".join(clean(p) for p in paths), file=err)
    code = exit_code(summary)
    output = getattr(args, "output", None)
    to_stdout = not output or output == "-"
    if fmt == "json":
        report = render_json(summary.collisions, summary.hazards, summary, code) + "\n"
    elif fmt == "html":
        from monitor.cli.timeline import render_html    # only for html: its own imports
        report = render_html(summary)
    else:
        report = render_text(summary, journal, quiet=level < NORMAL,
                             paint=Painter(out if to_stdout else None))
    if to_stdout:
        out.write(report)
        return code
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(report)
    except OSError as exc:
        print(f"ckptwatch report: cannot write {clean(output)}: {exc.strerror or exc}",
              file=err)
        return EXIT_NO_JOURNAL
    if level >= NORMAL:
        print(f"ckptwatch report: wrote {clean(output)}", file=err)
    return code
