"""Verify checkpoints once their writers are done, off the agent's loop.

Two parts with one responsibility each:
- VerifySchedule (pure, injected clock): which paths are due. A finished write makes its path
  due `quiet` seconds later; another write on the path pushes that back. Verifying earlier
  would read a file that a colliding writer is still writing and blame the wrong moment.
  A collision on the path is remembered so the verdict can name the collision that made it.
- Verifier (a worker thread with a bounded queue): runs monitor.verify.integrity.verify on due paths
  and hands each Verification back through an outbox the agent's loop drains, so exporters
  stay on the loop's thread. A full queue skips the path (counted): verification is a check
  on top, never a reason to fall behind.

Whose rights: a path named by a hook's event is read only as far as that sender could read it
itself (monitor.verify.rights.open_as with the sender's credentials, taken by the ingest server from
the kernel); a path the agent's own watcher saw under a watched root (the operator's choice) is
read with the agent's rights. A path with neither is not verified (counted in denied_total).
What is read never reaches the journal or the log as content: verdict reasons that would quote
a file's first bytes or an HTML title are replaced by content-free ones (_content_free).

Checkpoint sets (monitor.verify.sets): a file read with the agent's rights (watched) that may
belong to a set (a .distcp or .metadata in a DCP directory, a file next to a *.index.json)
makes its directory a set candidate (Verification.set_dir); the schedule makes the set due
`quiet` seconds after its last member was verified or written, and the worker verifies the set
as one unit, reported as a Verification whose path is the directory (format "dcp" or
"hf-sharded"). The schedule remembers the run key of each path's last writer
(note_run), so DCP shards written by different job runs are `mixed`. Sets are verified with
the agent's rights only, never following a symlinked member; the same set bytes (names,
sizes, mtimes, inodes) are not reported twice.

Deep checks (CRC32 of every byte) run for files up to `deep_max_bytes`, at most `max_rate`
bytes/s, so a node's disks stay the training job's.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from monitor.verify import rights
from monitor.verify import integrity
from monitor.verify import sets as checkpoint_sets

log = logging.getLogger("ckptwatch.verifier")

RESULT_GONE = "gone"        # the file was renamed or deleted before it could be verified
# A DCP checkpoint whose .metadata never came: no write in its directory for
# `incomplete_after` seconds after a shard was verified (its save crashed or was killed).
RESULT_INCOMPLETE = "incomplete"
CAUSE_MISSING_METADATA = "missing_metadata"
RESULTS = (integrity.OK, integrity.CORRUPT, integrity.UNVERIFIABLE, RESULT_GONE,
           RESULT_INCOMPLETE)
MAX_REMEMBERED = 10000      # files whose last verified (size, mtime, inode) is kept
_NEVER = float("inf")       # the due time of a path being written: due only after its end


@dataclass(frozen=True)
class Verification:
    """One verified file: the metrics' input and, as a Finding (monitor.agent.daemon), the
    journal's "verification" record."""

    path: str
    result: str                       # one of RESULTS
    format: str = ""
    reason: str = ""
    cause: str = ""                   # integrity.CAUSES when corrupt: a bounded label value
    deep: bool = False
    bytes: int | None = None
    seconds: float = 0.0
    job: str = ""
    collision_id: str = ""            # the collision that wrote this path, if one did
    wall: float = 0.0
    # Would torch.load(weights_only=True) load it? "weights_only", "full_unpickle" (it names
    # refused_globals: callables a full unpickle would call), "unparsed", or "" (not a torch
    # pickle): monitor.verify.loadable. "ok" alone says the file is whole, not safe to load.
    pickle: str = ""
    refused_globals: tuple = ()
    set_dir: str = ""                 # the checkpoint set this file may belong to (not journaled)
    # A DCP shard's directory without .metadata yet (not journaled): judged incomplete if
    # none comes (VerifySchedule.incomplete_after).
    unfinished_set: str = ""


MAX_SENDERS = 4            # distinct senders remembered per due path; any one may grant a read


