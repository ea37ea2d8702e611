"""CKPTWATCH_POLICY=warn: tell the training process, in its own log, that a save is unsafe.

Loaded into training processes: standard library only.

What warns: notice_unsafe(site, detail), with site "file:line" (or None) and detail either a
sentence or a dict {"kind", "path", "others": [{"rank", "pid", "node", "site"}]}. Its caller
is the agent's notices: when the agent reports a collision, a redundant write or a hazard that
involves this process while its connection is open, it sends a notice back on that
connection (wire contract: ckptwatch/events.py); the emitter's sender thread reads it and
calls handle_notice(), which calls notice_unsafe(). Job scope's hazards (ckptwatch/jobscope.py:
another rank writes the same path) come back the same way: it reports them to the agent as
"hazard" events. The hook's install() wires handle_notice() in under the warn policy; this
module imports nothing of ckptwatch.

How it warns: once per call site, a CheckpointCollisionWarning (a UserWarning) attributed to
the user's own `file:line` (warnings.warn_explicit), and the same text as a WARNING on the
"ckptwatch" logger.

What a notice can do (it comes from a socket: the agent's, or whatever CKPTWATCH_SOCKET names):
print one bounded line, once per site, MAX_SITES in all. Every text from it is cut
(MAX_SHOWN) and its control characters escaped before it is printed or logged. Its `site`
is never handed to warnings or linecache as a file name, which would make Python open and read
that file on the sender's behalf (a notice naming "/dev/zero:1" made a process read /dev/zero
until it ran out of memory; a FIFO blocked its sender thread for good): the warning is
attributed to a file only when the site is one of this process's own call sites, as the hook
reported them (`own_site`, set by the hook), and that file's text is read here, bounded and
without blocking, for the warning's source line. Otherwise the warning is attributed to
"<ckptwatch>" and the site appears in the message only. The message names the path, the other ranks and the fix. Never an
exception, and never on the save path: it runs on the emitter's sender thread, so the
warning comes a little after the unsafe save, not inside it.
Without logging configured, Python prints the log line to stderr too (its last-resort
handler), so a plain script shows the text twice: once as a warning, once as a log line.
"""
from __future__ import annotations

import io
import linecache
import logging
import os
import stat
import threading
import tokenize
import warnings

from ckptwatch.advice import FIX

log = logging.getLogger("ckptwatch")

MAX_SITES = 1024              # call sites remembered; beyond, warnings stop (bounded memory)
MAX_SHOWN = 256               # characters of any one text from a notice that are printed
MAX_SOURCE_BYTES = 4 << 20    # a call site's source file read for its warning line
NOWHERE = "<ckptwatch>"       # the file a warning names when the site is not our own
# own_site(site) -> the hook's own copy of `site` if the hook reported a save from that call
# site, else None. Set by the hook under the warn policy; None: no site is trusted.
own_site = None


class CheckpointCollisionWarning(UserWarning):
    """A checkpoint save that another process writes too (or may overwrite)."""


_lock = threading.Lock()
_warned: set = set()
_counters = {"warned": 0, "repeated": 0, "errors": 0}


def stats() -> dict:
    return dict(_counters)


def handle_notice(notice: dict) -> None:
    """A decoded notice (ckptwatch.events.decode_notice) from the agent."""
    notice_unsafe(notice.get("site"), notice)


def notice_unsafe(site: str | None, detail) -> bool:
    """Warn once for this call site; True if this call warned. Never raises."""
    try:
        site = site if isinstance(site, str) else None
        key = site or "?"
        with _lock:
            if key in _warned or len(_warned) >= MAX_SITES:
                _counters["repeated"] += 1
                return False
            _warned.add(key)
        message = describe(site, detail)
        filename, lineno = _where(site)
        _counters["warned"] += 1
        log.warning("%s", message)
        # registry={}: our own once-per-site rule decides, not the caller module's registry.
        # A warnings filter set to "error" raises here; that is caught below, on this
        # background thread, never in the training loop.
        warnings.warn_explicit(message, CheckpointCollisionWarning, filename, lineno,
                               registry={})
        return True
    except Exception:
        _counters["errors"] += 1
        return False


def describe(site: str | None, detail) -> str:
    """The warning's text: where, what, who else, and the fix (every text from the notice
    cut and escaped: shown())."""
    where = shown(site) if site else "an unknown call site"
    if not isinstance(detail, dict):
        return f"unsafe checkpoint save at {where}: {shown(detail)}. Fix: {FIX}"
    kind = shown(detail.get("kind") or "collision")
    what = {"concurrent": "written by several processes at the same time (a concurrent "
                          "collision: the file can be torn or mixed)",
            "redundant": "written by several processes of this job one after another (a "
                         "redundant write: the same bug, waiting for an unlucky schedule)",
            "hazard": "at risk: another rank of this job writes the same path"}.get(
        kind, f"reported unsafe ({kind})")
    listed = detail.get("others")
    others = [_who(o) for o in listed[:MAX_SHOWN_OTHERS] if isinstance(o, dict)] \
        if isinstance(listed, list) else []
    with_whom = f"; other writers: {', '.join(others)}" if others else ""
    return (f"unsafe checkpoint save at {where}: "
            f"{shown(detail.get('path'))} is {what}{with_whom}. Fix: {FIX}")


MAX_SHOWN_OTHERS = 16


def shown(value) -> str:
    """A notice's text as it may be printed: at most MAX_SHOWN characters, every character
    that is not printable (ESC, newlines, C1 controls, bidi overrides, ...) escaped."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > MAX_SHOWN
    text = text[:MAX_SHOWN]
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                       for ch in text)
    return text + "..." if cut else text


def _who(other: dict) -> str:
    rank, pid, node, site = (other.get(k) for k in ("rank", "pid", "node", "site"))
    who = f"rank {rank}" if type(rank) is int else f"pid {pid if type(pid) is int else '?'}"
    if node:
        who += f" on {shown(node)}"
    if site:
        who += f" at {shown(site)}"
    return who


def _where(site: str | None) -> tuple[str, int]:
    """(file, line) the warning is attributed to: the site's own when the hook reported a
    save from it and its file could be read here safely, else (NOWHERE, 0) (module doc)."""
    check = own_site
    mine = check(site) if site and check is not None else None
    if isinstance(mine, str):
        filename, _, line = mine.rpartition(":")
        if filename and line.isdigit() and _load_source(filename):
            return filename, int(line)
    return NOWHERE, 0


def _load_source(filename: str) -> bool:
    """Make the warning's source line available without letting warnings/linecache open the
    file themselves: True when linecache already holds `filename`, or when it is a regular
    file of at most MAX_SOURCE_BYTES, read here without blocking and cached for linecache."""
    if filename in linecache.cache:
        return True
    if filename.startswith("<"):
        return False
    try:
        fd = os.open(filename, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
            return False
        data = os.read(fd, MAX_SOURCE_BYTES + 1)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(data) > MAX_SOURCE_BYTES:
        return False
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        lines = data.decode(encoding).splitlines(keepends=True)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return False
    linecache.cache[filename] = (len(data), st.st_mtime, lines, filename)
    return True


def _reset_for_tests() -> None:
    with _lock:
        _warned.clear()
