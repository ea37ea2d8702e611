"""`ckptwatch report`: who wrote which checkpoint path when, and how to fix it.

Reads the agent's journal (exporters/journal.py), rebuilds the collisions (monitor/detect/model.py)
and renders them for an 80-column terminal (table) or for tools (json). The CLI wires it in
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
import textwrap
import time
from collections import deque
from dataclasses import dataclass, field

from ckptwatch.advice import (FIX, GUARD_FIX, GUARD_FIX_SITES, JOBS_FIX, LOCAL_RANK_NOTE,
                              OWN_PATH_FIX, PROCESS_FIX)
from exporters.journal import (SYSTEM_JOURNAL_PATH, ReadStats, default_journal_path,
                               read_records)
from exporters.logline import call_sites, clean
from monitor.detect.model import FINDING_HAZARD, KIND_CONCURRENT, Collision, Write

EXIT_OK = 0
EXIT_NO_JOURNAL = 2



# What `summarize` keeps of a journal for the timeline, newest kept when there is more: the
# journal is input from every user on the node (up to 6 x 64 MiB), and `report` must not take
# memory in proportion to it. What is dropped is counted and the page says so.
MAX_WRITES_KEPT = 100_000
MAX_RECORDS_KEPT = 10_000          # per list: findings, verdicts, other records
MAX_JOBS_KEPT = 1_000
# Wall times outside this range are not from a real clock (0, negative, NaN, year 5138...).
MIN_WALL, MAX_WALL = 1.0, 1e11
MAX_DURATION = 1e7                  # seconds (four months): longer is not a save

FINDING_TYPES = ("size_fluctuation", "torn_read")
BAD_VERDICTS = ("corrupt", "unverifiable")
KNOWN_TYPES = ("write", "collision", "verification") + FINDING_TYPES


@dataclass
class JournalSummary:
    """What a journal holds: its collisions (oldest first), how many writes it recorded and,
    for the timeline, the writes themselves, findings, bad verdicts and records of types this
    version does not know (each list bounded, newest kept; `dropped` counts the rest)."""

    collisions: list = field(default_factory=list)
    hazards: list = field(default_factory=list)      # hazard records, deduplicated
    writes: int = 0
    malformed: int = 0          # lines or records that could not be read
    files: int = 0
    journals: list = field(default_factory=list)
    kept_writes: dict = field(default_factory=dict)     # identity -> Write, oldest first
    findings: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    verdicts: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    others: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS_KEPT))
    jobs: set = field(default_factory=set)
    dropped: int = 0            # writes and records read but not kept (the caps above)
    first_wall: float | None = None
    last_wall: float | None = None

    def _seen_wall(self, wall) -> None:
        if not _is_wall(wall):
            return
        self.first_wall = wall if self.first_wall is None else min(self.first_wall, wall)
        self.last_wall = wall if self.last_wall is None else max(self.last_wall, wall)

    def _keep_write(self, w: Write) -> None:
        key = write_identity(w)
        if key in self.kept_writes:
            return
        self.kept_writes[key] = w
        if len(self.kept_writes) > MAX_WRITES_KEPT:
            self.kept_writes.pop(next(iter(self.kept_writes)))
            self.dropped += 1
        if w.writer.job is not None and len(self.jobs) < MAX_JOBS_KEPT:
            self.jobs.add(str(w.writer.job))
        self._seen_wall(w.start_wall)
        self._seen_wall(w.end_wall)

    def _keep(self, bounded: deque, record: dict) -> None:
        if len(bounded) == bounded.maxlen:
            self.dropped += 1
        bounded.append(record)


def write_identity(w: Write) -> tuple:
    """One save, whether read from its "write" record or from a collision's writers."""
    return (w.writer.node, w.writer.pid, w.path, w.seq, w.start_wall)


def _is_wall(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and MIN_WALL <= value <= MAX_WALL)


