"""The JSONL journal: one line per finished write and per collision, with size rotation.

Written by the agent's core loop (one thread), read by `ckptwatch report`. Records are built
by monitor/detect/model.py (to_record) so the writer and the reader never drift apart; each line also
gets "ts", the wall time it was written.

Modes: the journal names paths, jobs and pids of every user on the node, so its files are
created 0640 (an existing file with wider permissions is narrowed to 0640 when opened) and a
directory it creates is 0750, whatever the umask. It never holds file contents: records carry
sizes, formats and verdict causes (see monitor/verify/worker.py).

Failure policy: constructing a Journal on a path that cannot be opened raises JournalError
(an OSError) so the agent can report a configuration error at start. After that, a failing
write (disk full, permissions changed, file system gone) is never raised: losing a journal line
must not stop detection or metrics. Every lost line is counted (records_lost); the first
failure of an outage and the recovery are logged, one line each. Lines are written whole: a
write cut short by a full disk is truncated back to the last complete line.
"""
from __future__ import annotations

import errno
import glob
import json
import logging
import os
import re
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

from monitor.detect.model import FINDING_VERIFICATION, Collision, Finding, Write

try:
    import orjson
except ImportError:         # an agent dependency (pyproject.toml); without it: json, slower
    orjson = None

# One encoder for every line: json.dumps with options builds a new encoder per call, and the
# journal writes one line per finished write. default=str: one odd value (a path-like, a numpy
# scalar) must not lose the line.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
_ORJSON_OPTIONS = 0 if orjson is None else (
    orjson.OPT_APPEND_NEWLINE | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS)

log = logging.getLogger(__name__)

SYSTEM_JOURNAL_PATH = "/var/lib/ckptwatch/journal.jsonl"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_BACKUPS = 5
_BUFFER_BYTES = 64 * 1024       # buffered lines are written once they reach this size
FILE_MODE = 0o640
DIR_MODE = 0o750


class JournalError(OSError):
    """The journal file cannot be created or opened (a configuration error)."""


def default_journal_path(environ=None, euid: int | None = None) -> str:
    """/var/lib/ckptwatch/journal.jsonl for root (or when that directory is writable),
    else $XDG_STATE_HOME/ckptwatch/journal.jsonl, else ~/.local/state/ckptwatch/journal.jsonl.
    """
    env = os.environ if environ is None else environ
    uid = os.geteuid() if euid is None else euid
    system_dir = os.path.dirname(SYSTEM_JOURNAL_PATH)
    if uid == 0 or (os.path.isdir(system_dir) and os.access(system_dir, os.W_OK)):
        return SYSTEM_JOURNAL_PATH
    state = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "ckptwatch", "journal.jsonl")


def write_record(w: Write) -> dict:
    """The journal's "write" record: {"type": "write", **Write.to_record()}."""
    return {"type": "write", **w.to_record()}


def to_record(item) -> dict:
    """The journal record of a Write, a Collision, a Finding, or a dict that already has a
    "type"."""
    if isinstance(item, Write):
        return write_record(item)
    if isinstance(item, (Collision, Finding)):
        return item.to_record()
    if isinstance(item, dict) and isinstance(item.get("type"), str):
        return dict(item)
    raise TypeError(f"cannot journal {type(item).__name__}")


def encode_line(record: dict) -> bytes:
    """One journal line, by the json encoder."""
    return _ENCODER.encode(record).encode("utf-8") + b"\n"


_WRITE_PREFIX = b'{"type":"write",'


def write_line(w: Write, ts: float) -> bytes:
    """The line of a finished write: write_record(w) plus "ts". One per save, so with orjson
    installed it is encoded by orjson (~2x faster): the "type" and the writer's fields are a
    prefix encoded once per writer (_writer_prefix), followed by the write's own fields and
    "ts" encoded per write -- the same keys in the same order as write_record(w), since orjson
    writes no whitespace.

    orjson writes the same JSON values as json, spelled differently in places (5e-7 for
    5e-07, raw UTF-8 for \\u escapes). It refuses integers beyond 64 bits and lone
    surrogates (a path from the watcher): those lines take the json encoder. It would write
    NaN and Infinity as null: a write with such times (a hook may send them) takes json too.
    Types orjson would encode its own way (a dataclass as an object) raise (_ORJSON_OPTIONS).
    """
    if orjson is not None:
        prefix = _writer_prefix(w.writer)
        record = w.own_record()
        if prefix is not None and _finite(record["start_wall"], record["end_wall"],
                                          record["duration"]):
            record["ts"] = ts
            try:
                return prefix + orjson.dumps(record, option=_ORJSON_OPTIONS)[1:]
            except TypeError:       # orjson.JSONEncodeError
                pass
    record = write_record(w)
    record["ts"] = ts
    return encode_line(record)


