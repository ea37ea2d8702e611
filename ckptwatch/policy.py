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
"ckptwatch" logger. The message names the path, the other ranks and the fix. Never an
exception, and never on the save path: it runs on the emitter's sender thread, so the
warning comes a little after the unsafe save, not inside it.
Without logging configured, Python prints the log line to stderr too (its last-resort
handler), so a plain script shows the text twice: once as a warning, once as a log line.
"""
from __future__ import annotations

import logging
import threading
import warnings

from ckptwatch.advice import FIX

log = logging.getLogger("ckptwatch")

MAX_SITES = 1024              # call sites remembered; beyond, warnings stop (bounded memory)


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
        key = site or "?"
        with _lock:
            if key in _warned or len(_warned) >= MAX_SITES:
                _counters["repeated"] += 1
                return False
            _warned.add(key)
        message = describe(site, detail)
        filename, lineno = _split_site(site)
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
    """The warning's text: where, what, who else, and the fix."""
    if not isinstance(detail, dict):
        return f"unsafe checkpoint save at {site or 'an unknown call site'}: {detail}. Fix: {FIX}"
    kind = detail.get("kind") or "collision"
    what = {"concurrent": "written by several processes at the same time (a concurrent "
                          "collision: the file can be torn or mixed)",
            "redundant": "written by several processes of this job one after another (a "
                         "redundant write: the same bug, waiting for an unlucky schedule)",
            "hazard": "at risk: another rank of this job writes the same path"}.get(
        kind, f"reported unsafe ({kind})")
    listed = detail.get("others")
    others = [_who(o) for o in listed if isinstance(o, dict)] if isinstance(listed, list) else []
    with_whom = f"; other writers: {', '.join(others)}" if others else ""
    return (f"unsafe checkpoint save at {site or 'an unknown call site'}: "
            f"{detail.get('path')} is {what}{with_whom}. Fix: {FIX}")


def _who(other: dict) -> str:
    rank, pid, node, site = (other.get(k) for k in ("rank", "pid", "node", "site"))
    who = f"rank {rank}" if rank is not None else f"pid {pid}"
    if node:
        who += f" on {node}"
    if site:
        who += f" at {site}"
    return who


def _split_site(site: str | None) -> tuple[str, int]:
    if site:
        filename, _, line = site.rpartition(":")
        if filename and line.isdigit():
            return filename, int(line)
    return "<unknown>", 0


def _reset_for_tests() -> None:
    with _lock:
        _warned.clear()