def _content_free(verdict: integrity.Verdict) -> str:
    """The verdict's reason without anything quoted from the file's bytes: the journal and
    the log keep sizes, formats, causes and the checkpoint's structure (record names and
    offsets), never the first bytes of an unknown file or the title of an HTML page."""
    reason = verdict.reason
    if verdict.format == integrity.FMT_UNKNOWN and reason.startswith("not a known"):
        return "not a known checkpoint format"
    if verdict.format == integrity.FMT_HTML:
        return reason.split(" titled ", 1)[0]
    if reason.startswith("verifier error: "):
        return reason.split(":", 2)[0] + ":" + reason.split(":", 2)[1]   # the type, no message
    return reason


def _verification(path: str, verdict: integrity.Verdict, deep: bool, size: int | None,
                  seconds: float, job: str = "", collision_id: str = "",
                  wall: float = 0.0) -> Verification:
    """A verdict on `path` (a file, or a set's directory) as its content-free Verification."""
    cause = ""
    if verdict.status == integrity.CORRUPT:
        cause = verdict.details.get("cause") or integrity.corrupt_cause(verdict.reason)
    return Verification(path, verdict.status, verdict.format, _content_free(verdict), cause,
                        deep, size, seconds, job, collision_id, wall,
                        verdict.details.get("pickle", ""),
                        tuple(verdict.details.get("refused_globals", ())))


@dataclass(frozen=True)
class _SetJob:
    directory: str
    runs: dict
    unfinished_for: float | None = None     # seconds quiet without .metadata (incomplete?)


@dataclass
class _Due:
    at: float
    job: str = ""
    collision_id: str = ""


