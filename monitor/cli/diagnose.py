"""`ckptwatch diagnose [LOG|-]`: from the traceback a failed resume leaves to the writes behind
it. Offline: it reads the log and the agent's journals, nothing else, and sends nothing.

The log names the failure (monitor/cli/tracebacks.py: the frameworks' own messages) and,
usually, the file; the journals (`--journal`, several nodes' merged as `ckptwatch report`
does) say who wrote that file, which rank started first and finished last, what the agent
found in it, and the fix. Exit 1 when a write collision on that file is on record, 0 when
none is (or no failure was recognised), 2 on a usage error or an unreadable input.

The log is input from anywhere (a job's output, a pasted traceback): a regular file or
standard input only (a FIFO or a device is refused, not waited on), at most MAX_LOG_BYTES of
it (its end: where the failure is), lines cut to tracebacks.MAX_LINE, and every value printed
with its control characters escaped.
"""
from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

from ckptwatch.advice import NO_RECORD_FIX, OWNER_FIX, RESUME_FIX, STAGING_FIX
from exporters.journal import journal_files
from exporters.logline import clean
from monitor.cli import tracebacks
from monitor.cli.advice import suggest_fix
from monitor.cli.journalview import PathHistory, path_history
from monitor.cli.journalfiles import check_journal_file
from monitor.cli.report import render_collision, report_journal_path
from monitor.cli.style import VERBOSE, UsageError, verbosity
from monitor.cli.textfmt import clock_time, keep_head, keep_tail, wrapped
from monitor.detect.model import KIND_CONCURRENT

EXIT_CLEAN, EXIT_COLLISION, EXIT_USAGE = 0, 1, 2
MAX_LOG_BYTES = 32 * 1024 * 1024      # the end of a longer log: the failure is at the end
WIDTH = 80


# ---------------------------------------------------------------------------- inputs

