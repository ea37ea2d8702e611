"""The torch.save patch: report every checkpoint write as a start and an end event.

Loaded into training processes: standard library only, and torch only once the process has
imported it itself.

install() replaces `torch.save` and `torch.serialization.save` (one function object, so one
wrapper) with a wrapper that carries the original in `__ckptwatch_original__`. The wrapper is
invisible to the caller: it passes the untouched arguments to the original, returns its value
and re-raises the very same exception object. Our own work sits in try/except and is counted in
stats(), never raised.

What is reported:
- str / bytes / os.PathLike targets: the absolute path (bytes decoded with os.fsdecode).
- A file object whose `name` is a string path and that has a working fileno() (a real open file):
  that path, absolutised. Only the FIRST save into a given open file object is reported;
  torch.distributed.checkpoint calls torch.save once per tensor into one open shard file, and
  that is one write, not thousands. Later saves into the same object are counted as coalesced.
  Thin wrappers without a name are followed through their `raw` attribute (DCP wraps the shard
  file in a new NoCloseWriter per tensor), so they coalesce on the underlying file.
  The user's file is never flushed; `bytes` is f.tell() after the save (the position, which
  for a file opened for writing is what has been written so far). For a path target `bytes`
  is the file's size from one os.stat on the save path, right after the save returned (see
  _finish). For a DCP shard the reported interval covers the first tensor's save only, not
  the whole shard.
- io.BytesIO and other objects without a usable name or file descriptor are not file writes and
  are not reported (counted as unreported).

Choices and limits:
- install() never imports torch, and patches now or not at all: without torch imported it
  returns False. Patching later, as soon as torch is imported, is the bootstrap's part
  (ckptwatch/bootstrap: `ckptwatch.install()` and `ckptwatch run` go through it), so this
  module never calls back into the bootstrap. Importing torch ourselves would make every
  Python process that merely imports ckptwatch pay for torch. So `import ckptwatch;
  ckptwatch.install(); import torch` works.
- A name bound before the patch keeps the original: `from torch import save` executed before
  install() (or before torch was imported under the bootstrap hook's watch) is not reported.
  Patch early — `ckptwatch run` patches right after torch finishes importing — and rely on the
  agent's filesystem watcher as the backstop.
- uninstall() restores an attribute only if it still holds our wrapper; a wrapper somebody else
  installed on top of ours is left alone, and our wrapper inside it goes quiet (it checks an
  active flag), so nothing is reported twice after a later install().
- Nested calls (our wrapper reached again inside a save on the same thread, e.g. through a
  third-party wrapper around ours, or a signal handler that saves while a save is running)
  pass straight through: the outer save is the one reported.
- CKPTWATCH_DISABLE=1 makes install() a no-op.
- CKPTWATCH_POLICY (read once, at install()): `observe` (the default) only reports; `atomic`
  also makes every save to a path a temporary file renamed into place (ckptwatch.atomic);
  `warn` also warns in the training process at the first unsafe save of each call site
  (ckptwatch.policy). `atomic,warn` does both. Under every policy install() also installs
  the resume guard (ckptwatch.resumeguard): a load of a checkpoint the agent knows to be
  corrupt gets one line in the log; `strict` makes such a load raise instead. An unknown
  value acts as observe, so a typo never breaks a job. The events are the same under every policy: an atomic save is reported
  on the user's path, from before the temporary file is made until after the rename.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time
import weakref

from ckptwatch import atomic as _atomic_mod
from ckptwatch import emitter as _emitter_mod
from ckptwatch import events
from ckptwatch import paths
from ckptwatch.events import SCHEMA_VERSION
from ckptwatch.identity import identity

MARKER = "__ckptwatch_original__"
POLICY_ENV = "CKPTWATCH_POLICY"

# The call site skips frames of this package (hook, emitter, bootstrap...): everything in it is
# our machinery. Programs that ship with the agent (monitor/cli/demo_job.py) are user code.
_PACKAGE_PREFIX = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TARGETS = (("torch", "save"), ("torch.serialization", "save"))

_active = False
_install_lock = threading.Lock()
# Threads inside a reported save (nested calls pass straight through). A set of thread ids
# rather than a threading.local: with no save running anywhere the wrapper's check is one
# truth test, and a flag on a threading.local cost ~900 instructions per read or write,
# three per save (issue 22, docs/performance.md). set.add/discard are atomic under the GIL.
_busy: set = set()
_get_ident = threading.get_ident
_seq = itertools.count(1)
_reported_files: "weakref.WeakSet" = weakref.WeakSet()
_reported_ids: set = set()        # (id, fileno) for file objects that refuse weak references
_wrappers: list = []              # every wrapper we made: the marker alone is not proof, since
                                  # functools.wraps on someone else's wrapper copies it
_torch_dir: str | None = None
_counters = {"reported": 0, "coalesced": 0, "unreported": 0, "errors": 0}
_atomic = None                    # ckptwatch.atomic.save under the atomic policy, else None


def policy(environ=None) -> str:
    """The effective policy: "observe", or the names chosen among "atomic", "strict" and
    "warn", sorted and joined by "," ("atomic,warn", "strict,warn", ...).

    CKPTWATCH_POLICY is one name or several joined by "," or "+"; unknown names are ignored
    (they act as observe), so a typo never breaks a job.
    """
    env = os.environ if environ is None else environ
    requested = env.get(POLICY_ENV, "observe").strip().lower().replace("+", ",")
    chosen = {name.strip() for name in requested.split(",")} & {"warn", "atomic", "strict"}
    return ",".join(sorted(chosen)) or "observe"


def stats() -> dict:
    """Counters: reported saves, coalesced saves, unreported (not a file) saves, errors."""
    return dict(_counters)


# ---- install / uninstall --------------------------------------------------------------------

def is_busy() -> bool:
    """Is this thread inside a reported save already (the hook's or another writer's)?"""
    return bool(_busy) and _get_ident() in _busy


def set_busy(busy: bool) -> None:
    """Mark this thread as inside a reported save (True) or not (False)."""
    if busy:
        _busy.add(_get_ident())
    else:
        _busy.discard(_get_ident())


def _forget_other_threads() -> None:
    # In a forked child only the forking thread lives on; the others' marks would only keep
    # the wrapper off its one-test fast path.
    me = _get_ident()
    keep = me in _busy
    _busy.clear()
    if keep:
        _busy.add(me)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_other_threads)


def _is_ours(func) -> bool:
    return any(func is wrapper for wrapper in _wrappers)


def _make_wrapper(original):
    @functools.wraps(original)
    def save(*args, **kwargs):
        if not _active or (_busy and _get_ident() in _busy):
            return original(*args, **kwargs)
        try:
            pending = _begin(args, kwargs)
        except Exception:
            _counters["errors"] += 1
            pending = None
        atomic = _atomic
        if pending is None:
            if atomic is not None:
                return atomic(original, args, kwargs)
            return original(*args, **kwargs)
        me = _get_ident()
        _busy.add(me)
        try:
            if atomic is None:
                result = original(*args, **kwargs)
            else:
                result = atomic(original, args, kwargs)
        except BaseException as exc:
            _busy.discard(me)
            _finish(pending, type(exc).__name__)
            raise
        _busy.discard(me)
        _finish(pending, "ok")
        return result

    setattr(save, MARKER, original)
    _wrappers.append(save)
    return save


def _wrapper_for(original):
    for wrapper in _wrappers:
        if getattr(wrapper, MARKER) is original:
            return wrapper
    return _make_wrapper(original)


def is_installed() -> bool:
    """True if torch is imported and torch.save or torch.serialization.save is our wrapper."""
    if not _active:
        return False
    for module_name, attr in _TARGETS:
        module = sys.modules.get(module_name)
        if module is not None and _is_ours(getattr(module, attr, None)):
            return True
    return False


def torch_ready() -> bool:
    """Is there something for install() to patch now: torch and torch.serialization imported,
    with a callable torch.save?"""
    torch = sys.modules.get("torch")
    return (torch is not None and "torch.serialization" in sys.modules
            and callable(getattr(torch, "save", None)))


def install() -> bool:
    """Patch torch.save now; True if this call patched something.

    False when disabled (CKPTWATCH_DISABLE), when already installed, or when torch is not
    imported yet (see torch_ready(); the bootstrap is what patches later).
    """
    global _active, _torch_dir, _atomic
    if paths.disabled() or not torch_ready():
        return False
    torch = sys.modules["torch"]
    serialization = sys.modules["torch.serialization"]
    with _install_lock:
        chosen = policy()       # read once, here, not on the save path
        if "atomic" in chosen:
            _atomic_mod.configure()
            _atomic = _atomic_mod.save
        else:
            _atomic = None
        if "warn" in chosen:
            _enable_warn()
        _torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
        patched = False
        for module, attr in ((torch, "save"), (serialization, "save")):
            current = getattr(module, attr, None)
            if current is None or _is_ours(current):
                continue
            # torch.save is torch.serialization.save: both get the same wrapper, and a
            # re-install after uninstall reuses it, so _wrappers stays small.
            wrapper = _wrapper_for(current)
            setattr(module, attr, wrapper)
            patched = True
        was_active, _active = _active, True
        _install_resume_guard("strict" in chosen)
        _start_jobscope()
        return patched or not was_active


def _enable_warn() -> None:
    # The warn policy (ckptwatch/policy.py): starts and ends say "this process reads notices",
    # and the emitter's sender thread hands each notice it reads to the policy. Imported
    # here, not at the top: ckptwatch.policy imports logging and warnings.
    from ckptwatch import policy as _policy_mod
    want_notices()
    _policy_mod.own_site = _own_site
    _emitter_mod.get_emitter().on_notice = _policy_mod.handle_notice


def _install_resume_guard(strict: bool) -> None:
    # Loads are checked under every policy (ckptwatch/resumeguard.py); strict refuses.
    try:
        from ckptwatch import resumeguard
        resumeguard.install(strict=strict)
    except Exception:
        _counters["errors"] += 1


def _own_site(site: str) -> str | None:
    """Our own text of `site` if a save was reported from that call site (cached in
    _codes), or a write by the other writers (ckptwatch/writers/record.py, loaded once one
    of their libraries is), else None: the warn policy attributes a notice's warning to a
    file only then (ckptwatch/policy.py). Runs on the sender thread: list() copies in one
    step under the GIL what the save path may add to meanwhile."""
    for code, sites in list(_codes.values()):
        if sites is not None:
            for entry in list(sites.values()):
                mine = f"{code.co_filename}:{entry[1]}"
                if mine == site:
                    return mine
    writers = sys.modules.get("ckptwatch.writers.record")
    return writers.own_site(site) if writers is not None else None


def uninstall() -> bool:
    """Restore the original where the attribute is still our wrapper. True if any was restored."""
    global _active
    with _install_lock:
        _active = False
        restored = False
        if "ckptwatch.resumeguard" in sys.modules:
            restored = sys.modules["ckptwatch.resumeguard"].uninstall()
        for module_name, attr in _TARGETS:
            module = sys.modules.get(module_name)
            current = getattr(module, attr, None) if module is not None else None
            if current is not None and _is_ours(current):
                setattr(module, attr, getattr(current, MARKER))
                restored = True
        return restored


# ---- job scope (ckptwatch/jobscope.py): started at install in a distributed job; the save
# path only appends to its queue, once at the start and once at the end of a save ------------

_jobscope = None


def _start_jobscope() -> None:
    global _jobscope
    try:
        from ckptwatch import jobscope
        _jobscope = jobscope.start_if_distributed(identity())
    except Exception:
        _counters["errors"] += 1


# ---- the save path --------------------------------------------------------------------------

def _absolute(path: str) -> str:
    # Fast path: an absolute path without "." or ".." parts, "//" or a trailing "/" is already
    # what os.path.abspath would return; abspath costs far more on the save path.
    if path[:1] == "/" and "/." not in path and "//" not in path and path[-1:] != "/":
        return path
    return os.path.abspath(path)


def _target_path(f):
    """(absolute path, file object or None); None if not a file write, False if coalesced."""
    if isinstance(f, str):
        return _absolute(f), None
    if isinstance(f, bytes):
        return _absolute(os.fsdecode(f)), None
    if isinstance(f, os.PathLike):
        return _absolute(os.fsdecode(os.fspath(f))), None
    found = _real_file(f)
    if found is None:
        return None
    fileobj, name, fileno = found
    if _already_reported(fileobj, fileno):
        _counters["coalesced"] += 1
        return False
    return _absolute(name), fileobj


def _real_file(f, depth: int = 0):
    """(file object, its path, fd) for an object backed by a real named file, else None.

    Follows a `raw` attribute through thin wrappers: torch.distributed.checkpoint wraps its
    open shard file in a fresh NoCloseWriter (no name) for every tensor it saves into it.
    """
    name = getattr(f, "name", None)
    if isinstance(name, str) and name and not name.startswith("<"):
        try:
            return f, name, f.fileno()
        except Exception:
            return None   # not backed by a real file (a zip member, a remote file object)
    inner = getattr(f, "raw", None)
    if inner is None or inner is f or depth >= 3:
        return None
    return _real_file(inner, depth + 1)


def _already_reported(f, fileno: int) -> bool:
    try:
        if f in _reported_files:
            return True
        _reported_files.add(f)
        return False
    except TypeError:
        key = (id(f), fileno)
        if key in _reported_ids:
            return True
        _reported_ids.add(key)
        return False


# ---- call sites ------------------------------------------------------------------------------
#
# A save's call site is the first frame outside torch and this package. What the save path
# needs of it is learnt once per code object and instruction offset and then looked up by
# id(code): a dict keyed by the code object itself hashes the code's constants (nested code
# objects included) on every lookup, which cost more than the rest of the lookup; f_lineno
# scans the code's line table from its start on every read. An entry holds its code object,
# so the id cannot be reused by another code while the entry exists.
#
# _codes: id(code) -> (code, sites), sites None for torch's code and ours (the walk goes on to
# the caller), else {f_lasti: site}; site = (code, line, its members as JSON text,
# {path: heads}) -- heads being the save's frames' fixed text (see _heads).

_codes: dict = {}
_MAX_CODES = 4096           # beyond, a new code is looked at afresh on each save (slower)
_MAX_SITES = 256            # instruction offsets kept per code
_MAX_PATHS = 64             # paths kept per site (a job that names a new file per save gets
                            # its heads built per save, as before any cache)
_NO_SITE = (None, None, '"site":null,"func":null', {})


def _site(frame):
    """The site entry of the first frame outside torch and ckptwatch, else _NO_SITE."""
    codes = _codes
    while frame is not None:
        code = frame.f_code
        known = codes.get(id(code))
        if known is None:
            known = _learn_code(code)
        sites = known[1]
        if sites is not None:
            site = sites.get(frame.f_lasti)
            if site is None:
                site = _learn_site(code, frame.f_lasti, frame.f_lineno, sites)
            return site
        frame = frame.f_back
    return _NO_SITE


def _learn_code(code):
    filename = code.co_filename
    torch_dir = _torch_dir or "\0"
    internal = (filename.startswith(torch_dir) or filename.startswith(_PACKAGE_PREFIX)
                or os.path.abspath(filename).startswith(_PACKAGE_PREFIX))
    known = (code, None if internal else {})
    if len(_codes) < _MAX_CODES:
        _codes[id(code)] = known
    return known


def _learn_site(code, lasti: int, line, sites: dict):
    site = (code, line, events.json_members({"site": f"{code.co_filename}:{line}",
                                             "func": code.co_name}), {})
    if len(sites) < _MAX_SITES:
        sites[lasti] = site
    return site


# ---- the frames ------------------------------------------------------------------------------
#
# The save path reports a save with two frames, each written to the agent's socket by the
# saving thread itself (Emitter.record, ckptwatch/emitter.py): the start before torch.save runs,
# so the save is on record before its first byte, and the end, which carries the start's times
# too, as soon as torch.save returns or raises. A process that dies at any point leaves its
# record in the agent's socket.
#
# Cost (issue 22, docs/performance.md): the frames are bytes formatted in one step from a
# per-(site, path) head -- the identity's, the path's and the site's members, JSON-encoded once
# (building a dict and json-encoding it per save cost more than the rest of the hook, issue 8
# item 10) -- and integers only: times are sent as exact decimal exponents of integer clocks,
# wall as microseconds ("1733389000123456e-6") and mono as nanoseconds ("12345000000001e-9"),
# which every JSON parser reads as the same float as the fixed-point text they replace, for a
# fraction of a float's formatting cost. Every number stays under 19 digits (the agent's codec
# sends longer runs to its slow parser). A start and its end carry the very same text for the
# start's times, so the agent pairs them exactly. tests/unit/test_hook.py decodes the frames
# against the event dict the wire contract describes.

_emitter = None


def _bind_emitter():
    # Bound once: the emitter singleton survives fork (it re-initialises itself in place).
    global _emitter
    _emitter = _emitter_mod.get_emitter()
    return _emitter


_ident_members = (None, "")     # (identity dict, its members as JSON text): one slot, since
                                # identity() returns the same dict until the identity changes
_json_str = events.json_str
_pack_length = events.HEADER.pack
_time_ns = time.time_ns
_monotonic_ns = time.monotonic_ns
_getframe = sys._getframe


def _heads(site, path: str, ident):
    """(identity, start head, end head): a save's frames up to their seq, as bytes, cached per
    site and path for the current identity."""
    global _ident_members
    known = _ident_members
    if known[0] is ident:
        ident_text = known[1]
    else:
        ident_text = events.json_members(ident)
        _ident_members = (ident, ident_text)
    shared = '%s,"path":%s,%s,"seq":' % (ident_text, _json_str(path), site[2])
    end_head = ('{"v":%d,"type":"end",%s' % (SCHEMA_VERSION, shared)).encode("ascii")
    if len(end_head) + _NUMBERS_SLACK > events.MAX_FRAME_BYTES:
        # A start or an "ok" end from these heads could be too large for one frame: the
        # save path checks each frame's size only for the heads of a path this long.
        raise ValueError("event too large")      # counted as an error; the save goes on
    heads = (ident, ('{"v":%d,"type":"start",%s' % (SCHEMA_VERSION, shared)).encode("ascii"),
             end_head)
    cache = site[3]
    if len(cache) >= _MAX_PATHS:
        cache.clear()
    cache[path] = heads
    return heads


_start_extra = ""       # ',"notices":true' under the warn policy (see want_notices)
_extra = b""            # the same, as bytes, for the frames


def want_notices() -> None:
    """Mark every start and end event from now on as "this process reads notices"
    (events.py): an agent may learn of a save from either (its start may be refused)."""
    global _start_extra, _extra
    _start_extra = ',"notices":true'
    _extra = _start_extra.encode("ascii")


_START = b'%s%d,"wall":%de-6,"mono":%de-9%s}'
# What _START and _END_OK add to a head, at most: their fixed text (< 100 bytes), six
# integers of at most 20 characters and the notices flag (15): a head shorter than
# MAX_FRAME_BYTES by this much makes frames that fit (_heads checks it once per head).
_NUMBERS_SLACK = 256
_END_OK = (b'%s%d,"wall":%de-6,"mono":%de-9,"start_wall":%de-6,"start_mono":%de-9,'
           b'"bytes":%d,"outcome":"ok"%s}')
_END = (b'%s%d,"wall":%de-6,"mono":%de-9,"start_wall":%de-6,"start_mono":%de-9,'
        b'"bytes":%s,"outcome":%s%s}')


def _start_frame(heads, seq: int, wall_us: int, mono_ns: int) -> bytes:
    # No size check: _heads made sure a start from these heads fits (_NUMBERS_SLACK).
    payload = _START % (heads[1], seq, wall_us, mono_ns, _extra)
    return _pack_length(len(payload)) + payload


def _end_frame(heads, seq: int, wall_us: int, mono_ns: int, start_wall_us: int,
               start_mono_ns: int, size, outcome: str) -> bytes:
    if outcome == "ok" and type(size) is int:
        # Fits, as a start does (_heads); the common case checks nothing more.
        payload = _END_OK % (heads[2], seq, wall_us, mono_ns, start_wall_us, start_mono_ns,
                             size, _extra)
        return _pack_length(len(payload)) + payload
    payload = _END % (heads[2], seq, wall_us, mono_ns, start_wall_us, start_mono_ns,
                      b"null" if size is None else b"%d" % size,
                      _json_str(outcome).encode("ascii"), _extra)
    if len(payload) > events.MAX_FRAME_BYTES:
        raise ValueError("event too large")      # counted as an error; the save goes on
    return _pack_length(len(payload)) + payload


def _pending(ident, seq, path, site, wall_us, mono_ns):
    """The save as job scope takes it: (identity, seq, path, code, line, wall, mono), times as
    floats equal to what the agent reads from the frames (int / int is correctly rounded, as
    is a JSON parser's reading of the exponent text)."""
    return (ident, seq, path, site[0], site[1], wall_us / 1000000, mono_ns / 1000000000)


def _begin(args, kwargs):
    """Report a save's start; (heads, seq, path, file object, wall us, mono ns, pending for
    job scope or None) for _finish, or None when the save is not reported.

    The save path, issue 22 (docs/performance.md): a path saved before from the same call
    site finds its heads by the argument itself -- they are cached under the absolute,
    normalised path, so a string equal to a key is that path."""
    f = args[1] if len(args) > 1 else kwargs.get("f")
    frame = _getframe(2)                     # the wrapper's caller: the call site's frame,
    known = _codes.get(id(frame.f_code))     # unless torch's or ours (then _site walks on)
    site = known[1].get(frame.f_lasti) if known is not None and known[1] is not None else None
    if site is None:
        site = _site(frame)
    ident = identity()
    heads = site[3].get(f) if type(f) is str else None
    if heads is not None and heads[0] is ident:
        path, fileobj = f, None
    else:
        if (type(f) is str and f[:1] == "/" and "/." not in f and "//" not in f
                and f[-1:] != "/"):
            path, fileobj = f, None          # _absolute's fast path, inline
        else:
            target = _target_path(f)
            if not target:
                if target is None:
                    _counters["unreported"] += 1
                return None
            path, fileobj = target
        heads = site[3].get(path)
        if heads is None or heads[0] is not ident:
            heads = _heads(site, path, ident)
    seq = next(_seq)
    wall_us, mono_ns = _time_ns() // 1000, _monotonic_ns()
    (_emitter or _bind_emitter()).record(_start_frame(heads, seq, wall_us, mono_ns))  # before
    pending = None                                                      # the first byte
    if _jobscope is not None:
        pending = _pending(ident, seq, path, site, wall_us, mono_ns)
        _jobscope.started(pending)                       # job scope: never waits
    _counters["reported"] += 1
    return heads, seq, path, fileobj, wall_us, mono_ns, pending


def _finish(started, outcome: str) -> None:
    try:
        heads, seq, path, fileobj, start_wall_us, start_mono_ns, pending = started
        wall_us, mono_ns = _time_ns() // 1000, _monotonic_ns()
        if fileobj is None:
            # If another process rewrote the file meanwhile, the size is theirs; exact
            # per-writer sizes under a collision are the filesystem watcher's job.
            try:
                size = os.stat(path).st_size
            except OSError:
                size = None
        else:
            try:
                size = fileobj.tell()
            except Exception:
                size = None
            if not isinstance(size, int):
                size = None
        (_emitter or _bind_emitter()).record(_end_frame(
            heads, seq, wall_us, mono_ns, start_wall_us, start_mono_ns, size, outcome))
        if pending is not None and _jobscope is not None:
            _jobscope.ended(pending, wall_us / 1000000, mono_ns / 1000000000, outcome,
                            size)                               # never waits
    except Exception:
        _counters["errors"] += 1