@dataclass
class VerifySchedule:
    """Pure: which paths are quiet enough to verify now.

    Paths the agent's own watcher saw (read with the agent's rights) and paths only a hook
    named are kept apart, each bounded by `max_paths`: a sender naming paths by the
    thousand forgets the oldest of its kind, never a file the operator asked to watch."""

    quiet: float = 1.0
    max_paths: int = 10000
    # Seconds without a write in a DCP directory whose .metadata has not come, after one of
    # its shards was verified, before the set is judged incomplete (a slow save's last shard
    # and .metadata may come minutes after the first shard; each write there restarts it).
    incomplete_after: float = 60.0
    _due: dict = field(default_factory=dict)            # hook-reported path -> _Due
    _due_watched: dict = field(default_factory=dict)    # watched path -> _Due
    # hook-reported path -> the senders (monitor.verify.rights.Rights) whose hooks wrote there:
    # whose rights a read needs. Bounded (the oldest path is forgotten first: then nobody's,
    # and it is not read).
    _senders: OrderedDict = field(default_factory=OrderedDict)
    # paths the agent's own watcher saw a write on: read with the agent's rights. Bounded
    # apart from _senders, so hook-reported paths cannot push them out.
    _watched: OrderedDict = field(default_factory=OrderedDict)
    _sets: dict = field(default_factory=dict)          # set directory -> when it is due
    _runs: OrderedDict = field(default_factory=OrderedDict)   # path -> last writer's run key
    # DCP directory without .metadata -> when it is judged (incomplete_after after its last
    # write or verified shard; inf while a write there is in flight). Bounded by max_paths.
    _unfinished: OrderedDict = field(default_factory=OrderedDict)

    def _due_in_order(self) -> bool:
        """The invariant due() relies on (tests): a hook path's due time is set only when it
        is put last in _due (now + quiet, the clock never going back) or made _NEVER in
        place, so the finite ones rise in _due's order."""
        ats = [e.at for e in self._due.values() if e.at != _NEVER]
        return ats == sorted(ats)

    def _entry(self, path: str):
        return self._due_watched.get(path) or self._due.get(path)

    def write_finished(self, path: str, job: str, now: float, watched: bool = False,
                       hold: float = 0.0) -> None:
        """hold: seconds added to `quiet` (a write of a job spanning nodes: its job-scope
        collision comes later, and the verdict should name it)."""
        if watched:
            self._note(path, None)
        entry = self._due_watched.pop(path, None) or self._due.pop(path, None) or _Due(now, job)
        entry.at = now + self.quiet + hold
        entry.job = job or entry.job
        self._set_busy(path, now + self.quiet, now)
        self._enqueue(path, entry)

    def _enqueue(self, path: str, entry: _Due) -> None:
        due = self._due_watched if path in self._watched else self._due
        due[path] = entry                 # (re-)inserted last: dict order = due order
        if len(due) > self.max_paths:
            due.pop(next(iter(due)))

    def write_started(self, path: str, now: float, sender=None, watched: bool = False) -> None:
        """A new write on `path`: a due path is not quiet any more, wait for its end.
        `sender`: the hook's Rights; watched: the agent's own watcher saw the write."""
        entry = self._entry(path)
        if entry is not None:
            entry.at = _NEVER
        self._set_busy(path, _NEVER)           # a set being written is not quiet either
        if watched or sender is not None:
            self._note(path, None if watched else sender)

    def note_sender(self, path: str, sender) -> None:
        """`sender` (monitor.verify.rights.Rights) wrote `path`: it may be read with its rights."""
        self._note(path, sender)

    def _note(self, path: str, sender) -> None:
        if sender is None:                     # the agent's watcher: the agent's rights
            self._senders.pop(path, None)
            self._watched.pop(path, None)
            self._watched[path] = True
            if len(self._watched) > self.max_paths:
                self._watched.popitem(last=False)
            if path in self._due:              # now watched: moves to the watched capacity
                self._enqueue(path, self._due.pop(path))
            return
        if path in self._watched:              # already readable with the agent's rights
            return
        known = self._senders.get(path)
        if known is not None and sender in known:   # the usual case: the same hook again
            self._senders.move_to_end(path)
            return
        known = self._senders.pop(path, ())
        known = (known + (sender,))[-MAX_SENDERS:]
        self._senders[path] = known
        if len(self._senders) > self.max_paths:
            self._senders.popitem(last=False)

    def collided(self, path: str, collision_id: str, now: float) -> None:
        entry = self._entry(path)
        if entry is None:
            entry = _Due(now + self.quiet)
            self._enqueue(path, entry)
        entry.collision_id = collision_id

    def note_run(self, path: str, run_key) -> None:
        """The run key of `path`'s last writer (a finished Write), for set checks."""
        if run_key is None:
            return
        if self._runs.get(path) == run_key:
            self._runs.move_to_end(path)
            return
        self._runs.pop(path, None)
        self._runs[path] = run_key
        if len(self._runs) > self.max_paths:
            self._runs.popitem(last=False)

    def member_verified(self, directory: str, now: float) -> None:
        """A file of the set in `directory` was verified: the set is due `quiet` later."""
        self._unfinished.pop(directory, None)        # its .metadata came
        self._sets.pop(directory, None)
        self._sets[directory] = now + self.quiet
        if len(self._sets) > self.max_paths:
            self._sets.pop(next(iter(self._sets)))

    def verified(self, results, now: float) -> None:
        for v in results:
            if v.set_dir:
                self.member_verified(v.set_dir, now)
            elif v.unfinished_set:
                self._unfinished.pop(v.unfinished_set, None)
                self._unfinished[v.unfinished_set] = now + self.incomplete_after
                if len(self._unfinished) > self.max_paths:
                    self._unfinished.popitem(last=False)

    def due_unfinished(self, now: float) -> list[str]:
        """DCP directories quiet for incomplete_after without a .metadata; removed."""
        ready = [d for d, at in self._unfinished.items() if at <= now]
        for directory in ready:
            del self._unfinished[directory]
        return ready

    def due_sets(self, now: float) -> list[tuple[str, dict]]:
        """(directory, {member path: run key}) of every set quiet since `quiet`; removed."""
        ready = [d for d, at in self._sets.items() if at <= now]
        out = []
        for directory in ready:
            del self._sets[directory]
            out.append((directory, self.runs_in(directory)))
        return out

    def runs_in(self, directory: str) -> dict:
        """{member path: its last writer's run key} of the files in `directory`."""
        return {p: k for p, k in self._runs.items() if os.path.dirname(p) == directory}

    def _set_busy(self, path: str, at: float, now: float | None = None) -> None:
        if not self._sets and not self._unfinished:
            return              # no set is waiting (the usual case): no directory to look up
        directory = os.path.dirname(path)
        if directory in self._sets:
            self._sets[directory] = at
        if directory in self._unfinished:   # a write there: the save is still going on
            self._unfinished[directory] = at if now is None else now + self.incomplete_after

    def due(self, now: float) -> list[tuple[str, str, str, tuple | None]]:
        """(path, job, collision_id, readers) of every path quiet since `quiet` seconds;
        removed. readers: None to read with the agent's rights (watched), else the senders
        whose rights the read must fit (empty: nobody's, do not read)."""
        ready = []
        for p, e in self._due_watched.items():
            if e.at <= now:
                ready.append((p, e.job, e.collision_id, None))
        for path, _, _, _ in ready:
            del self._due_watched[path]
            self._watched.pop(path, None)      # the next write says again whose rights
        hook = []
        for p, e in self._due.items():
            if e.at <= now:
                hook.append((p, e.job, e.collision_id, self._senders.get(p, ())))
            elif e.at != _NEVER:
                # Hook paths are due in the order they were put in (_due_in_order): none
                # after a later one is due yet. Only paths still being written (at _NEVER)
                # are stepped over, so a tick costs the due paths, not every path known.
                break
        for path, _, _, _ in hook:
            del self._due[path]
            self._senders.pop(path, None)
        return ready + hook

    def __len__(self) -> int:
        return len(self._due) + len(self._due_watched)

    def pending(self) -> int:
        """Paths and sets due at a known time: quiet now, verified once `quiet` has passed.
        (A path whose new write has not ended is not counted: it waits on the write, which
        ckptwatch_active_writes shows.)

        Safe to call from a metrics scrape while the loop changes the schedule: each table is
        copied by one C call (list(...), which no other Python thread can interleave with
        under the GIL) before it is counted in Python."""
        due, watched, sets = (list(self._due.values()), list(self._due_watched.values()),
                              list(self._sets.values()))
        return (sum(1 for e in due if e.at != float("inf"))
                + sum(1 for e in watched if e.at != float("inf"))
                + sum(1 for at in sets if at != float("inf")))