# Writer -> the start of its write lines, up to the write's own fields: '{"type":"write",' and
# the writer's fields, encoded by orjson, and a comma; None when orjson cannot encode them.
# Keyed by id() with the Writer kept alongside (so the id is not reused while cached): hashing
# a Writer hashes its ten fields. The detector hands out one Writer per identity, and a node
# has a few dozen; a flood of identities only re-encodes prefixes (the cache is then emptied).
_PREFIXES: dict[int, tuple] = {}
_MAX_PREFIXES = 1024


def _writer_prefix(writer) -> bytes | None:
    cached = _PREFIXES.get(id(writer))
    if cached is not None and cached[0] is writer:
        return cached[1]
    try:
        fields = orjson.dumps(writer.to_record(), option=_ORJSON_OPTIONS)   # {...}\n
        prefix = _WRITE_PREFIX + fields[1:-2] + b","
    except TypeError:       # orjson.JSONEncodeError: a pid or rank beyond 64 bits, ...
        prefix = None
    if len(_PREFIXES) >= _MAX_PREFIXES:
        _PREFIXES.clear()
    _PREFIXES[id(writer)] = (writer, prefix)
    return prefix


def _finite(start: float, end: float | None, duration: float | None) -> bool:
    """Are a write record's floats (start_wall, end_wall, duration) finite? A hook may send
    NaN or Infinity (the contract's JSON allows them); x - x is 0 only for a finite x."""
    return (start - start == 0 and (end is None or end - end == 0)
            and (duration is None or duration - duration == 0))


def _last_byte(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1)
    except OSError:
        return b"\n"     # unreadable or not seekable (a device): nothing to repair