def _optional_int(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def checked_write(rec: dict) -> Write:
    """Write.from_record, refusing what would break arithmetic or layout downstream (a string
    for a time, NaN, a negative duration): raises ValueError."""
    w = Write.from_record(rec)
    duration = rec.get("duration")
    if not isinstance(w.path, str) or not isinstance(w.writer.node, str):
        raise ValueError("path and node must be strings")
    if not _is_wall(w.start_wall):
        raise ValueError("start_wall is not a wall time")
    if w.end_wall is not None and not _is_wall(w.end_wall):
        raise ValueError("end_wall is not a wall time")
    if duration is not None and not (isinstance(duration, (int, float))
                                     and 0 <= duration <= MAX_DURATION):
        raise ValueError("duration out of range")
    if w.end_wall is not None and not 0 <= w.end_wall - w.start_wall <= MAX_DURATION:
        raise ValueError("end_wall before start_wall")
    if not all(_optional_int(v) for v in (w.writer.pid, w.writer.rank, w.seq, w.bytes)):
        raise ValueError("pid, rank, seq and bytes must be integers")
    if w.writer.pid is None:
        raise ValueError("pid missing")
    return w


def summarize(journal_path, summary: JournalSummary | None = None, details: bool = True,
              seen: set | None = None) -> JournalSummary:
    """Read a journal (rotated files too), or a list of journals (several nodes') merged into
    one summary: a collision several agents recorded (same id) and a hazard several reported
    are kept once. details=False keeps only the collisions, hazards and counts (the table and
    JSON need no more; keeping 100,000 writes costs ~100 MB). Raises OSError if one exists but
    cannot be read."""
    if not isinstance(journal_path, str):
        summary, seen = JournalSummary(), set()
        for path in journal_path:
            summarize(path, summary, details, seen)
        summary.collisions.sort(key=lambda c: c.first.start_wall)
        return summary
    stats = ReadStats()
    summary = summary if summary is not None else JournalSummary()
    summary.journals.append(journal_path)
    if seen is None:
        seen = {(c.id, c.kind, c.scope) for c in summary.collisions if c.id}
    for record in read_records(journal_path, stats):
        kind = record.get("type")
        if kind == "write":
            if record.get("source") == "job":
                continue          # another node's write: counted in that node's journal
            summary.writes += 1
            if not details:
                continue
            try:
                summary._keep_write(checked_write(record))
            except (KeyError, TypeError, ValueError, AttributeError):
                summary.malformed += 1
        elif kind == FINDING_HAZARD:
            key = ("hazard", repr(record.get("job"))[:200], record.get("path"),
                   repr(record.get("hazard"))[:200])      # hashable whatever the journal holds
            if not isinstance(record.get("path"), str):
                summary.malformed += 1
            elif key not in seen:
                seen.add(key)
                summary.hazards.append(record)
        elif kind == "collision":
            try:
                collision = Collision.from_record(record)
                writes = tuple(checked_write(w) for w in record["writers"])
                if not writes or not isinstance(collision.path, str):
                    raise ValueError("a collision without writers")
            except (KeyError, TypeError, ValueError, AttributeError):
                summary.malformed += 1
                continue
            # The same collision journaled twice (e.g. by two exporters) is shown once.
            key = (collision.id, collision.kind, collision.scope)
            if collision.id and key in seen:
                continue
            seen.add(key)
            summary.collisions.append(collision)
            for w in writes if details else ():
                summary._keep_write(w)
        elif not details:
            continue
        elif not isinstance(record.get("path", ""), str):
            summary.malformed += 1
        elif kind in FINDING_TYPES:
            summary._keep(summary.findings, record)
        elif kind == "verification":
            if record.get("result") in BAD_VERDICTS:
                summary._keep(summary.verdicts, record)
        else:
            summary._keep(summary.others, record)
    summary.malformed += stats.malformed
    summary.files += stats.files
    return summary


def load(journal_path: str) -> list:
    """The collisions recorded in a journal, oldest first."""
    return summarize(journal_path).collisions


# ---------------------------------------------------------------------------- formatting

def human_bytes(n) -> str:
    """4096 -> 4.0KiB; None -> "-"."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"   # unreachable


def clock_time(wall: float) -> str:
    """HH:MM:SS.mmm in local time."""
    ms = int(round((wall % 1) * 1000))
    seconds = int(wall)
    if ms == 1000:
        seconds, ms = seconds + 1, 0
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{ms:03d}"


def keep_tail(text: str, width: int) -> str:
    """The text, or "..." + its tail when longer than width (the end of a path says most)."""
    text = clean(text)
    if len(text) <= width:
        return text
    if width <= 3:
        return text[-width:]
    return "..." + text[-(width - 3):]


def keep_head(text: str, width: int) -> str:
    text = clean(text)
    if len(text) <= width:
        return text
    return text[:max(0, width - 3)] + "..."[:width]


def _duration(w: Write) -> str:
    if w.duration is None:
        return "open"
    return f"{w.duration:.2f}s" if w.duration < 100 else f"{w.duration:.0f}s"


def _site(w: Write) -> str:
    return w.site or "?"


def _who(w: Write) -> str:
    return f"{clean(w.writer.label)} (pid {w.writer.pid})"


def suggest_fix(c: Collision) -> str:
    """What to change in the training code, from who wrote and from where."""
    writers = c.writers
    jobs = {w.job for w in writers}
    runs = {w.run_key for w in writers}
    if len(jobs) > 1 or (None not in runs and len(runs) > 1):
        return JOBS_FIX
    if any(w.rank is None for w in writers):
        return PROCESS_FIX
    sites = {w.site for w in c.writes}
    nodes = {w.node for w in writers}
    node_local = len(nodes) > 1 or (len(writers) > 1
                                    and all(w.local_rank == 0 for w in writers))
    guard = GUARD_FIX_SITES if len(sites) > 1 else GUARD_FIX
    if node_local:
        guard += " -- " + LOCAL_RANK_NOTE
    return f"{guard}; or {OWN_PATH_FIX}"


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


def _wrapped(label: str, text: str, width: int) -> list:
    return textwrap.wrap(text, width=width, initial_indent="  " + label,
                         subsequent_indent="  " + " " * len(label),
                         break_on_hyphens=False) or ["  " + label]


def render_collision(c: Collision, width: int = 80) -> list:
    """The lines for one collision (without the path heading)."""
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
    lines += _wrapped("", head, width)
    if c.kind != KIND_CONCURRENT:
        lines += _wrapped("", "(the same job run wrote it from several processes: not "
                          "corrupt yet, the same bug waiting to happen)", width)
    columns = _columns(width)
    lines.append(_row([title for title, _ in columns], columns))
    for w in c.writes:
        lines.append(_row([w.writer.label, str(w.writer.pid), clock_time(w.start_wall),
                           _duration(w), human_bytes(w.bytes), _site(w)], columns))
    for w in c.writes:
        if w.outcome == "lost":
            lines += _wrapped("", f"{_who(w)}: its end was never seen (the process died or "
                              "stalled); duration is up to its last sign of life", width)
        elif w.end_wall is None:
            lines += _wrapped("", f"{_who(w)}: still writing when the collision was reported "
                              "(it held the report back for collision.max-hold)", width)
        elif w.outcome not in (None, "ok"):
            lines += _wrapped("", f"{_who(w)}: the save raised {clean(w.outcome)}", width)
    last = c.last
    if c.kind == KIND_CONCURRENT:
        # Not "its bytes are on disk": every writer truncated and wrote the same file, so what
        # is on disk is usually a mix (the demo shows files that fail to load).
        lines += _wrapped("last to finish: ", f"{_who(last)}; the file on disk may mix "
                          "bytes of every writer", width)
    else:
        lines += _wrapped("last write: ", f"{_who(last)}, its bytes are on disk", width)
    sites = call_sites(c)
    if sites:
        lines += _wrapped("call site: " if len(sites) == 1 else "call sites: ",
                          ", ".join(sites), width)
    lines += _wrapped("fix: ", suggest_fix(c), width)
    if c.id:
        lines.append(keep_head(f"  id {c.id}", width))
    return lines


def render_table(collisions: list, width: int = 80) -> str:
    """Every path with collisions, its collisions oldest first; every line <= width. With
    several jobs, one section per job (headed "== job <id> =="), each path in it."""
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
            lines += render_collision(c, width)
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
        lines += _wrapped("", clean(head), width)
        lines += _wrapped("", clean(HAZARD_TEXT.get(kind, kind)), width)
        writer = (h.get("writers") or [{}])[0]
        who = f"rank{writer.get('rank')}@{writer.get('node')} (pid {writer.get('pid')})"
        if writer.get("site"):
            who += f" at {writer.get('site')}"
        lines += _wrapped("reported by: ", clean(who), width)
        ranks = h.get("ranks") or []
        if ranks:
            lines += _wrapped("ranks writing it: ", ", ".join(str(r) for r in ranks), width)
        lines += _wrapped("fix: ", FIX, width)
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
        from monitor.cli.timeline import render_html    # imports this module
        text = render_html(summary)
    else:
        text = (render_table(summary.collisions) + "\n\n" if summary.collisions else "") \
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
