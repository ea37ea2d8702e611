"""The ingest server's connections and what bounds them: per-pid and per-uid caps on new
connections, room made at the total cap by evicting, stalled frames, a token bucket for the
job-scope events each connection may send, and the counters and throttled log of all that.

No sockets of its own and no thread: the server thread (monitor/ingest/server.py) owns the
sockets, calls these on them, and closes what this module names.
"""
from __future__ import annotations

import logging
import socket
import time
from collections import deque
from typing import Callable

from ckptwatch import events
from monitor.ingest.throttle import ThrottledWarning
from monitor.verify.rights import Rights, peer_rights

log = logging.getLogger("ckptwatch.ingest")

# Job-scope events ("remote", "hazard", "jobscope": ckptwatch/events.py) speak about other
# processes and cannot be checked, so each connection may send only so many: a token bucket
# of JOB_SCOPE_BURST refilled at JOB_SCOPE_RATE per second; the rest are rejected as
# "rate_limited". A hook reports at most ~64 remote writes per save of its own.
JOB_SCOPE_RATE = 64.0
JOB_SCOPE_BURST = 512.0

REFUSE_REASONS = ("pid_limit", "uid_limit")          # a new connection closed at once
# An open connection closed by the agent; foreign_writer: bytes from a process other than
# the one that connected (a forked child on an inherited connection).
EVICT_REASONS = ("make_room", "stalled_frame", "foreign_writer")
# Writes each connection that reads notices remembers (Connection.made): a notice about an
# older write of it is not sent. A notice comes `settle` (1-3 s) after the writes end, and a
# process makes a handful of writes per save; 128 per connection bounds the memory of 1,024
# connections to ~13 MB whatever they send.
MAX_WRITES_REMEMBERED = 128


class Connection:
    """One hook's connection: its peer (from the kernel), its framing, and what the server
    thread owes it (acks, the rest of a notice)."""

    __slots__ = ("sock", "pid", "uid", "ns_pid", "rights", "reader", "last_active",
                 "partial_since", "tokens", "tokens_at", "wants_notices", "unsent",
                 "wants_acks", "frames", "receipts", "ackable", "acked", "acked_at",
                 "writes")

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int, now: float):
        self.sock = sock
        self.pid = pid
        self.uid = uid
        # What the peer may read (monitor.verify.rights) and what it calls itself when it
        # lives in a nested pid namespace (else == pid): one read of /proc/<pid>/status per
        # connection.
        if pid > 0:
            self.rights, self.ns_pid = peer_rights(pid, uid, gid)
        else:
            self.rights, self.ns_pid = Rights(uid, gid), None
        self.reader = events.FrameReader()
        self.last_active = now               # monotonic time of the last bytes received
        self.partial_since: float | None = None  # when the unfinished frame buffered began
        self.tokens = JOB_SCOPE_BURST            # job-scope events this connection may send
        self.tokens_at = now
        self.wants_notices = False           # a hello or an event said "notices": true
        self.unsent = b""                    # the rest of a partly sent notice or ack frame
        self.wants_acks = False              # the hello said "ack": true
        self.frames = 0                      # complete frames read from this connection
        # (batch number, frames read by then), oldest first: frames that count as taken in
        # once the consumer has finished that batch (server.py's doc, "Acknowledgements").
        self.receipts: deque = deque()
        self.ackable = 0                     # frames taken in (the consumer finished them)
        self.acked = 0                       # the last count acknowledged
        self.acked_at = -1e9
        # The writes this connection's own start/end/hazard frames named, as write_key()s,
        # newest last (only once it asked for notices): a notice goes only to a connection
        # that made one of the writes it is about (server.py's doc, "Notices").
        self.writes: dict[int, None] = {}

    def made(self, seq: int, path: str) -> None:
        """This connection's own frame named its write (seq, path): remember it, bounded."""
        writes = self.writes
        key = write_key(seq, path)
        if key in writes:
            return
        writes[key] = None
        if len(writes) > MAX_WRITES_REMEMBERED:
            del writes[next(iter(writes))]

    def take_token(self, now: float) -> bool:
        self.tokens = min(JOB_SCOPE_BURST, self.tokens + (now - self.tokens_at) * JOB_SCOPE_RATE)
        self.tokens_at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def write_key(seq: int, path: str) -> int:
    """One write of a connection's process: its seq and path, as one int (what a connection
    keeps per write it made; a path can be 64 KiB, its hash is one word)."""
    return hash((seq, path))


def last_active(conn: Connection) -> float:
    return conn.last_active


