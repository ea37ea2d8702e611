"""Report one write by a writer other than torch.save: the same start and end as the hook's.

begin(path, kind, skip) -> started or None, before the writer touches the file; then
finish(started, outcome) once it returned or raised. Together they do for safetensors, DCP
and fsspec what ckptwatch/hook.py does for torch.save, sharing its parts so one process's
writes are one story:

- the start frame goes into the agent's socket from the writing thread, before the first
  byte (Emitter.record), the end as soon as the write ends;
- sequence numbers come from the hook's counter: (node, pid, seq) names one write whichever
  library made it;
- job scope gets the same (identity, seq, path, code, line, wall, mono) tuple the hook hands it;
- the hook's per-thread `busy` flag is set while a write is reported, so a save nested in it
  (DCP's torch.save of each tensor into its open shard, DCP's finish creating `.metadata.tmp`,
  fsspec under DCP's fsspec writer) passes straight through: the outer write is the record.

The frames are built from a dict with events.encode(): these writers write megabytes per
call, so the hook's pre-encoded fast path (worth it for torch.save in a tight loop) is not
repeated here. The event carries `writer` (events.WRITER_KINDS).

Call site: the first frame outside ckptwatch, torch, the writer's own library and the
standard library's thread machinery. A write made on a background thread with no user frame
on its stack (DCP's async_save) takes the site its caller registered with handoff().
Never raises: every failure is counted in stats() and the write goes on unreported.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from ckptwatch import events
from ckptwatch import hook
from ckptwatch.identity import identity

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames of the thread machinery that runs a background write: never the call site.
_THREAD_FILES = tuple(os.path.join(os.path.dirname(threading.__file__), name)
                      for name in ("threading.py", "concurrent" + os.sep, "contextlib.py"))
_counters = {"reported": 0, "errors": 0}
_last_handoff = None            # (code, line) of the latest async save's caller, any thread
_skip_cache: dict = {}          # (code, skip dirs) -> bool


def stats() -> dict:
    return dict(_counters)


def busy() -> bool:
    """Is this thread inside a reported save already (ours or the hook's)?"""
    return hook.is_busy()


def library_dir(module_name: str) -> str | None:
    """The directory of an imported top-level package, with a trailing separator."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _skipped(code, skip: tuple) -> bool:
    key = (code, skip)
    known = _skip_cache.get(key)
    if known is None:
        name = code.co_filename
        absolute = os.path.abspath(name)
        known = (absolute.startswith(_PACKAGE_DIR) or absolute.startswith(_THREAD_FILES)
                 or any(absolute.startswith(d) for d in skip))
        if len(_skip_cache) < 4096:
            _skip_cache[key] = known
    return known


def caller(skip: tuple, depth: int = 2):
    """(code, line) of the first frame outside our machinery and the `skip` directories."""
    frame = sys._getframe(depth)
    while frame is not None:
        if not _skipped(frame.f_code, skip):
            return frame.f_code, frame.f_lineno
        frame = frame.f_back
    return None, None


def handoff(skip: tuple) -> None:
    """Remember this thread's call site for writes background threads will make for it (DCP's
    worker threads, async_save's executor). The latest one wins: a process's DCP saves go
    one at a time. A thread with no user frame of its own hands nothing on."""
    global _last_handoff
    try:
        site = caller(skip, depth=3)
        if site[0] is not None:
            _last_handoff = site
    except Exception:
        _counters["errors"] += 1


def _event(kind: str, ident: dict, seq: int, path: str, code, line, wall, mono) -> dict:
    event = {"v": events.SCHEMA_VERSION, "type": kind}
    event.update(ident)
    event.update({"seq": seq, "path": path,
                  "site": f"{code.co_filename}:{line}" if code is not None else None,
                  "func": code.co_name if code is not None else None,
                  "wall": wall, "mono": mono})
    return event


class Started:
    """A reported write in progress (begin() to finish())."""

    __slots__ = ("pending", "kind", "was_busy", "start")

    def __init__(self, pending, kind, was_busy, start):
        self.pending, self.kind, self.was_busy, self.start = pending, kind, was_busy, start


def begin(path: str, kind: str, skip: tuple = ()) -> Started | None:
    """Report the start of a write of `path` (absolute) by writer `kind`, and mark this thread
    busy. None if nothing was reported (then the thread is not marked either)."""
    try:
        code, line = caller(skip)
        if code is None and _last_handoff is not None:
            code, line = _last_handoff
        pending = (identity(), next(hook._seq), path, code, line, time.time(), time.monotonic())
        start = _event("start", pending[0], pending[1], path, code, line, pending[5],
                       pending[6])
        start["writer"] = kind
        if hook._start_extra:
            start["notices"] = True         # the warn policy: see hook.want_notices
        # Known as ours before the start goes out: the agent's notice about this write can
        # reach the sender thread (policy.handle_notice -> own_site) before record() returns.
        _remember_site(code, line)
        emitter = hook._emitter or hook._bind_emitter()
        emitter.record(events.encode(start))           # before the first byte
        if hook._jobscope is not None:
            hook._jobscope.started(pending, kind)
        _counters["reported"] += 1
    except Exception:
        _counters["errors"] += 1
        return None
    was_busy = busy()
    hook.set_busy(True)
    return Started(pending, kind, was_busy, start)


def resume(started: Started) -> None:
    """The thread leaves the reported write's call, which goes on after it returns (an open
    file written by the caller): saves it makes meanwhile are its own."""
    hook.set_busy(started.was_busy)


def finish(started: Started, outcome: str, size: int | None = -1) -> None:
    """Report the end of a write begun with begin(); size -1: the file's size now."""
    hook.set_busy(started.was_busy)
    try:
        pending = started.pending
        wall, mono = time.time(), time.monotonic()
        if size == -1:
            try:
                size = os.stat(pending[2]).st_size
            except OSError:
                size = None
        end = dict(started.start)
        end.update({"type": "end", "wall": wall, "mono": mono,
                    "start_wall": pending[5], "start_mono": pending[6], "bytes": size,
                    "outcome": outcome})
        (hook._emitter or hook._bind_emitter()).record(events.encode(end))
        if hook._jobscope is not None:
            hook._jobscope.ended(pending, wall, mono, outcome, size)
    except Exception:
        _counters["errors"] += 1


# ---- the warn policy attributes a notice's warning to a call site only if it is one of ours
# (ckptwatch/policy.py, own_site); the hook knows its torch.save sites, this knows the rest.

_sites: dict = {}
_MAX_SITES = 1024


def _remember_site(code, line) -> None:
    if code is not None and len(_sites) < _MAX_SITES:
        text = f"{code.co_filename}:{line}"
        _sites.setdefault(text, text)


def own_site(site: str) -> str | None:
    """Our own copy of `site` if a write of these writers was reported from it, else None."""
    return _sites.get(site) if isinstance(site, str) else None