def read_log(name: str, stdin=None, limit: int = MAX_LOG_BYTES) -> tuple[str, int, int]:
    """(text, bytes read, bytes in all) of the log: its last `limit` bytes. "-" is standard
    input. Raises UsageError for what is not a readable regular file."""
    if name == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        chunks, kept, total = [], 0, 0
        while True:
            chunk = stream.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            kept += len(chunk)
            total += len(chunk)
            while kept - len(chunks[0]) >= limit:      # keep the tail only
                kept -= len(chunks.pop(0))
        data = b"".join(chunks)[-limit:]
        return data.decode("utf-8", "replace"), len(data), total
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot read {clean(name)}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{clean(name)} is not a regular file; give a log file, or - "
                             "for standard input")
        start = max(0, st.st_size - limit)
        os.lseek(fd, start, os.SEEK_SET)
        parts, got = [], 0
        while got < limit:
            chunk = os.read(fd, min(1 << 20, limit - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise UsageError(f"cannot read {clean(name)}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(parts)
    if start and b"\n" in data:
        data = data[data.index(b"\n") + 1:]           # a cut first line would mislead
    return data.decode("utf-8", "replace"), len(data), st.st_size


def journal_list(names: list[str] | None) -> list[str]:
    """The journal files to read: each name a journal (its rotated files are read with it) or
    a directory of *.jsonl journals. None: the agent's default journal, if there is one."""
    if not names:
        default = report_journal_path()
        return [default] if journal_files(default) else []
    out = []
    for name in names:
        if os.path.isdir(name):
            try:
                found = sorted(os.path.join(name, n) for n in os.listdir(name)
                               if n.endswith(".jsonl"))
            except OSError as exc:
                raise UsageError(f"cannot list {clean(name)}: {exc.strerror or exc}") from None
            found = [f for f in found if _regular(f)]
            if not found:
                raise UsageError(f"no *.jsonl journal in directory {clean(name)}")
            out += found
            continue
        files = journal_files(name)
        if not files:
            raise UsageError(f"no journal at {clean(name)} (pass the agent's --journal.path)")
        for f in files:
            if not _regular(f):
                raise UsageError(f"{clean(f)} is not a regular file")
        check_journal_file(files[-1])       # /etc/passwd is no journal: say so, not "none"
        out.append(name)
    return out


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------------- the verdict

def latest_collision(history: PathHistory):
    """The collision most likely behind the failure: the latest concurrent one, else the
    latest of any kind."""
    concurrent = [c for c in history.collisions if c.kind == KIND_CONCURRENT]
    pool = concurrent or history.collisions
    return pool[-1] if pool else None


def fix_for(diagnosis, collision) -> list[str]:
    fixes = []
    if collision is not None:
        fixes.append(suggest_fix(collision))
    elif diagnosis.failure is not None and diagnosis.failure.cls.name == "staging_dir_missing":
        fixes.append(STAGING_FIX)
    elif diagnosis.failure is not None and diagnosis.failure.cls.name == "permission_denied":
        fixes.append(OWNER_FIX)
    elif diagnosis.failure is not None:
        fixes.append(NO_RECORD_FIX)
    if diagnosis.failure is not None and diagnosis.failure.cls.collision_signature \
            and diagnosis.failure.cls.name != "staging_dir_missing":
        fixes.append(RESUME_FIX)
    return fixes


def build(diagnosis, file: str | None, journals: list[str], history: PathHistory | None,
          log_name: str, read: int, total: int) -> dict:
    """The whole answer as one JSON-able dict (also what the table is printed from)."""
    collision = latest_collision(history) if history is not None else None
    failure = diagnosis.failure
    verdicts = history.verdicts if history is not None else []
    return {
        "log": log_name, "log_bytes_read": read, "log_bytes": total,
        "failure": None if failure is None else {
            "class": failure.cls.name, "title": failure.cls.title,
            "meaning": failure.cls.meaning, "line": failure.line,
            "message": failure.message[:2000], "earlier_failures": failure.earlier,
            "collision_signature": failure.cls.collision_signature},
        "file": file,
        "file_named_at": None if diagnosis.file is None or diagnosis.file.path != file else {
            "line": diagnosis.file.line, "how": diagnosis.file.how,
            "text": diagnosis.file.text},
        "candidates": [m.path for m in diagnosis.candidates[:20]],
        "journals": journals,
        "journal_paths": sorted(history.paths)[:50] if history is not None else [],
        "collisions": [c.to_record() for c in (history.collisions if history else [])][-20:],
        "collision": None if collision is None else collision.to_record(),
        "writes": [w.to_record() for w in (history.writes if history else [])][-20:],
        "verification": verdicts[-1] if verdicts else None,
        "collision_behind_error": collision is not None,
        "fix": fix_for(diagnosis, collision),
    }


# ---------------------------------------------------------------------------- rendering

def _label(lines: list[str], label: str, text: str) -> None:
    """text after a label, wrapped at spaces only: a path stays whole, to be copied."""
    lines.extend(textwrap.wrap(clean(text), width=WIDTH, initial_indent=f"  {label:<11}",
                               subsequent_indent=" " * 13, break_long_words=False,
                               break_on_hyphens=False) or [f"  {label}"])


def render_table(answer: dict, history: PathHistory | None, collision) -> str:
    lines = [keep_tail(f"ckptwatch diagnose: {answer['log']}", WIDTH)]
    if answer["log_bytes_read"] < answer["log_bytes"]:
        lines.append(keep_head(f"  (read the last {answer['log_bytes_read']} of "
                               f"{answer['log_bytes']} bytes)", WIDTH))
    lines.append("")
    failure = answer["failure"]
    if failure is None:
        _label(lines, "failure", "no checkpoint load failure recognised in this log "
               "(docs/diagnose.md lists the messages ckptwatch knows)")
    else:
        _label(lines, "failure", f"{failure['title']} [{failure['class']}]")
        _label(lines, "", clean(failure["message"])[:300] + f" (log line {failure['line']})")
        _label(lines, "", failure["meaning"])
        if failure["earlier_failures"]:
            _label(lines, "", f"{failure['earlier_failures']} earlier failure line(s) in the "
                   "log; this is the last")
    if answer["file"] is None:
        _label(lines, "file", "the log names no checkpoint file: pass it with --path FILE")
    else:
        named = answer["file_named_at"]
        where = (f" (named in the {named['how']}, line {named['line']})" if named
                 else " (--path)")
        _label(lines, "file", answer["file"] + where)
        others = [c for c in answer["candidates"] if c != answer["file"]][:3]
        if others:
            _label(lines, "", "also named: " + ", ".join(others))
    if not answer["journals"]:
        _label(lines, "journal", "none given and no agent journal here: pass --journal PATH "
               "(several, or a directory of them, for several nodes)")
    else:
        shown = ", ".join(answer["journals"][:3]) + (
            f" and {len(answer['journals']) - 3} more" if len(answer["journals"]) > 3 else "")
        _label(lines, "journal", shown)
    if history is not None and answer["file"] is not None:
        lines.append("")
        if collision is not None:
            n = len(history.collisions)
            lines.extend(wrapped("", f"written by a {clean(collision.kind)} write collision"
                                 + (f" (the latest of {n} on this file)" if n > 1 else "")
                                 + ":", WIDTH))
            first = collision.first
            lines.extend(wrapped("first to start: ", f"{clean(first.writer.label)} (pid "
                                 f"{first.writer.pid}) at {clock_time(first.start_wall)}",
                                 WIDTH))
            # The report's view of it: writers, last to finish, call sites, fix, id.
            lines.extend(render_collision(collision, WIDTH))
        elif history.writes:
            last = history.writes[-1]
            lines.extend(wrapped("", f"no collision on record; {len(history.writes)} write(s) "
                                 f"of it, the last by {clean(last.writer.label)} (pid "
                                 f"{last.writer.pid}) at {clock_time(last.start_wall)}",
                                 WIDTH))
        else:
            lines.extend(wrapped("", "the journals hold no write of this file", WIDTH))
        verdict = answer["verification"]
        if verdict is not None:
            when = verdict.get("wall")
            at = f" at {clock_time(when)}" if isinstance(when, (int, float)) and \
                when > 0 else ""
            _label(lines, "verdict", f"{verdict.get('result')} ({verdict.get('cause') or '-'})"
                   f": {verdict.get('reason') or ''}{at}")
        elif history.writes or history.collisions:
            _label(lines, "verdict", "no corrupt or unverifiable verdict journaled (the agent "
                   "journals only those: it found the file whole, or did not verify it)")
    # With a collision its fix is in the report's block above; what is left is what to do
    # about the file.
    fixes = answer["fix"][1:] if collision is not None else answer["fix"]
    for i, fix in enumerate(fixes):
        _label(lines, ("then" if collision is not None else "fix") if i == 0 else "", fix)
    # Wrapped at spaces: only a word longer than the width (a long path) passes it.
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command

def add_arguments(parser) -> None:
    parser.add_argument("log", nargs="?", default=None, metavar="LOG",
                        help="the training log or traceback; - (or nothing, with input "
                             "piped in) for standard input")
    parser.add_argument("--journal", metavar="PATH", action="append", default=None,
                        help="the agent's journal; repeat it, or name a directory of *.jsonl "
                             "journals, for several nodes (default: the agent's default "
                             "journal, if there is one)")
    parser.add_argument("--path", metavar="FILE", default=None,
                        help="the checkpoint that failed to load, when the log does not name it")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="table for people (80 columns), json for tools")


def run(args, out=None, err=None, stdin=None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    name = args.log
    if name is None:
        if stdin is None and sys.stdin.isatty():
            print("ckptwatch diagnose: give the training log (or - and pipe it in), e.g. "
                  "ckptwatch diagnose train.log --journal /var/lib/ckptwatch/journal.jsonl",
                  file=err)
            return EXIT_USAGE
        name = "-"
    try:
        text, read, total = read_log(name, stdin)
        journals = journal_list(args.journal)
        diagnosis = tracebacks.diagnose_text(text)
        file = args.path or (diagnosis.file.path if diagnosis.file else None)
        history = None
        if journals and file:
            try:
                history = path_history(journals, file)
            except OSError as exc:
                raise UsageError(f"cannot read a journal: {exc.strerror or exc}") from None
    except UsageError as exc:
        print(f"ckptwatch diagnose: {exc}", file=err)
        return EXIT_USAGE
    if verbosity(args) >= VERBOSE:
        print(f"ckptwatch diagnose: read {read} of {total} bytes of "
              f"{'standard input' if name == '-' else clean(name)}; journals: "
              + (", ".join(clean(j) for j in journals) or "none"), file=err)
    answer = build(diagnosis, file, journals, history, "standard input" if name == "-"
                   else name, read, total)
    if args.format == "json":
        out.write(json.dumps(answer, indent=2) + "\n")
    else:
        out.write(render_table(answer, history, latest_collision(history)
                               if history is not None else None))
    return EXIT_COLLISION if answer["collision_behind_error"] else EXIT_CLEAN


__all__ = ["add_arguments", "run", "read_log", "journal_list", "MAX_LOG_BYTES"]