class Journal:
    """Appends JSON lines to `path`, rotating path -> path.1 -> ... path.<backups>.

    backups=0 keeps no old file: the journal is truncated when it reaches max_bytes.
    Lines are flushed to the OS on every write by default (`report` may read the file while
    the agent runs, and an agent crash must not take the last collisions with it); pass
    buffered=True to leave flushing to flush()/close().
    """

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS, buffered: bool = False,
                 wall_clock: Callable[[], float] = time.time):
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"journal max_bytes must be a positive integer, got {max_bytes!r}")
        if not isinstance(backups, int) or backups < 0:
            raise ValueError(f"journal backups must be an integer >= 0, got {backups!r}")
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.buffered = buffered
        self.errors = 0          # failed flushes, opens and rotations since construction
        self.records = 0         # lines written
        self.records_lost = 0    # lines lost to those failures, each one counted
        self.rotations = 0
        self._wall_clock = wall_clock
        self._fh = None
        self._size = 0
        self._pending: list[bytes] = []     # encoded lines waiting for flush()
        self._pending_bytes = 0
        self._failing = False               # in an outage: its first failure was logged
        self._outage_lost = 0
        try:
            os.makedirs(os.path.dirname(self.path), mode=DIR_MODE, exist_ok=True)
            self._open("a")
        except OSError as exc:
            raise JournalError(exc.errno, f"cannot open journal {self.path}: "
                                          f"{exc.strerror or exc}") from exc

    def _open(self, mode: str) -> None:
        if os.path.isdir(self.path):
            raise IsADirectoryError(21, "is a directory")
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | \
            (os.O_APPEND if mode == "a" else os.O_TRUNC)
        fd = os.open(self.path, flags, FILE_MODE)     # the umask can only narrow it
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o7137 and st.st_uid == os.geteuid():
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & FILE_MODE)
            self._fh = open(fd, mode, encoding="utf-8")
        except BaseException:
            os.close(fd)
            raise
        self._size = os.fstat(self._fh.fileno()).st_size
        if mode == "a" and self._size > 0:
            # A crash or a failed write may have left half a line: end it, so the next
            # record does not glue onto it and get skipped as malformed too.
            last = _last_byte(self.path)
            if last != b"\n":
                self._fh.write("\n")
                self._fh.flush()
                self._size += 1

    def write(self, item) -> bool:
        """Append one record; return False if it was lost (counted in `records_lost`).

        Buffered, the record waits for flush() (or for the buffer to fill) and True means
        "queued": a later failed flush counts it lost then. Raises TypeError only for an item
        that is not a Write, Collision or typed dict.
        """
        if isinstance(item, Write):
            line = write_line(item, self._wall_clock())
        else:
            record = to_record(item)
            record["ts"] = self._wall_clock()
            line = encode_line(record)
        self._pending.append(line)
        self._pending_bytes += len(line)
        if self.buffered and self._pending_bytes < _BUFFER_BYTES:
            return True
        return self._write_pending() == 0

    def flush(self) -> None:
        """Write the buffered lines; a failure is counted and logged, never raised."""
        if self._pending:
            self._write_pending()

    def _write_pending(self) -> int:
        """Write every pending line, whole lines only, rotating on the way. Returns the
        number of lines lost (counted, and logged on the first failure of an outage)."""
        lines, self._pending, self._pending_bytes = self._pending, [], 0
        done = 0
        try:
            while done < len(lines):
                if self._fh is None:
                    self._open("a")     # a previous rotation or write failed: try again
                if self._size > 0 and self._size + len(lines[done]) > self.max_bytes:
                    self._rotate()
                # As many lines as fit before the next rotation (at least one).
                end, size = done + 1, len(lines[done])
                while end < len(lines) and self._size + size + len(lines[end]) <= self.max_bytes:
                    size += len(lines[end])
                    end += 1
                done += self._write_lines(lines[done:end])
        except (OSError, ValueError) as exc:
            self._discard()
            lost = len(lines) - done - getattr(exc, "whole_lines", 0)
            self._lost(lost, exc)
            return lost
        if self._failing:
            self._failing = False
            log.info("journal %s: writing again; %d records lost while it failed",
                     self.path, self._outage_lost)
        return 0

    def _write_lines(self, lines: list[bytes]) -> int:
        """os.write the lines to the end of the file. On an error after part of the data
        went out (ENOSPC mid-write), cut the file back to the last whole line, so no torn line
        is left, and raise with the whole lines that made it counted as written."""
        data = b"".join(lines)
        fd = self._fh.fileno()
        start = os.fstat(fd).st_size     # O_APPEND writes here, whatever _size believes
        view, written = memoryview(data), 0
        try:
            while written < len(data):
                written += os.write(fd, view[written:])
        except OSError as exc:
            whole, kept = 0, 0
            for line in lines:
                if kept + len(line) > written:
                    break
                kept += len(line)
                whole += 1
            if written > kept:
                # Shrinking frees space, so this works on a full disk. If it fails too, the
                # half line stays and the next open ends it (see _open).
                os.ftruncate(fd, start + kept)
            self._size = start + kept
            self.records += whole
            exc.whole_lines = whole
            raise
        self._size = start + written
        self.records += len(lines)
        return len(lines)

    def _lost(self, n: int, exc: BaseException) -> None:
        self.errors += 1
        self.records_lost += n
        if self._failing:
            self._outage_lost += n
            return
        self._failing, self._outage_lost = True, n
        reason = getattr(exc, "strerror", None) or exc
        log.warning("journal %s: cannot write (%s); records are lost and counted in "
                    "ckptwatch_journal_records_lost_total until it recovers", self.path, reason)

    def _rotate(self) -> None:
        self._fh.close()
        self._fh = None
        if self.backups == 0:
            self._open("w")
        else:
            # Oldest first, so no rename overwrites a file that is still to be moved.
            for index in range(self.backups - 1, 0, -1):
                older = f"{self.path}.{index}"
                if os.path.exists(older):
                    os.replace(older, f"{self.path}.{index + 1}")
            os.replace(self.path, f"{self.path}.1")
            self._open("a")
        self.rotations += 1

    def _discard(self) -> None:
        # Drop the handle after an error: reopening on the next write recovers from a deleted
        # directory or a remounted file system. Lines go out with os.write, so the handle's
        # own buffer never holds any.
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Flush and close. Idempotent; a later write() reopens the file."""
        self.flush()
        self._discard()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ReadStats:
    """What read_records saw: files read, records returned, malformed lines skipped (too_long
    of them longer than MAX_LINE_BYTES, nested too deeply or not JSON), bytes read."""

    files: int = 0
    records: int = 0
    malformed: int = 0
    too_long: int = 0
    bytes: int = 0


# The longest line read: the agent's longest records are collisions, ~400 bytes per writer
# (a collision of 10,000 writers is ~4 MiB). A longer line is skipped, read in pieces of this
# size, so a file of zeros without a newline costs time in proportion to it, never memory.
MAX_LINE_BYTES = 4 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class NotAJournal(OSError):
    """A journal name that is not a regular file (a FIFO, a device, a socket, a directory):
    never read, since a read could block forever or never end."""


def journal_files(path: str) -> list[str]:
    """The rotated files (oldest first) then the current one, those that exist."""
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.(\d+)$")
    rotated = []
    for candidate in glob.glob(glob.escape(path) + ".*"):
        match = pattern.match(os.path.basename(candidate))
        if match:
            rotated.append((int(match.group(1)), candidate))
    files = [name for _, name in sorted(rotated, reverse=True)]
    if os.path.exists(path):
        files.append(path)
    return files


def open_journal(name: str):
    """A journal file, open for reading in binary. Opened without blocking (a FIFO's open
    would wait for a writer) and judged on the descriptor: anything but a regular file raises
    NotAJournal, so a name swapped for a FIFO or a link to /dev/zero is never read."""
    fd = os.open(name, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else
                    "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                    "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise NotAJournal(errno.EINVAL, f"{kind}, not a journal file", name)
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def journal_lines(fh, stats: ReadStats, end: int | None = None) -> Iterator[bytes]:
    """The lines of an open journal file (up to offset `end`), each at most MAX_LINE_BYTES;
    a longer one is skipped (counted in stats.malformed and stats.too_long)."""
    position = fh.tell()
    while end is None or position < end:
        want = MAX_LINE_BYTES + 1 if end is None else min(MAX_LINE_BYTES + 1, end - position)
        line = fh.readline(want)
        if not line:
            return
        position += len(line)
        stats.bytes += len(line)
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            stats.malformed += 1
            stats.too_long += 1
            while not line.endswith(b"\n") and (end is None or position < end):
                line = fh.readline(MAX_LINE_BYTES if end is None
                                   else min(MAX_LINE_BYTES, end - position))
                if not line:
                    return
                position += len(line)
                stats.bytes += len(line)
            continue
        yield line


def parse_line(line: bytes) -> dict | None:
    """One journal line as a record (a JSON object with a string "type"), else None. Never
    raises: not JSON, nested deeper than the parser's recursion limit, not UTF-8 (decoded
    with replacement, as the agent never writes such bytes) all give None."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        try:
            record = json.loads(line.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            return None
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    return record


def read_records(path: str, stats: ReadStats | None = None) -> Iterator[dict]:
    """Yield every record of a journal, rotated files first (oldest first).

    Lines that are not a JSON object (a partial last line while the agent writes, a corrupt
    block, a line nested too deeply or longer than MAX_LINE_BYTES) are skipped and counted in
    stats.malformed. A missing journal yields nothing; a journal that exists but cannot be
    read raises OSError (NotAJournal when it is not a regular file). Memory: one line at a
    time; time: in proportion to the bytes.
    """
    stats = stats if stats is not None else ReadStats()
    for name in journal_files(path):
        try:
            fh = open_journal(name)
        except FileNotFoundError:
            continue      # rotated away between listing and opening
        stats.files += 1
        with fh:
            for line in journal_lines(fh, stats):
                if not line.strip():
                    continue
                record = parse_line(line)
                if record is None:
                    stats.malformed += 1
                    continue
                stats.records += 1
                yield record


def read_tail(path: str, max_bytes: int, prefixes: tuple[bytes, ...],
              stats: ReadStats | None = None) -> Iterator[dict]:
    """The records of the newest `max_bytes` of a journal (its rotated files included),
    oldest first, whose line starts with one of `prefixes` (b'{"type":"collision"'...: the
    agent writes "type" first; other lines are not parsed). Reads at most max_bytes (+ one
    line's tail at the cut): what the agent reads at start, whatever the journal holds.
    A file that is not a regular file is skipped (counted in stats.malformed), never read."""
    stats = stats if stats is not None else ReadStats()
    plan, budget = [], max_bytes
    for name in reversed(journal_files(path)):
        if budget <= 0:
            break
        try:
            fh = open_journal(name)
        except FileNotFoundError:
            continue
        except NotAJournal:
            stats.malformed += 1        # a FIFO or a device among the rotated files: skipped
            continue
        size = os.fstat(fh.fileno()).st_size
        start = max(0, size - budget)
        budget -= size - start
        plan.append((fh, start, size))
    for fh, start, size in reversed(plan):
        with fh:
            stats.files += 1
            fh.seek(start)
            lines = journal_lines(fh, stats, end=size)
            if start > 0:
                next(lines, None)       # cut in the middle: the first line is a tail
            for line in lines:
                if not line.startswith(prefixes):
                    continue
                record = parse_line(line)
                if record is None:
                    stats.malformed += 1
                    continue
                stats.records += 1
                yield record


# Verdicts journaled besides the bad ones (corrupt, unverifiable, incomplete): an ok or gone
# verdict on a file whose last journaled verdict was bad (it supersedes it: `report` shows the
# file as whole again) or that a collision wrote (the alerts' text follows that verdict, and a
# restarted agent restores it from here). Paths remembered for that, newest kept.
JOURNALED_RESULTS = ("corrupt", "unverifiable", "incomplete")
MAX_REMEMBERED_PATHS = 4096


class JournalExporter:
    """The journal as an exporter (exporters.fanout.Exporter): one line per finished write,
    collision and finding; a verification only when it says something a report or a restarted
    agent needs: a bad result (JOURNALED_RESULTS), a whole file whose pickle
    torch.load(weights_only=True) refuses, a verdict on a collision's file, or one that
    supersedes a bad verdict (an "ok" line per save would double the journal). The journal
    counts every lost line itself (Journal.records_lost, read by the agent for the metrics)."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self._bad: OrderedDict[str, None] = OrderedDict()          # last journaled: bad
        self._collided: OrderedDict[str, None] = OrderedDict()     # a collision wrote it
        # Verdicts not journaled, newest per path: a job-scope collision can be published
        # after the verifier judged its file (it settles later); its verdict is journaled then.
        self._unjournaled: OrderedDict[str, Finding] = OrderedDict()

    def remember(self, path: str, bad: bool = False, collided: bool = False,
                 verdict: bool = False) -> None:
        """Note that a collision wrote `path` (collided), or that a verdict on it was
        journaled (verdict; bad: corrupt, unverifiable or incomplete). The exporter calls it
        for what it journals; the agent at start for what it reads back from the journal."""
        if collided:
            self._note(self._collided, path)
        if verdict:
            self._collided.pop(path, None)      # the collision's file has its verdict
            if bad:
                self._note(self._bad, path)
            else:
                self._bad.pop(path, None)

    @staticmethod
    def _note(paths: OrderedDict, path: str) -> None:
        paths.pop(path, None)
        paths[path] = None
        if len(paths) > MAX_REMEMBERED_PATHS:
            paths.popitem(last=False)

    def _write(self, item) -> None:
        self.journal.write(item)     # never raises; a lost line is counted by the journal

    def publish_write(self, write: Write) -> None:
        self.journal.write(write)    # one per save: straight to the journal, which never raises

    def publish_collision(self, collision: Collision) -> None:
        self._write(collision)
        self.remember(collision.path, collided=True)
        earlier = self._unjournaled.pop(collision.path, None)
        ended = max((w.end_wall or w.start_wall) for w in collision.writes)
        if earlier is not None and (earlier.wall or 0.0) >= ended:
            self.publish_finding(earlier)       # the verdict on what this collision left
        # The journal is buffered between ticks for throughput (one flush per tick instead
        # of one per write); a collision is rare and worth a flush of its own.
        self.journal.flush()

    def publish_finding(self, finding: Finding) -> None:
        if finding.kind != FINDING_VERIFICATION:
            self._write(finding)
            return
        result, path = finding.get("result"), finding.path
        bad = result in JOURNALED_RESULTS
        if bad or finding.get("pickle") == "full_unpickle" or finding.get("collision_id") \
                or path in self._bad or path in self._collided:
            self._write(finding)
            self.remember(path, bad=bad, verdict=True)
            self._unjournaled.pop(path, None)
        else:
            self._unjournaled.pop(path, None)
            self._unjournaled[path] = finding
            if len(self._unjournaled) > MAX_REMEMBERED_PATHS:
                self._unjournaled.popitem(last=False)
        if bad:
            self.journal.flush()

    def flush(self) -> None:
        self.journal.flush()

    def close(self) -> None:
        self.journal.close()
