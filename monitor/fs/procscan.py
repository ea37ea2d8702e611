"""Which processes hold a path open, in which mode, and which rank they are (psutil).

The filesystem watcher sees *that* a checkpoint was opened for writing, never *who* opened it:
inotify events carry no pid. This module answers "who" after the fact, by looking at the open
files of running processes, and reads each holder's rank / local rank / job from its
environment, the same variables the in-process hook reads (ckptwatch.identity).

Cost bounds (an agent may serve a node with thousands of processes):
- only *candidate* processes are scanned: Python interpreters and known launchers
  (is_candidate). Each process is classified once: before a scan, only pids that appeared
  since the last update have their name read (before every scan for a change, otherwise at
  most every `min_refresh` seconds), so a job started a moment ago is found; the whole
  list is re-checked every `refresh_interval` seconds (reused pids). When no candidate
  holds the path and `full_scan_fallback` is on, every other process is scanned once
  (counted as a full scan): that is how a C++ or shell writer is still attributed;
- a process is looked at with one readlink per descriptor, and only a matching one has
  its fdinfo read (_proc_fd_opens); candidates are walked likeliest writer first
  (_ordered): a scan finds a short save's writer only if it reaches that process before
  the save closes its file;
- per path, a result younger than `min_interval` is reused, unless the caller says the path
  changed (was opened or closed) after that scan began (`changed_after`): a change we have
  not scanned for yet always gets a fresh scan, and a scan begun after it answers for it;
- environments are read once per process (keyed by pid and start time, so a reused pid is
  not mistaken for the old process);
- processes that vanish or deny access are skipped and counted, never raised.

Limits: /proc/<pid>/environ is the environment the process was started with; variables a
process exports into itself later (Lightning's rank 0 does) are not visible here. A file
opened and closed between two scans is never attributed. The agent's own pid is excluded
(its integrity checker reads checkpoints; that is not a torn read).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import psutil

from ckptwatch import identity
from monitor.detect.model import Writer

log = logging.getLogger(__name__)

CAP_SYS_PTRACE = 19          # linux/capability.h


def has_capability(bit: int, status_path: str = "/proc/self/status") -> bool:
    """Whether this process has capability `bit` in its effective set (False if unknown)."""
    try:
        with open(status_path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False

# Process names (psutil name(), i.e. the kernel comm, at most 15 characters) and interpreter
# prefixes that make a process a candidate checkpoint writer.
CANDIDATE_NAMES = frozenset({"torchrun", "deepspeed", "accelerate", "pt_elastic", "mpirun",
                             "srun", "lightning"})
CANDIDATE_PREFIXES = ("python", "pypy", "ipython", "jupyter")

WRITE_MODES = frozenset({"w", "a", "r+", "a+", "w+"})

_O_ACCMODE = os.O_ACCMODE
# Descriptors of one process looked at per walk: a local user's process holding a million
# (RLIMIT_NOFILE allows it) would make every scan of the node take seconds. A writer whose
# checkpoint's descriptor lies past the first MAX_FDS_WALKED is not named (counted in
# stats()["fds_capped"]); a training process holds far fewer.
MAX_FDS_WALKED = 65_536
_ENV_CACHE_CAP = 4096
_WRITERS_CAP = 1024


@dataclass(frozen=True)
class Holder:
    """One process holding a path open: who it is (the Writer its environment names) and
    how it opened the path.

    `mode` is psutil's open mode: "r" (read only), "w" (write, truncated or not), "a"
    (append), "r+" (read and write). Writers are every mode but "r".
    """

    writer: Writer
    mode: str
    fd: int | None = None
    cmdline: tuple[str, ...] = ()

    @property
    def pid(self) -> int:
        return self.writer.pid

    @property
    def writing(self) -> bool:
        return self.mode in WRITE_MODES


def is_candidate(name: str, cmdline: list | tuple | None) -> bool:
    """Whether a process looks like a Python / training process worth scanning."""
    name = (name or "").lower()
    if name in CANDIDATE_NAMES or name.startswith(CANDIDATE_PREFIXES):
        return True
    if cmdline:
        exe = os.path.basename(str(cmdline[0])).lower()
        return exe in CANDIDATE_NAMES or exe.startswith(CANDIDATE_PREFIXES)
    return False


def mode_from_flags(flags: int) -> str:
    """psutil's mode string for open(2) flags (read from a descriptor's fdinfo)."""
    acc = flags & _O_ACCMODE
    if acc == os.O_RDONLY:
        return "r"
    if acc == os.O_WRONLY:
        return "a" if flags & os.O_APPEND else "w"
    return "a+" if flags & os.O_APPEND else "r+"


def _proc_fd_opens(pid: int, path: str, prefix: str | None = None, capped: list | None = None
                   ) -> list[tuple[str, int, str]]:
    """(target, fd, mode) of `pid`'s descriptors open on `path`, read from /proc directly.

    One readlink per descriptor, and the fdinfo (its `flags:` line, octal) of a matching one
    only: psutil's open_files() also stats every target and reads every regular file's
    fdinfo, ~7x the cost on a node whose processes hold many files (docs/decisions.md,
    "Naming the writer of a short save"). With `prefix`, every descriptor whose target lies
    below it instead. A link target is a stranger's string: it is only
    compared, never opened; fd names come from the kernel's own directory and are checked to
    be numbers before one is used in a path. At most MAX_FDS_WALKED descriptors are looked
    at; past them `pid` is appended to `capped`.
    """
    found: list = []
    fd_dir = f"/proc/{pid}/fd"
    with os.scandir(fd_dir) as entries:         # an iterator: never a list of them all
        for walked, entry in enumerate(entries):
            if walked >= MAX_FDS_WALKED:
                if capped is not None:
                    capped.append(pid)
                break
            name = entry.name
            if not name.isdigit():
                continue
            try:
                target = os.readlink(f"{fd_dir}/{name}")
                if target != path if prefix is None else not target.startswith(prefix):
                    continue
                with open(f"/proc/{pid}/fdinfo/{name}", encoding="ascii",
                          errors="replace") as f:
                    for line in f:
                        if line.startswith("flags:"):
                            mode = mode_from_flags(int(line.split()[1], 8))
                            found.append((target, int(name), mode))
                            break
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
                continue   # the fd was closed while we looked
    return found


class ProcScanner:
    """Finds the processes that hold a path open. Thread-safe; see the module docstring.

    node: the node name given to holders whose environment has no CKPTWATCH_NODE (the hook
    uses CKPTWATCH_NODE or the host name; the agent passes its own node name, so both sources
    name a writer the same way).
    """

    def __init__(self, node: str | None = None, refresh_interval: float = 5.0,
                 min_refresh: float = 0.05, min_interval: float = 0.05,
                 full_scan_fallback: bool = True,
                 candidate: Callable[[str, list], bool] = is_candidate,
                 exclude_pids: Iterable[int] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.node = node or socket.gethostname()
        self._refresh_interval = refresh_interval
        self._min_refresh = min_refresh
        self._min_interval = min_interval
        self._full_scan_fallback = full_scan_fallback
        self._candidate = candidate
        self._exclude = set(exclude_pids) if exclude_pids is not None else {os.getpid()}
        self._clock = clock
        self._lock = threading.Lock()
        # pid -> Process for candidates, None for processes classified as not one.
        self._known: dict[int, psutil.Process | None] = {}
        self._full_at = -float("inf")
        self._update_at = -float("inf")
        # (pid, start time) -> (Writer, cmdline), read once per process.
        self._env_cache: dict[tuple[int, float], tuple[Writer, tuple]] = {}
        self._last_by_pid: dict[int, tuple] = {}    # for describe() after the process exits
        # Scan order (_ordered): pid -> create time of processes seen writing a scanned path,
        # the latest last (at most _WRITERS_CAP), and each candidate's parent pid.
        self._writers: OrderedDict[int, float] = OrderedDict()
        self._parents: dict[int, int] = {}
        self._results: dict[str, tuple[float, list[Holder]]] = {}
        self._stats = {"scans": 0, "last_seconds": 0.0, "total_seconds": 0.0, "errors": 0,
                       "denied": 0, "vanished": 0, "cache_hits": 0, "full_scans": 0,
                       "candidates": 0, "refreshes": 0, "updates": 0, "fds_capped": 0}

    def _denied(self) -> None:
        """The kernel refused a process's /proc/<pid>/fd or environ: counted, and said once.
        Without CAP_SYS_PTRACE that is every other user's process, so no writer of a watched
        file is named; with it, only processes a security module or another user namespace
        keeps from the agent."""
        self._stats["denied"] += 1
        if self._stats["denied"] == 1 and not has_capability(CAP_SYS_PTRACE):
            log.warning("cannot read another user's open files in /proc (needs CAP_SYS_PTRACE): "
                        "writers of watched files the hook does not report stay unnamed, and "
                        "collisions among them are not detected",
                        extra={"fields": {"uid": os.geteuid()}})

    # ------------------------------------------------------------------ public API

    def holders_of(self, path: str, candidates: Iterable | None = None,
                   changed_after: float | None = None,
                   since: float | None = None) -> list[Holder]:
        """Every process holding `path` open (readers and writers), one entry per fd.

        candidates: pids or psutil.Process objects to scan instead of the cached candidate
        list (no fallback then). changed_after: monotonic time at which a change to the path
        (an open, a close) was seen; a cached result from a scan that began before it is not
        reused, one that began at or after it is, whatever its age (it saw the path as the
        change left it; a later change comes with a later time). since: the time of a
        change that needs no fresh scan of its own (a write): a result younger than
        `min_interval`, or from a scan begun at or after `since`, is reused. Reusing what a
        scan begun after an event saw is what keeps a backlog of one save's events (create,
        open, writes, close: queued behind a slow scan) from costing one walk each.
        """
        path = os.path.abspath(path)
        with self._lock:
            now = self._clock()
            if candidates is None:
                cached = self._results.get(path)
                if cached is not None and (
                        cached[0] >= changed_after if changed_after is not None else
                        now - cached[0] < self._min_interval
                        or (since is not None and cached[0] >= since)):
                    self._stats["cache_hits"] += 1
                    return list(cached[1])
            started = time.perf_counter()
            try:
                # A descriptor's /proc link names the resolved path.
                found = self._scan(os.path.realpath(path), candidates, now,
                                   changed_after is not None)
            finally:
                elapsed = time.perf_counter() - started
                self._stats["scans"] += 1
                self._stats["last_seconds"] = elapsed
                self._stats["total_seconds"] += elapsed
            if candidates is None:
                self._results[path] = (now, found)
                if len(self._results) > _ENV_CACHE_CAP:
                    self._results.pop(next(iter(self._results)))
            return list(found)

    def describe(self, pid: int, mode: str) -> Holder:
        """A Holder for a pid the caller already knows holds a file (fanotify told it):
        its identity from its environment (cached), or only the pid if it is gone or hidden."""
        with self._lock:
            proc = _process(pid)
            try:
                if proc is None:
                    raise psutil.NoSuchProcess(pid)
                return _holder(mode, None, self._identity(proc))
            except psutil.NoSuchProcess:
                self._stats["vanished"] += 1
                # Gone since its event: the identity read while it lived, if any.
                ident = self._last_by_pid.get(pid)
                if ident is not None:
                    return _holder(mode, None, ident)
            except psutil.AccessDenied:
                self._denied()
            except Exception:
                self._stats["errors"] += 1
            return Holder(Writer(self.node, pid), mode)

    def writers_of(self, path: str, candidates: Iterable | None = None,
                   changed_after: float | None = None,
                   since: float | None = None) -> list[Holder]:
        """Processes holding `path` open with a write mode (one entry per process)."""
        return _per_pid([p for p in self.holders_of(path, candidates, changed_after, since)
                         if p.writing])

    def readers_of(self, path: str, candidates: Iterable | None = None,
                   changed_after: float | None = None,
                   since: float | None = None) -> list[Holder]:
        """Processes holding `path` open read-only and not also for writing (torn reads)."""
        holders = self.holders_of(path, candidates, changed_after, since)
        writing = {p.pid for p in holders if p.writing}
        return _per_pid([p for p in holders if not p.writing and p.pid not in writing])

    def holders_under(self, root: str, match: Callable[[str], bool] | None = None
                      ) -> dict[str, list[Holder]]:
        """Every open file below directory `root` held by a candidate process, by path.

        One pass over the candidates (no full-scan fallback): what a rescan after lost
        events needs, instead of one scan per file. `match(path)` filters the paths.
        """
        prefix = os.path.realpath(root).rstrip(os.sep) + os.sep
        found: dict[str, list[Holder]] = {}
        with self._lock:
            started = time.perf_counter()
            try:
                self._update_candidates(self._clock(), full=False)
                for proc in [p for p in self._known.values() if p is not None]:
                    try:
                        opens = [(path, fd, mode) for path, fd, mode
                                 in self._opens_under(proc, prefix)
                                 if match is None or match(path)]
                        if not opens:
                            continue
                        ident = self._identity(proc)
                    except psutil.NoSuchProcess:
                        self._stats["vanished"] += 1
                        continue
                    except psutil.AccessDenied:
                        self._denied()
                        continue
                    except Exception:
                        self._stats["errors"] += 1
                        continue
                    for path, fd, mode in opens:
                        found.setdefault(path, []).append(_holder(mode, fd, ident))
            finally:
                elapsed = time.perf_counter() - started
                self._stats["scans"] += 1
                self._stats["last_seconds"] = elapsed
                self._stats["total_seconds"] += elapsed
        return found

    def stats(self) -> dict:
        """scans, last_seconds, total_seconds, errors, plus denied, vanished, cache_hits,
        full_scans, candidates, refreshes (full), updates (incremental), fds_capped (walks
        of one process stopped at MAX_FDS_WALKED descriptors)."""
        with self._lock:
            return dict(self._stats)

    # ------------------------------------------------------------------ scanning

    def _scan(self, path: str, candidates, now: float, changed: bool) -> list[Holder]:
        if candidates is not None:
            procs = [c if isinstance(c, psutil.Process) else _process(c) for c in candidates]
            return self._scan_procs(path, [p for p in procs if p is not None])
        # The full refresh (every process classified again: ~15 ms of CPU on 130 processes,
        # 60 ms at load 6) comes after the walk, not before: a short save's writer is met
        # first. A pid reused by a new writer since the last one is found by the fallback.
        full = now - self._full_at >= self._refresh_interval
        if full and not self._known:     # nothing classified yet: nothing to walk first
            self._update_candidates(now, full=True)
            full = False
        elif full or changed or now - self._update_at >= self._min_refresh:
            # A change we have not scanned for may come from a process started a moment ago.
            self._update_candidates(now, full=False)
        try:
            found = self._scan_procs(path, self._ordered(
                [p for p in self._known.values() if p is not None]))
            if found or not self._full_scan_fallback:
                return found
            return self._fallback(path)
        finally:
            if full:
                self._update_candidates(self._clock(), full=True)

    def refresh(self, force: bool = False) -> bool:
        """Classify every process again if `refresh_interval` passed (or `force`): what the
        agent's attribution thread does when it has nothing else to do, and before its first
        event, so a scan for a change rarely pays for it. True if it ran."""
        with self._lock:
            now = self._clock()
            if not force and now - self._full_at < self._refresh_interval:
                return False
            self._update_candidates(now, full=True)
            return True

    def _fallback(self, path: str) -> list[Holder]:
        self._stats["full_scans"] += 1
        others = []
        for pid in psutil.pids():
            if self._known.get(pid, None) is None and pid not in self._exclude:
                proc = _process(pid)
                if proc is not None:
                    others.append(proc)
        return self._scan_procs(path, self._ordered(others))

    def _ordered(self, procs: list) -> list:
        """`procs` in the order a short save's writer is likeliest to be met in: a scan finds
        a writer only if the writer still holds the file when the scan reaches *it*, and a
        walk of a node's processes takes longer than a small save (docs/decisions.md,
        "Naming the writer of a short save"). First the processes seen writing a scanned
        file, the latest first (a job saves again and again); then their siblings (the other
        ranks of a launcher), newest first; then everyone else, newest first (a job that
        just started, not the daemons that have run for days). Costs a sort of the
        candidates: their create times are cached by psutil.
        """
        writers = self._writers
        recent = {pid: i for i, pid in enumerate(reversed(writers))}
        parents = {self._parents.get(pid) for pid in writers} - {None, 0, 1}

        def key(proc):
            pid = proc.pid
            i = recent.get(pid)
            if i is not None and writers[pid] == _create_time(proc):
                return (0, i)
            return (1 if self._parents.get(pid) in parents else 2, -_create_time(proc))
        return sorted(procs, key=key)

    def _wrote(self, proc: psutil.Process) -> None:
        """`proc` was found holding a scanned path for writing: scanned first from now on."""
        self._writers[proc.pid] = _create_time(proc)
        self._writers.move_to_end(proc.pid)
        if len(self._writers) > _WRITERS_CAP:
            self._writers.popitem(last=False)

    def _update_candidates(self, now: float, full: bool) -> None:
        """Classify processes started since the last update (all of them when `full`).

        The incremental update reads only the pid list and the new pids' names: cheap enough
        to run before every attribution, so a job started a moment ago is not missed. The full
        one also catches a pid reused by a new process.
        """
        pids = set(psutil.pids())
        if full:
            self._known = {pid: p for pid, p in self._known.items()
                           if p is not None and _alive(p)}
            self._parents = {pid: pp for pid, pp in self._parents.items()
                             if pid in self._known}
            self._full_at = now
            self._stats["refreshes"] += 1
        else:
            self._stats["updates"] += 1
        self._update_at = now
        for pid in [pid for pid in self._known if pid not in pids]:
            del self._known[pid]
            self._parents.pop(pid, None)
        for pid in pids:
            if pid in self._known:
                continue
            if pid in self._exclude:
                self._known[pid] = None
                continue
            proc = _process(pid)
            if proc is None:
                continue
            try:
                name = proc.name()
            except psutil.Error:
                continue   # gone, or not ours to read: retried on the next update
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                cmdline = []
            if self._candidate(name, cmdline):
                self._known[pid] = proc
                try:
                    self._parents[pid] = proc.ppid()
                except psutil.Error:
                    pass
            else:
                self._known[pid] = None
                self._parents.pop(pid, None)
        self._stats["candidates"] = sum(1 for p in self._known.values() if p is not None)
        if full:
            live = {(p.pid, _create_time(p)) for p in self._known.values() if p is not None}
            for key in [k for k in self._env_cache if k not in live]:
                del self._env_cache[key]

    def _scan_procs(self, path: str, procs) -> list[Holder]:
        found = []
        for proc in procs:
            try:
                opens = self._opens(proc, path)
                if not opens:
                    continue
                ident = self._identity(proc)
                for fd, mode in opens:
                    found.append(_holder(mode, fd, ident))
                if any(mode in WRITE_MODES for _, mode in opens):
                    self._wrote(proc)
            except psutil.NoSuchProcess:
                self._stats["vanished"] += 1
            except psutil.AccessDenied:
                self._denied()
            except Exception:   # a scan must never fail the agent; counted instead
                self._stats["errors"] += 1
        return found

    def _opens(self, proc: psutil.Process, path: str) -> list[tuple[int, str]]:
        """(fd, mode) of `proc`'s descriptors on `path` (one readlink per descriptor)."""
        return [(fd, mode) for _, fd, mode in self._walk(proc, path)]

    def _opens_under(self, proc: psutil.Process, prefix: str) -> list[tuple[str, int, str]]:
        """(path, fd, mode) of `proc`'s descriptors on files below `prefix`."""
        return [opened for opened in self._walk(proc, "", prefix)
                if not opened[0].endswith(" (deleted)")]

    def _walk(self, proc: psutil.Process, path: str, prefix: str | None = None) -> list:
        """_proc_fd_opens for `proc`, in psutil's exceptions, counting a walk stopped at
        MAX_FDS_WALKED."""
        capped: list = []
        try:
            found = _proc_fd_opens(proc.pid, path, prefix, capped)
        except FileNotFoundError as exc:
            raise psutil.NoSuchProcess(proc.pid) from exc
        except PermissionError as exc:
            raise psutil.AccessDenied(proc.pid) from exc
        if capped:
            self._stats["fds_capped"] += 1
        return found

    def _identity(self, proc: psutil.Process) -> tuple[Writer, tuple]:
        """(the Writer the process's environment names, its command line)."""
        key = (proc.pid, _create_time(proc))
        ident = self._env_cache.get(key)
        if ident is not None:
            return ident
        environ = proc.environ()
        # from_environ describes the *calling* process's pid and host: keep its field parsing,
        # replace those two with the scanned process's.
        fields = identity.from_environ(environ)
        fields["pid"] = proc.pid
        fields["node"] = environ.get(identity.NODE_ENV) or self.node
        try:
            cmdline = tuple(proc.cmdline())
        except psutil.Error:
            cmdline = ()
        ident = (Writer.from_event(fields), cmdline)
        if len(self._env_cache) >= _ENV_CACHE_CAP:
            self._env_cache.clear()
            self._last_by_pid.clear()
        self._env_cache[key] = ident
        self._last_by_pid[proc.pid] = ident
        return ident


def _holder(mode: str, fd: int | None, ident: tuple[Writer, tuple]) -> Holder:
    writer, cmdline = ident
    return Holder(writer, mode, fd, cmdline)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(int(pid))
    except psutil.Error:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


def _create_time(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.Error:
        return 0.0


def _per_pid(holders: list[Holder]) -> list[Holder]:
    seen: dict[int, Holder] = {}
    for p in holders:
        seen.setdefault(p.pid, p)
    return sorted(seen.values(), key=lambda p: p.pid)
