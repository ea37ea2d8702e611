"""What the agent knows about each checkpoint file, for the resume guard (ckptwatch/resumeguard.py).

Two ways out, one FileVerdict (ckptwatch/verdicts.py) behind both:
- answer(query, rights): the ingest server's reply to a hook's "query" frame, on the ingest
  thread, from this table alone (no file is touched: a query must not make the agent wait on
  a filesystem, and nothing a sender names is opened).
- stamp(source, st, verification, owned): on the verifier's thread, right after a file was
  verified, the verdict is stored with the file as the extended attribute
  ckptwatch.verdicts.XATTR, keyed to the identity the verifier read (a file changed during the
  read is not tagged). It reaches loads on other nodes of a shared filesystem and survives
  agent restarts. Only a file that belongs to whoever it was read for is tagged: the agent
  (root) never writes metadata on a file its sender could not (owned, monitor.verify.worker).

The loop's thread feeds the table: write_started / write_ended (a save in progress), collided
(a concurrent collision: its id and writers), verified (through stamp, from the worker). A
path's next write start forgets what was known about its previous version. Bounded: at most
max_paths paths (the oldest forgotten), MAX_OPEN open writes per path.

Whom a query is answered for: a process whose user wrote the path (a hook reported a write of
it from a process of that uid) or root; anyone else gets "unknown", so a query cannot learn
who writes another user's files (docs/security.md). The xattr is readable by whoever can read
the file, like the file itself.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

from ckptwatch import verdicts
from ckptwatch.verdicts import FileVerdict

log = logging.getLogger("ckptwatch.verdicts")

MAX_OPEN = 64           # open writes remembered per path
ANSWER_TYPE = "verdict"


class _Entry:
    __slots__ = ("uids", "open", "collision", "writers", "verdict")

    def __init__(self):
        self.uids: set = set()
        self.open: dict = {}          # (node, pid, seq) -> True
        self.collision = ""
        self.writers: tuple = ()
        self.verdict: FileVerdict | None = None   # the last file verdict (ok/corrupt)


class VerdictBook:
    def __init__(self, max_paths: int = 10000, store: bool = True):
        self.max_paths = max_paths
        self.store = store              # tag verified files (verify.store-verdict)
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()
        self._last_ok: OrderedDict = OrderedDict()     # directory -> last file verified ok
        self.counts = {"queries": 0, "answered_unknown": 0, "stored": 0, "store_failed": 0}

    # ---- the loop's thread ---------------------------------------------------------------

    def _entry(self, path: str) -> _Entry:
        entries = self._entries
        entry = entries.get(path)
        if entry is not None:
            # Most recently touched last. move_to_end, not pop and insert again: every start
            # and end of a save comes here (issue 22, path reuse).
            entries.move_to_end(path)
            return entry
        entry = entries[path] = _Entry()
        if len(entries) > self.max_paths:
            entries.popitem(last=False)
        return entry

    def write_started(self, path: str, key: tuple, uid: int | None) -> None:
        with self._lock:
            entry = self._entry(path)
            entry.collision, entry.writers, entry.verdict = "", (), None
            if uid is not None:
                entry.uids.add(uid)
            if len(entry.open) < MAX_OPEN:
                entry.open[key] = True

    def write_ended(self, path: str, key: tuple, uid: int | None = None) -> None:
        entry = self._entries.get(path)
        if entry is not None and (uid is None or uid in entry.uids):
            # Nothing but the pop to do, and that without the lock (issue 22: every save
            # comes here twice, from its end event and its Write; the lock was most of the
            # cost): only this thread, the loop's, adds or removes open writes, a pop is one
            # step a query sees before or after, and an entry evicted meanwhile is simply
            # no longer consulted. (A lookup of the table is one step as well.)
            entry.open.pop(key, None)
            return
        with self._lock:
            entry = self._entries.get(path)
            if entry is None:
                if uid is None:
                    return
                entry = self._entry(path)
            entry.open.pop(key, None)
            if uid is not None:
                entry.uids.add(uid)

    def collided(self, path: str, collision_id: str, writers) -> None:
        """A concurrent collision wrote `path`; writers: dicts with rank, pid, node, site."""
        texts = tuple(verdicts.writer_text(w.get("rank"), w.get("pid"), w.get("node"),
                                           w.get("site"))
                      for w in writers[:verdicts.MAX_WRITERS])
        with self._lock:
            entry = self._entry(path)
            entry.collision, entry.writers = collision_id, texts

    # ---- the verifier's thread -----------------------------------------------------------

    def verified(self, path: str, result: str, cause: str, reason: str, collision_id: str,
                 identity: tuple) -> FileVerdict | None:
        """Record a file's verdict; the FileVerdict to store with it (None: not a verdict
        about the file's content, e.g. unverifiable)."""
        if result not in (verdicts.OK, verdicts.CORRUPT):
            return None
        directory = os.path.dirname(path)
        with self._lock:
            entry = self._entry(path)
            if collision_id and collision_id != entry.collision:
                entry.collision, entry.writers = collision_id, ()
            if result == verdicts.OK:
                self._last_ok.pop(directory, None)
                self._last_ok[directory] = path
                if len(self._last_ok) > self.max_paths:
                    self._last_ok.popitem(last=False)
                last_ok = ""
            else:
                if self._last_ok.get(directory) == path:
                    del self._last_ok[directory]
                last_ok = self._last_ok.get(directory, "")
            verdict = FileVerdict(result, cause if result == verdicts.CORRUPT else "",
                                  reason if result == verdicts.CORRUPT else "",
                                  entry.collision, entry.writers, last_ok, identity)
            entry.verdict = verdict
            return verdict

    def stamp(self, source: str, st, verification, owned: bool) -> bool:
        """monitor.verify.worker's on_verdict: record the verdict, and store it with the file
        when allowed (module doc). True when stored."""
        verdict = self.verified(verification.path, verification.result, verification.cause,
                                verification.reason, verification.collision_id,
                                verdicts.identity_of(st))
        if verdict is None or not self.store or not owned or not _regular(st):
            return False
        try:
            now = os.stat(source)
            if verdicts.identity_of(now) != verdict.identity:
                return False                 # changed while it was read: no verdict on it
            os.setxattr(source, verdicts.XATTR, verdicts.encode(verdict))
        except OSError as exc:
            # ENOTSUP (tmpfs before Linux 6.6, sshfs, some NFS), EPERM, a file gone: the
            # query still answers for this node.
            self.counts["store_failed"] += 1
            log.debug("verdict not stored on %s: %s", verification.path, exc)
            return False
        self.counts["stored"] += 1
        return True

    # ---- the ingest thread ---------------------------------------------------------------

    def answer(self, query: dict, rights) -> bytes:
        """The answer frame to a decoded "query" (ckptwatch/events.py)."""
        self.counts["queries"] += 1
        uid = getattr(rights, "uid", None)
        verdict = verdicts.UNKNOWN_VERDICT
        with self._lock:
            for name in (query.get("path"), query.get("alias")):
                if not isinstance(name, str):
                    continue
                entry = self._entries.get(name)
                if entry is None:
                    found = self._known_directory(name, uid)
                    if found is not None:
                        verdict = found
                        break
                    continue
                if uid == 0 or uid in entry.uids:  # else not this user's file: unknown
                    verdict = self._known(name, entry)
                break
        if verdict.state == verdicts.UNKNOWN:
            self.counts["answered_unknown"] += 1
        from ckptwatch.events import HEADER
        payload = verdicts.encode(verdict, type=ANSWER_TYPE, qid=query.get("qid"))
        return HEADER.pack(len(payload)) + payload

    def _known_directory(self, directory: str, uid) -> FileVerdict | None:
        """A checkpoint directory (a DCP load): the worst of what is known about the files
        directly in it that this user wrote; None when none is known. One pass over the
        table (at most max_paths entries), under the lock."""
        prefix = directory.rstrip("/") + "/"
        worst, worst_path, rank = None, "", 0
        for path, entry in self._entries.items():
            if (not path.startswith(prefix) or "/" in path[len(prefix):]
                    or (uid != 0 and uid not in entry.uids)):
                continue
            known = self._known(path, entry)
            r = _DIRECTORY_RANK.get(known.state, 0)
            if r > rank:
                worst, worst_path, rank = known, path, r
        if worst is None:
            return None
        # Identities are per file: the guard cannot compare them with the directory.
        return FileVerdict(worst.state, worst.cause,
                           f"{os.path.basename(worst_path)}: {worst.reason}" if worst.reason
                           else "",
                           worst.collision, worst.writers, worst.last_ok)

    def _known(self, path: str, entry: _Entry) -> FileVerdict:
        last_ok = self._last_ok.get(os.path.dirname(path), "")
        last_ok = "" if last_ok == path else last_ok
        if entry.open:
            return FileVerdict(verdicts.WRITING, last_ok=last_ok)
        if entry.verdict is not None:
            v = entry.verdict
            return FileVerdict(v.state, v.cause, v.reason, v.collision, v.writers,
                               v.last_ok or last_ok, v.identity)
        if entry.collision:
            return FileVerdict(verdicts.COLLISION, collision=entry.collision,
                               writers=entry.writers, last_ok=last_ok)
        return verdicts.UNKNOWN_VERDICT


_DIRECTORY_RANK = {verdicts.CORRUPT: 3, verdicts.WRITING: 2, verdicts.COLLISION: 1}


def _regular(st) -> bool:
    return (st.st_mode & 0o170000) == 0o100000