class Connections:
    """The open connections by file descriptor, counted per pid and per uid."""

    def __init__(self, max_connections: int = 1024, max_per_pid: int = 16,
                 max_per_uid: int = 256, frame_timeout: float = 30.0,
                 log_interval: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if min(max_per_pid, max_per_uid, max_connections) < 1:
            raise ValueError("connection limits must be >= 1, got "
                             f"{max_per_pid}, {max_per_uid}, {max_connections}")
        self.max_connections = max_connections
        self.max_per_uid = min(max_per_uid, max_connections)
        self.max_per_pid = min(max_per_pid, self.max_per_uid)
        self.frame_timeout = frame_timeout
        self.by_fd: dict[int, Connection] = {}
        self._per_pid: dict[int, int] = {}
        self._per_uid: dict[int, int] = {}
        self.refusals = ThrottledWarning(log, "connections refused or evicted",
                                         log_interval, clock)
        # New connections refused at a per-peer cap, and open ones the agent closed (see
        # IngestServer._accept and _sweep_stalled); exported as
        # ckptwatch_ingest_connections_*_total.
        self.refused: dict[str, int] = {reason: 0 for reason in REFUSE_REASONS}
        self.evicted: dict[str, int] = {reason: 0 for reason in EVICT_REASONS}

    def __len__(self) -> int:
        return len(self.by_fd)

    def refuse(self, pid: int, uid: int) -> bool:
        """Is a new connection from (pid, uid) over its cap? Counted and logged if so."""
        reason = self._over_peer_cap(pid, uid)
        if reason is None:
            return False
        self.refused[reason] += 1
        self.refusals.occurred(
            reason, "refusing connection from pid %d uid %d: %s (%d open for the pid, "
            "%d for the uid)", pid, uid, reason, self._per_pid.get(pid, 0),
            self._per_uid.get(uid, 0))
        return True

    def _over_peer_cap(self, pid: int, uid: int) -> str | None:
        # A hook holds one connection per process; the caps leave the rest of the agent to
        # everyone else (docs/decisions.md, "Connection caps").
        if self._per_pid.get(pid, 0) >= self.max_per_pid:
            return "pid_limit"
        if self._per_uid.get(uid, 0) >= self.max_per_uid:
            return "uid_limit"
        return None

    def full(self) -> bool:
        return len(self.by_fd) >= self.max_connections

    def make_room(self) -> Connection:
        """The agent is full: the connection to close, the least recently active one of the
        uid holding the most, rather than refuse a newcomer. Only runs at the cap,
        O(connections)."""
        top_uid = max(self._per_uid, key=self._per_uid.__getitem__)
        victim = min((c for c in self.by_fd.values() if c.uid == top_uid),
                     key=lambda c: (c.reader.pending(), c.last_active))
        self.evicted["make_room"] += 1
        self.refusals.occurred("make_room", "connection cap %d reached: closing the oldest "
                               "idle connection of uid %d (pid %d), which holds %d",
                               self.max_connections, top_uid, victim.pid,
                               self._per_uid[top_uid])
        return victim

    def add(self, sock: socket.socket, pid: int, uid: int, gid: int,
            now: float) -> Connection:
        conn = Connection(sock, pid, uid, gid, now)
        self.by_fd[sock.fileno()] = conn
        self._per_pid[pid] = self._per_pid.get(pid, 0) + 1
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        return conn

    def remove(self, conn: Connection) -> None:
        if self.by_fd.pop(conn.sock.fileno(), None) is conn:
            for counts, key in ((self._per_pid, conn.pid), (self._per_uid, conn.uid)):
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]

    def is_open(self, conn: Connection) -> bool:
        return self.by_fd.get(conn.sock.fileno()) is conn

    def stalled(self, now: float) -> list:
        """Connections whose unfinished frame is older than frame_timeout (a slowloris holding
        a connection and a buffer). Idle connections without a partial frame are a hook
        between saves and stay."""
        return [c for c in self.by_fd.values() if c.partial_since is not None
                and now - c.partial_since > self.frame_timeout]

    def still_stalled(self, conn: Connection, now: float) -> bool:
        """After reading it once more: is `conn` open and its frame still unfinished? Then
        it is evicted (counted, logged): the caller closes it."""
        if conn.sock.fileno() in self.by_fd and conn.partial_since is not None \
                and now - conn.partial_since > self.frame_timeout:
            self.evicted["stalled_frame"] += 1
            log.debug("closing connection of pid %d: a frame unfinished for %.0fs",
                      conn.pid, now - conn.partial_since)
            return True
        return False

    def foreign_writer(self, conn: Connection, writer: int) -> None:
        """Bytes on `conn` were written by pid `writer`, not by its peer: counted and logged;
        the caller rejects them and closes the connection."""
        self.evicted["foreign_writer"] += 1
        self.refusals.occurred(
            "foreign_writer", "closing the connection of pid %d: pid %d wrote on it "
            "(a forked child on an inherited connection?)", conn.pid, writer)

    def clear(self) -> None:
        self.by_fd.clear()
        self._per_pid.clear()
        self._per_uid.clear()
