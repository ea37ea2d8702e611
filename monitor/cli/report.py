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
from monitor.cli.journalview import JournalSummary, summarize
from monitor.cli.textfmt import clock_time, human_bytes, keep_head, keep_tail, wrapped
from monitor.detect.model import KIND_CONCURRENT, Collision, Write

EXIT_OK = 0
EXIT_NO_JOURNAL = 2


# ---------------------------------------------------------------------------- formatting

def _duration(w: Write) -> str:
    if w.duration is None:
        return "open"
    return f"{w.duration:.2f}s" if w.duration < 100 else f"{w.duration:.0f}s"


def _site(w: Write) -> str:
    return w.site or "?"


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


def render_json(collisions: list, hazards: list = ()) -> str:
    """A JSON document {"collisions": [<journal collision record>, ...], "hazards": [<journal
    hazard record>, ...]}."""
    return json.dumps({"collisions": [c.to_record() for c in collisions],
                       "hazards": list(hazards)}, indent=2, sort_keys=False)


def render_hazards(hazards: list, width: int = 80) -> str:
    """One block per hazard: the path, what is wrong, who, the fix."""
    from exporters.logline import HAZARD_TEXT
    lines = []
    for h in hazards:
        if lines:
            lines.append("")
        lines.append(keep_tail(str(h.get("path")), width))
        kind = str(h.get("hazard"))
        head = f"hazard {kind} (shared storage: {h.get('shared')})"
        if h.get("job"):
            head += f", job {h.get('job')}"
        lines += wrapped("", clean(head), width)
        lines += wrapped("", clean(HAZARD_TEXT.get(kind, kind)), width)
        writer = (h.get("writers") or [{}])[0]
        who = f"rank{writer.get('rank')}@{writer.get('node')} (pid {writer.get('pid')})"
        if writer.get("site"):
            who += f" at {writer.get('site')}"
        lines += wrapped("reported by: ", clean(who), width)
        ranks = h.get("ranks") or []
        if ranks:
            lines += wrapped("ranks writing it: ", ", ".join(str(r) for r in ranks), width)
        lines += wrapped("fix: ", FIX, width)
    return "\n".join(line if len(line) <= width else keep_head(line, width) for line in lines)


def summary_line(summary: JournalSummary, journal: str, width: int = 80) -> str:
    """The closing line: how many collisions in how many writes, and where from (the journal
    path moves to a second line when both do not fit the width)."""
    if summary.collisions:
        paths = len({c.path for c in summary.collisions})
        n = len(summary.collisions)
        text = (f"{n} collision{'s' if n != 1 else ''} on {paths} "
                f"path{'s' if paths != 1 else ''} in {summary.writes} writes recorded in ")
    else:
        text = f"no collisions in {summary.writes} writes recorded in "
    tail = f" ({summary.malformed} unreadable lines skipped)" if summary.malformed else ""
    line = text + clean(journal) + tail
    if len(line) <= width:
        return line
    # The journal path is what a person copies next: give it a line of its own.
    return text.rstrip() + "\n  " + keep_tail(journal + tail, width - 2)


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


def run(args, out=None, err=None) -> int:
    """Print the report; 0 when produced (collisions or not), 2 without a readable journal."""
    out = out or sys.stdout
    err = err or sys.stderr
    journals = getattr(args, "journal", None) or [report_journal_path()]
    if isinstance(journals, str):
        journals = [journals]
    fmt = getattr(args, "format", "table") or "table"
    paths = []
    for journal in journals:
        if os.path.isdir(journal):
            found = sorted(os.path.join(journal, name) for name in os.listdir(journal)
                           if name.endswith(".jsonl"))
            if not found:
                print(f"ckptwatch report: no *.jsonl journal in directory {journal}", file=err)
                return EXIT_NO_JOURNAL
            paths += found
            continue
        if not os.path.exists(journal) and not any(
                os.path.exists(f"{journal}.{i}") for i in range(1, 4)):
            print(f"ckptwatch report: no journal at {journal} (is the agent running with "
                  f"--journal.path? pass --journal PATH)", file=err)
            return EXIT_NO_JOURNAL
        paths.append(journal)
    journal = paths[0] if len(paths) == 1 else f"{len(paths)} journals"
    try:
        summary = summarize(paths[0] if len(paths) == 1 else paths, details=(fmt == "html"))
    except OSError as exc:
        print(f"ckptwatch report: cannot read journal {journal}: {exc.strerror or exc}",
              file=err)
        return EXIT_NO_JOURNAL
    if fmt == "json":
        text = render_json(summary.collisions, summary.hazards) + "\n"
    elif fmt == "html":
        from monitor.cli.timeline import render_html    # only for html: its own imports
        text = render_html(summary)
    else:
        text = (render_table(summary.collisions, verdicts=summary.verdicts) + "\n\n"
                if summary.collisions else "") \
            + (render_hazards(summary.hazards) + "\n\n" if summary.hazards else "") \
            + summary_line(summary, journal) + "\n"
    output = getattr(args, "output", None)
    if not output or output == "-":
        out.write(text)
        return EXIT_OK
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        print(f"ckptwatch report: cannot write {output}: {exc.strerror or exc}", file=err)
        return EXIT_NO_JOURNAL
    print(f"ckptwatch report: wrote {output}", file=err)
    return EXIT_OK
