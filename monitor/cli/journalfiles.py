"""The journals a user names on the command line (`report --journal`, `diagnose --journal`):
each a journal file (its rotated files read with it) or a directory of *.jsonl journals,
checked before anything is read so that a wrong one is one line and exit 2, never a report
of nothing: a path with no journal, an unreadable file or directory, a FIFO or device (never
read: /dev/zero has no end), a file that holds no journal record (/etc/passwd).
"""
from __future__ import annotations

import json
import os
import stat

from exporters.journal import journal_files
from exporters.logline import clean
from monitor.cli.style import UsageError

# How much of a journal's first file is read to tell a journal from another file.
SNIFF_BYTES = 64 * 1024


def check_journal_file(path: str) -> None:
    """Raise UsageError unless `path` (the newest of a journal's files that exist) is a
    regular file whose first lines include a journal record, or empty (an agent that has
    recorded nothing yet). A device or FIFO is refused, never read: /dev/zero has no end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot read journal {clean(path)}: {exc.strerror or exc}; run as "
                         "a user who can read it (the agent's journal is mode 0640)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{clean(path)} is not a regular file; pass the agent's journal "
                             "(its --journal.path) or a directory of *.jsonl journals")
        head = os.read(fd, SNIFF_BYTES)
    except OSError as exc:
        raise UsageError(f"cannot read journal {clean(path)}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    lines = [line for line in head.split(b"\n")[:-1 if len(head) == SNIFF_BYTES else None]
             if line.strip()]
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("type"), str):
            return
    if lines or head.strip():
        raise UsageError(f"{clean(path)} is not a ckptwatch journal (none of its first lines "
                         "is a journal record); pass the agent's --journal.path")


def journal_paths(journals: list) -> list:
    """The journal files the --journal arguments name (a directory: its *.jsonl), each
    checked; UsageError (one line, what to do) for one that is missing, unreadable or not a
    journal."""
    paths = []
    for journal in journals:
        if os.path.isdir(journal):
            try:
                names = os.listdir(journal)
            except OSError as exc:
                raise UsageError(f"cannot read directory {clean(journal)}: "
                                 f"{exc.strerror or exc}; run as a user who can read it")
            found = sorted(os.path.join(journal, name) for name in names
                           if name.endswith(".jsonl"))
            if not found:
                raise UsageError(f"no *.jsonl journal in directory {clean(journal)}; pass "
                                 "the agent's --journal.path or the directory holding it")
        else:
            found = [journal]
        for path in found:
            files = journal_files(path)
            if not files:
                raise UsageError(f"no journal at {clean(path)} (is the agent running with "
                                 "--journal.path? pass --journal PATH)")
            check_journal_file(files[-1])
        paths += found
    return paths