class Verifier:
    """Runs verifications in one worker thread; results come back through drain()."""

    def __init__(self, deep_max_bytes: int = 256 << 20, max_rate: float | None = 200e6,
                 max_queue: int = 1024, wall_clock=time.time, on_verdict=None):
        self.deep_max_bytes = deep_max_bytes
        self.max_rate = max_rate
        # Two lanes, each bounded by max_queue: what the agent's own watcher saw (and sets,
        # read with the agent's rights) and what hooks named. The worker empties the watched
        # lane first, so a sender naming paths by the thousand (most of them not there) delays
        # and fills only its own lane.
        self._max_queue = max_queue
        self._watched_lane: deque = deque()
        self._hook_lane: deque = deque()
        self._ready = threading.Condition()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wall = wall_clock
        self._thread: threading.Thread | None = None
        self.skipped_total = 0            # paths not verified because the queue was full
        # path -> (size, mtime_ns, inode) last verified: the same bytes are not verified (and
        # reported) twice when several signals say one file is finished (polling, hook+fs).
        self._verified: OrderedDict = OrderedDict()
        self.unchanged_total = 0
        self.denied_total = 0             # paths not read: no sender could read them itself
        # Submitted and not yet drained. Only the loop's thread (submit, drain) touches it:
        # the worker answers every item, with an empty list when it has no verdict, so a
        # count of 0 means every verdict is in the loop's hands (`ckptwatch check` waits on it).
        self.outstanding = 0
        # on_verdict(source, st, verification, owned): called on the worker thread with every
        # file verdict while `source` (the path, or the /proc/self/fd link to the very file
        # read) is still open, st its stat before the read; owned: the file belongs to whoever
        # it was read for (the agent's rights, or a sender who owns it). The agent stores the
        # verdict with the file there (monitor/agent/verdictbook.py). Its failures are its own.
        self.on_verdict = on_verdict

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptwatch-verifier",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the file being verified; queued paths are dropped."""
        if self._thread is None:
            return
        with self._ready:
            self._watched_lane.clear()
            self._hook_lane.clear()
            self._watched_lane.append(None)
            self._ready.notify()
        self._thread.join(timeout)
        self._thread = None

    def submit(self, path: str, job: str = "", collision_id: str = "",
               readers: tuple | None = None) -> bool:
        return self._put((path, job, collision_id, readers), watched=readers is None)

    def submit_set(self, directory: str, runs: dict | None = None,
                   unfinished_for: float | None = None) -> bool:
        """Verify the sets in `directory`; unfinished_for: a DCP directory that has had no
        .metadata for that many quiet seconds (incomplete, unless it came meanwhile)."""
        return self._put(_SetJob(directory, runs or {}, unfinished_for), watched=True)

    def _put(self, item, watched: bool) -> bool:
        lane = self._watched_lane if watched else self._hook_lane
        with self._ready:
            if len(lane) >= self._max_queue:
                self.skipped_total += 1
                return False
            lane.append(item)
            self._ready.notify()
        self.outstanding += 1
        return True

    def _take(self):
        with self._ready:
            while not self._watched_lane and not self._hook_lane:
                self._ready.wait()
            return (self._watched_lane or self._hook_lane).popleft()

    def _changed_set(self, directory: str, sig) -> bool:
        """Remember `sig` as the set's files; False (counted unchanged) when it is what the
        last verification of `directory` saw."""
        key = ("set", directory)
        if self._verified.get(key) == sig:
            self.unchanged_total += 1
            return False
        self._verified[key] = sig
        self._verified.move_to_end(key)
        if len(self._verified) > MAX_REMEMBERED:
            self._verified.popitem(last=False)
        return True

    def verify_sets(self, directory: str, runs: dict | None = None) -> list[Verification]:
        """Verify every checkpoint set in `directory` with the agent's rights (the worker's
        step for a due set); [] when its files are unchanged since the last time."""
        sig = checkpoint_sets.signature(directory)
        if not self._changed_set(directory, sig):
            return []
        out = []
        for s in checkpoint_sets.find_sets(directory, checkpoint_sets.listing(directory)):
            started = time.monotonic()
            v = checkpoint_sets.verify_set(s, runs=runs, follow_symlinks=False)
            out.append(_verification(directory, v, False, v.details.get("bytes"),
                                     time.monotonic() - started, wall=self._wall()))
        return out

    def verify_unfinished(self, directory: str, runs: dict | None,
                          quiet_for: float) -> list[Verification]:
        """A DCP directory whose .metadata had not come `quiet_for` seconds after its last
        write: verified as a set if it came meanwhile, else judged incomplete (once for the
        same files)."""
        names = checkpoint_sets.listing(directory)
        if checkpoint_sets.DCP_METADATA in names:
            return self.verify_sets(directory, runs)
        shards = [n for n in names if n.endswith(checkpoint_sets.DCP_SUFFIX)]
        if not shards:
            return []                       # removed meanwhile: nothing left to judge
        sig = checkpoint_sets.signature(directory)
        if not self._changed_set(directory, sig):
            return []
        n = len(shards)
        return [Verification(
            directory, RESULT_INCOMPLETE, checkpoint_sets.KIND_DCP,
            f"{n} shard{'s' if n != 1 else ''} and no {checkpoint_sets.DCP_METADATA} "
            f"{quiet_for:.0f}s after the last write: the save did not finish (it crashed or "
            "was killed); torch.distributed.checkpoint cannot load it",
            CAUSE_MISSING_METADATA, wall=self._wall())]

    def drain(self) -> list[Verification]:
        out = []
        while True:
            try:
                answer = self._outbox.get_nowait()
            except queue.Empty:
                return out
            self.outstanding = max(0, self.outstanding - 1)
            out.extend(answer)

    def verify(self, path: str, job: str = "", collision_id: str = "",
               readers: tuple | None = None) -> Verification | None:
        """Verify one file now (the worker's step; also usable directly). None when the file
        is unchanged since it was last verified, or when `readers` is a tuple of senders none
        of whom could read it (see module doc); readers=None reads with the agent's rights."""
        if readers is None:
            # The agent's own rights (a watched root): no symbolic link is followed.
            result = self._verify(path, path, job, collision_id, follow_symlinks=False)
            if result is not None and result.result != RESULT_GONE:
                set_dir = checkpoint_sets.set_of(path)
                if set_dir is not None:
                    result = dataclasses.replace(result, set_dir=set_dir)
                else:
                    unfinished = checkpoint_sets.unfinished_dcp(path)
                    if unfinished is not None:
                        result = dataclasses.replace(result, unfinished_set=unfinished)
            return result
        fd = None
        for sender in readers:
            try:
                fd = rights.open_as(path, sender)
                reader = sender
                break
            except FileNotFoundError:
                return Verification(path, RESULT_GONE, job=job, collision_id=collision_id,
                                    wall=self._wall())
            except OSError as exc:
                log.debug("not verifying %s for uid %s: %s", path, sender.uid, exc)
        if fd is None:
            self.denied_total += 1
            return None
        try:
            # The descriptor checked above, reopened by /proc: the very file the sender could
            # read, whatever the name points to by now.
            return self._verify(f"/proc/self/fd/{fd}", path, job, collision_id,
                                owner=reader.uid)
        finally:
            os.close(fd)

    def _verify(self, source: str, path: str, job: str, collision_id: str,
                follow_symlinks: bool = True, owner: int | None = None
                ) -> Verification | None:
        started = time.monotonic()
        try:
            st = os.stat(source)
        except FileNotFoundError:
            return Verification(path, RESULT_GONE, job=job, collision_id=collision_id,
                                wall=self._wall())
        except OSError:
            st = None
        size = st.st_size if st is not None else None
        if st is not None:
            signature = (st.st_size, st.st_mtime_ns, st.st_ino)
            if self._verified.get(path) == signature:
                self.unchanged_total += 1
                return None
            self._verified[path] = signature
            self._verified.move_to_end(path)
            if len(self._verified) > MAX_REMEMBERED:
                self._verified.popitem(last=False)
        deep = size is not None and size <= self.deep_max_bytes
        # The file stat'ed above and no other (integrity.verify opens it without blocking
        # and checks it on the descriptor: a name swapped for a FIFO meanwhile is not read).
        verdict = integrity.verify(source, deep=deep, max_bytes_per_second=self.max_rate,
                                   name=path, follow_symlinks=follow_symlinks,
                                   identity=(st.st_dev, st.st_ino) if st is not None else None)
        result = _verification(path, verdict, deep, size, time.monotonic() - started, job,
                               collision_id, self._wall())
        if self.on_verdict is not None and st is not None:
            try:
                self.on_verdict(source, st, result,
                                owner is None or owner == 0 or owner == st.st_uid)
            except Exception:
                log.exception("storing the verdict on %r failed", path)
        return result

    def _run(self) -> None:
        while True:
            item = self._take()
            if item is None:
                return
            answer: list = []       # one answer per item, even without a verdict
            try:
                if isinstance(item, _SetJob) and item.unfinished_for is not None:
                    answer = self.verify_unfinished(item.directory, item.runs,
                                                    item.unfinished_for)
                elif isinstance(item, _SetJob):
                    answer = self.verify_sets(item.directory, item.runs)
                else:
                    result = self.verify(*item)
                    answer = [result] if result is not None else []
            except Exception:       # a verifier bug must not kill the thread
                log.exception("verification of %r failed",
                              item.directory if isinstance(item, _SetJob) else item[0])
            finally:
                self._outbox.put(answer)
