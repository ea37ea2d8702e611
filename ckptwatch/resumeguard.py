"""The resume guard: before a checkpoint is loaded, say what the agent knows about the file.

Loaded into training processes: standard library only, and torch / safetensors only once the
process has imported them itself.

install() wraps `torch.load` (and torch.serialization.load), and, when imported,
`safetensors.torch.load_file`, `safetensors.safe_open` and `torch.distributed.checkpoint.load`
(ckptwatch.hook calls it at its own install(), which under `ckptwatch run` is when torch is
imported; safetensors and torch.distributed.checkpoint imported later are wrapped as soon as
their import completes, through the post-import watch, ckptwatch/postimport.py).
A load nested in a guarded one (safetensors' load_file opens the file with safe_open) is not
judged again: the outer load was. The wrapper passes the untouched arguments to the original and returns its
value; before it calls the original, it learns what is known about the file (judge()):

1. The verdict stored with the file: the extended attribute user.ckptwatch.verdict that the
   agent sets after it verified a file (monitor/agent/verdictbook.py). One getxattr, no agent
   needed: it survives agent restarts and reaches a job on another node of a shared
   filesystem that keeps user xattrs (docs/policies.md says which do). Used only when the
   identity it names (ckptwatch.verdicts: inode, size, mtime_ns) is the file's now.
2. Otherwise a query to the node's agent on a connection of its own (never the emitter's: a
   load must not wait behind a save's frames, and the emitter's sender thread owns that one's
   reads): one "query" frame, and its "verdict" answer. This is what knows the live state: a
   save of the path still running, a collision not verified yet. The connect never waits (a
   Unix socket connect completes at once or fails). The answer is read within WAIT
   (CKPTWATCH_LOAD_WAIT_MS, default 5 ms, counted from before the connect) -- under strict
   before the load runs; otherwise after it, so the load's own time covers the agent's (a
   large checkpoint takes seconds) and the line still comes before the load returns: the
   answer is then taken if it came within WAIT or during the load. No answer: unknown.

Whatever the agent or a file's tag says is untrusted: ckptwatch.verdicts.decode bounds and
validates it, the answer must carry our query's id, at most MAX_READ bytes are read, and every
text is escaped before it is printed. Nothing in an answer is opened or followed.

What is done with it (CKPTWATCH_POLICY, read at install):
- by default, and under observe / warn / atomic: a file that is corrupt, written by a
  collision, or still being written gets ONE line on the "ckptwatch" logger (WARNING) before
  the load returns (or raises; before it runs when the stored verdict says so): which file, what was found, which collision wrote it, what to do (the last
  checkpoint of that directory verified ok, when the agent knows one). Without logging
  configured Python prints it on stderr. Once per file version and finding. The load then runs
  exactly as without ckptwatch: its result, its exceptions, its arguments are untouched.
- `strict` (may be combined: `strict,warn`): a load of a file in ckptwatch.verdicts.REFUSED
  raises CheckpointRefused with that same text instead, before the original is called; the
  file is not read. A verified-ok file written by a collision is only reported.
A verified-ok file, an unknown file, anything that is not a path (BytesIO, a buffer) and any
failure of our own (counted in stats()["errors"]) load silently.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import select
import socket
import sys
import threading
import time

from ckptwatch import events
from ckptwatch import paths
from ckptwatch import verdicts
from ckptwatch.verdicts import FileVerdict

log = logging.getLogger("ckptwatch")

MARKER = "__ckptwatch_original__"
WAIT_ENV = "CKPTWATCH_LOAD_WAIT_MS"
DEFAULT_WAIT = 0.005          # seconds a load waits for the agent's answer, at most
MAX_WAIT = 10.0               # whatever CKPTWATCH_LOAD_WAIT_MS says
MAX_READ = 16 * 1024          # bytes read from the agent for one answer
MAX_SAID = 1024               # file versions remembered as reported (once per version)
QUERY_TYPE, ANSWER_TYPE = "query", "verdict"
_NONBLOCKING = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
# (module, attribute, kind): what install() wraps when the module is imported.
TARGETS = (("torch", "load", "torch"), ("torch.serialization", "load", "torch"),
           ("safetensors.torch", "load_file", "safetensors"),
           ("safetensors", "safe_open", "safetensors"),
           ("torch.distributed.checkpoint", "load", "dcp"),
           ("torch.distributed.checkpoint.state_dict_loader", "load", "dcp"))
# Modules whose import, when it comes after install(), wraps what TARGETS names in them.
WATCHED = ("safetensors", "safetensors.torch", "torch.distributed.checkpoint")


class CheckpointRefused(RuntimeError):
    """CKPTWATCH_POLICY=strict: the checkpoint being loaded is corrupt, was written by a
    collision and is not verified whole, or is still being written."""

    def __init__(self, message: str, path: str, verdict: FileVerdict):
        super().__init__(message)
        self.path = path
        self.verdict = verdict


_active = False
_strict = False
_wait = DEFAULT_WAIT
_lock = threading.Lock()
_local = threading.local()
_wrappers: list = []
_said: dict = {}
_qids = itertools.count(1)
_counters = {"checked": 0, "from_xattr": 0, "answered": 0, "no_answer": 0, "reported": 0,
             "refused": 0, "errors": 0}


def stats() -> dict:
    return dict(_counters)


def wait_from_env(environ=None) -> float:
    env = os.environ if environ is None else environ
    try:
        ms = float(env[WAIT_ENV])
    except (KeyError, ValueError):
        return DEFAULT_WAIT
    return min(ms / 1000.0, MAX_WAIT) if ms >= 0 else DEFAULT_WAIT


# ---- install / uninstall ---------------------------------------------------------------------

def install(strict: bool = False, wait: float | None = None) -> bool:
    """Wrap every load in TARGETS whose module is imported now (idempotent); True if this
    call wrapped something."""
    global _active, _strict, _wait
    with _lock:
        _strict = strict
        _wait = wait_from_env() if wait is None else wait
        _active = True
        patched = _wrap_imported()
    try:
        from ckptwatch import postimport as imports
        imports.watch(dict.fromkeys(WATCHED, _on_import))
    except Exception:
        _counters["errors"] += 1
    return patched


def _on_import() -> None:
    """A module of WATCHED finished importing after install(): wrap its loads."""
    with _lock:
        if _active:
            _wrap_imported()


def _wrap_imported() -> bool:
    """Wrap every load in TARGETS whose module is imported now (holding _lock)."""
    patched = False
    for module_name, attr, kind in TARGETS:
        module = sys.modules.get(module_name)
        current = getattr(module, attr, None) if module is not None else None
        if current is None or _is_ours(current):
            continue
        try:
            setattr(module, attr, _wrapper_for(current, kind))
            patched = True
        except (AttributeError, TypeError):
            pass
    return patched


def uninstall() -> bool:
    global _active
    if "ckptwatch.postimport" in sys.modules:
        sys.modules["ckptwatch.postimport"].unwatch([_on_import])
    with _lock:
        _active = False
        restored = False
        for module_name, attr, _kind in TARGETS:
            module = sys.modules.get(module_name)
            current = getattr(module, attr, None) if module is not None else None
            if current is not None and _is_ours(current):
                setattr(module, attr, getattr(current, MARKER))
                restored = True
        return restored


def _is_ours(func) -> bool:
    return any(func is w for w in _wrappers)


def _wrapper_for(original, kind: str):
    for wrapper in _wrappers:
        if getattr(wrapper, MARKER) is original:
            return wrapper

    @functools.wraps(original)
    def load(*args, **kwargs):
        if not _active or getattr(_local, "busy", False):
            return original(*args, **kwargs)
        # Our own work, and a load nested in this one, are not judged again.
        _local.busy = True
        try:
            pending = _before(kind, args, kwargs)   # strict: may raise CheckpointRefused
            if pending is None:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                _after(pending)     # the line comes before the load returns (or raises)
        finally:
            _local.busy = False

    setattr(load, MARKER, original)
    _wrappers.append(load)
    return load


def _before(kind: str, args, kwargs) -> "Pending | None":
    """Before the original load: judge its file. What is known now (a stored verdict, no
    agent) is said now; strict waits for the agent's answer too, and raises CheckpointRefused
    for a refused file. Otherwise the agent's answer is read after the load (the Pending):
    the load's own time covers the agent's, and the line still comes before the load
    returns. Our own failures are counted, never raised."""
    try:
        path = _target(kind, args, kwargs)
        if path is None:
            return None
        pending = begin(path)
        if not (_strict or pending.done):
            return pending
        verdict = pending.finish()
    except Exception:
        _counters["errors"] += 1
        return None
    _say(path, verdict)
    return None


def _after(pending: "Pending") -> None:
    try:
        verdict = pending.finish(not_before=time.monotonic())
        _say(pending.path, verdict)
    except Exception:
        _counters["errors"] += 1


def _say(path: str, verdict: FileVerdict) -> None:
    """Report (or, strict, refuse) a load of `path`. Raises CheckpointRefused only."""
    if not verdict.worth_saying:
        return
    try:
        message = "ckptwatch: " + verdicts.describe(path, verdict)
    except Exception:
        _counters["errors"] += 1
        return
    if _strict and verdict.refused:
        _counters["refused"] += 1
        raise CheckpointRefused(message, path, verdict)
    try:
        key = (path, verdict.identity, verdict.state, verdict.collision)
        with _lock:
            if key in _said:
                return
            if len(_said) >= MAX_SAID:
                _said.pop(next(iter(_said)))
            _said[key] = True
        _counters["reported"] += 1
        log.warning("%s", message)
    except Exception:
        _counters["errors"] += 1


def _as_path(value) -> str | None:
    if isinstance(value, str):
        return os.path.abspath(value) if value else None
    if isinstance(value, (bytes, os.PathLike)):
        text = os.fsdecode(os.fspath(value)) if isinstance(value, os.PathLike) \
            else os.fsdecode(value)
        return os.path.abspath(text) if isinstance(text, str) and text else None
    return None


def _target(kind: str, args, kwargs) -> str | None:
    """The path a load reads: torch.load(f) / load_file(filename) / safe_open(filename) take it
    first; DCP's load takes checkpoint_id= or a storage_reader with a `path` (a directory).
    A file object whose name is a path counts as that path."""
    if kind == "dcp":
        target = kwargs.get("checkpoint_id")
        if target is None:
            target = getattr(kwargs.get("storage_reader"), "path", None)
        return _as_path(target)
    if args:
        target = args[0]
    else:
        target = kwargs.get("f", kwargs.get("filename"))
    path = _as_path(target)
    if path is None and target is not None and hasattr(target, "fileno"):
        name = getattr(target, "name", None)
        if isinstance(name, str) and name.startswith("/"):
            path = name
    return path


# ---- what is known about a file --------------------------------------------------------------

def judge(path: str, wait: float | None = None) -> FileVerdict:
    """What is known about the file at `path` now (module doc), waiting at most `wait`
    (default: the configured bound) for the agent. Never raises; unknown when nothing is
    known or the file cannot be looked at."""
    return begin(path, wait).finish()


class Pending:
    """A judgement under way: what the file says, or a query sent to the agent whose answer
    is read by finish(). Never raises."""

    def __init__(self, path: str, wait: float):
        self.path = path
        self.started = time.monotonic()
        self.wait = wait
        self.st = None
        self.verdict: FileVerdict | None = None     # known already: done
        self.query = None                           # (socket, qid) while an answer may come

    @property
    def done(self) -> bool:
        return self.verdict is not None

    def finish(self, not_before: float | None = None) -> FileVerdict:
        """The verdict: at once when known, else the agent's answer, waited for until
        `wait` after begin() -- or, when later, until `not_before` gives it one more look."""
        if self.verdict is not None:
            return self.verdict
        answer = None
        if self.query is not None:
            sock, qid = self.query
            self.query = None
            deadline = self.started + self.wait
            if not_before is not None and not_before > deadline:
                deadline = not_before
            try:
                answer = _read_answer(sock, qid, deadline)
            except (OSError, events.EventError, ValueError):
                answer = None
            finally:
                sock.close()
        if answer is None:
            _counters["no_answer"] += 1
            self.verdict = verdicts.UNKNOWN_VERDICT
        else:
            _counters["answered"] += 1
            self.verdict = _answered(answer, self.st)
        return self.verdict


def begin(path: str, wait: float | None = None) -> Pending:
    """Start judging `path`: the verdict stored with it, else a query to the agent."""
    _counters["checked"] += 1
    pending = Pending(path, _wait if wait is None else wait)
    try:
        pending.st = st = os.stat(path)
    except OSError:
        pending.verdict = verdicts.UNKNOWN_VERDICT      # the load itself says why
        return pending
    stored = _stored_in_directory(path) if _is_dir(st) else stored_verdict(path, st)
    if stored is not None:
        _counters["from_xattr"] += 1
        pending.verdict = stored
        return pending
    pending.query = _send_query(path)
    if pending.query is None:
        _counters["no_answer"] += 1
        pending.verdict = verdicts.UNKNOWN_VERDICT
    return pending


def _answered(answer: FileVerdict, st) -> FileVerdict:
    if _is_dir(st):
        # About the directory's files (the book's worst of them): each carried its own
        # identity when it was stored; a query answer for a directory has none to compare.
        return answer if answer.state in (verdicts.WRITING, verdicts.COLLISION,
                                          verdicts.CORRUPT) else verdicts.UNKNOWN_VERDICT
    return current(answer, st)


MAX_MEMBERS = 4096            # files of a checkpoint directory looked at (a DCP load)
# Which of several files' verdicts a directory's load is told: the worst.
_RANK = {verdicts.CORRUPT: 4, verdicts.WRITING: 3, verdicts.COLLISION: 2, verdicts.OK: 1,
         verdicts.UNKNOWN: 0}


def _severity(v: FileVerdict) -> tuple:
    return (_RANK[v.state], bool(v.collision))


def _stored_in_directory(path: str) -> FileVerdict | None:
    """A checkpoint directory (DCP: shards and .metadata) is as good as its worst file: the
    verdicts stored with its files, each about its file as it is now. None when no file
    carries one; a file without one does not make the directory unknown (the agent may not
    have verified it), so a directory is never called ok this way, only reported."""
    worst = None
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_MEMBERS:
                    break
                if not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    verdict = stored_verdict(entry.path, entry.stat(follow_symlinks=False))
                except OSError:
                    continue
                if verdict is not None and (worst is None
                                            or _severity(verdict) > _severity(worst)):
                    worst = verdict
                    if verdict.state == verdicts.CORRUPT:
                        worst = dataclasses.replace(
                            verdict, reason=f"{entry.name}: {verdict.reason}"[:verdicts.MAX_TEXT])
    except OSError:
        return None
    if worst is None or not worst.worth_saying:
        return None
    return worst


def _is_dir(st) -> bool:
    return (st.st_mode & 0o170000) == 0o040000


def current(verdict: FileVerdict, st) -> FileVerdict:
    """The agent's verdict if it is about the file as it is now, else unknown. A save in
    progress is news whatever the file looks like; a collision not verified yet has no
    identity to compare (the agent forgets it at the path's next write)."""
    if verdict.state == verdicts.WRITING:
        return verdict
    if verdict.identity is None:
        return verdict if verdict.state == verdicts.COLLISION else verdicts.UNKNOWN_VERDICT
    return verdict if verdicts.same_file(verdict, st) else verdicts.UNKNOWN_VERDICT


def stored_verdict(path: str, st) -> FileVerdict | None:
    """The verdict stored with the file (its xattr) if it is about this very version of it."""
    try:
        data = os.getxattr(path, verdicts.XATTR)
    except (OSError, AttributeError):     # ENODATA, ENOTSUP, or no xattr support at all
        return None
    verdict = verdicts.decode(data)
    if verdict is None or not verdicts.same_file(verdict, st):
        return None
    return verdict


def _socket_path() -> tuple[str | None, bool]:
    explicit = os.environ.get(paths.SOCKET_ENV)
    if explicit:
        return explicit, True
    return paths.find_socket(), False


def ask_agent(path: str, wait: float, socket_path: str | None = None) -> FileVerdict | None:
    """The agent's answer about `path` within `wait` seconds (from now, connect included),
    or None: no agent, no trusted socket, no answer in time, or an answer that is not a valid
    one to this query. socket_path: this socket, used as given; else the emitter's choice
    (CKPTWATCH_SOCKET, or a trusted default socket)."""
    deadline = time.monotonic() + wait
    query = _send_query(path, socket_path)
    if query is None:
        return None
    sock, qid = query
    try:
        return _read_answer(sock, qid, deadline)
    except (OSError, events.EventError, ValueError):
        return None
    finally:
        sock.close()


def _send_query(path: str, socket_path: str | None = None):
    """(socket, qid) once the query frame is in the agent's socket; None when there is no
    agent, no trusted socket, or no room. Never waits: the connect of a Unix stream socket
    completes at once or fails (EAGAIN: the listener's backlog is full)."""
    sock_path, explicit = (socket_path, True) if socket_path else _socket_path()
    if sock_path is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(sock_path)
        if not explicit:
            from ckptwatch.emitter import _check_peer
            _check_peer(sock)
        qid = next(_qids)
        query = {"v": events.SCHEMA_VERSION, "type": QUERY_TYPE, "node": _node(),
                 "pid": os.getpid(), "path": path, "qid": qid}
        real = os.path.realpath(path)
        if real != path:
            query["alias"] = real
        frame = events.encode(query)
        if sock.send(frame, _NONBLOCKING) != len(frame):
            raise OSError("no room for the query")   # the agent is stuck: do not wait on it
    except (OSError, events.EventError, ValueError):
        sock.close()
        return None
    return sock, qid


def _read_answer(sock, qid: int, deadline: float) -> FileVerdict | None:
    """Read the answer to query `qid` until `deadline` (at least one look, even when it has
    passed already)."""
    reader = events.FrameReader(verdicts.MAX_BYTES)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    taken = 0
    while True:
        left = deadline - time.monotonic()
        if not poller.poll(max(0, math.ceil(left * 1000))):
            if time.monotonic() >= deadline:
                return None
            continue                       # woke early: the deadline decides
        try:
            data = sock.recv(4096, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            continue
        if not data:
            return None                    # the agent closed the connection
        taken += len(data)
        if taken > MAX_READ:
            return None
        for payload in reader.feed(data):  # EventError (oversized): the caller's None
            answer = _answer(payload, qid)
            if answer is not None:
                return answer


def _answer(payload: bytes, qid: int) -> FileVerdict | None:
    try:
        import json
        value = json.loads(payload.decode("utf-8"))
    except Exception:
        return None
    if type(value) is not dict or value.get("qid") != qid or type(value.get("qid")) is not int:
        return None
    return verdicts.from_dict(value, ANSWER_TYPE)


def _node() -> str:
    from ckptwatch.identity import identity
    return identity()["node"]
