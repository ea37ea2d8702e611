"""Agent-side socket server: receives framed events, validates them, reports rejects.

One background thread multiplexes every connection with `selectors` over non-blocking sockets;
each connection has its own FrameReader, so one client's garbage never touches another's
stream. Transport and framing are described in ckptwatch/events.py; payloads are decoded by
monitor/ingest/codec.py (the contract's decoder, with orjson when installed).

Each event's pid is checked against the kernel's peer credentials (SO_PEERCRED) of the
connection it arrived on, so a process cannot report writes on behalf of another. The kernel
translates the peer pid into the agent's pid namespace. A trainer in its own pid namespace (a
container without hostPID) reports the pid it sees itself, so the claim is also accepted when it
equals the peer's innermost namespace pid (the last field of NSpid in /proc/<pid>/status).
The kernel names the connecting process once (SO_PEERCRED), but a forked child inherits the
connection and could go on speaking as its parent, even after the parent exited. So the socket
also asks for per-message credentials (SO_PASSCRED): every read returns the pid of the process
that wrote those bytes (the kernel never merges two writers' bytes into one read, and only
CAP_SYS_ADMIN can claim another pid). Bytes written by any process other than the peer are
rejected ("pid_mismatch") and the connection is closed: its stream is no longer one writer's
frames. The hook needs no change for this (a child re-connects after fork).
Accepted events then carry the agent-side pid: two containers can both have a pid 1, and the
agent-side pid is unique on the node and can be checked for liveness. An agent in a pid
namespace that cannot see the trainers at all gets peer pid 0 and rejects every event as
"pid_mismatch" (run it with hostPID: true on Kubernetes).

Callbacks run on the server thread: on_event(event) for every valid event, on_reject(reason)
(reason from ckptwatch.events.REJECT_REASONS) for every rejected input. They should be quick.
With on_events(list) instead, valid events come in one list per socket read: one hand-off
per few hundred events is what lets the agent keep up at tens of thousands of events/s.

Acknowledgements: a connection whose hello frame asked for them ("ack": true) is told, with an
"ack" frame (ckptwatch/events.py), how many of its frames the agent has taken in. Taken in
means handed on AND processed by the consumer: with processed(), the number of on_events
batches the consumer has finished, each read's frames are acknowledged once the batch holding
them is finished (frames rejected or without events once every earlier batch is). So frames
still in the socket or in the agent's queue when it is killed are not acknowledged, and the
hook sends them again to the next agent. At most one ack per connection per ACK_INTERVAL
(a burst of reads makes one ack); non-blocking, and a dropped ack is covered by the next one
(cumulative).

Notices (the other thing the agent sends back): notify(pid, frame) queues a notice frame for
the open connections of `pid` that asked for notices (a hello or an event with "notices": true;
ckptwatch/events.py). The server thread sends them — it owns the sockets, so a connection
closed meanwhile is never written to under a recycled fd — with a non-blocking send: a notice
that does not fit the peer's socket buffer is dropped and counted, and a partly sent one is
finished before any other (at most one frame waits per connection), so the agent never waits
on a hook that does not read. The queue is bounded (MAX_NOTICES; beyond, dropped and counted).

Back-pressure: with backlog() and max_backlog, the server stops reading while the consumer
has more than max_backlog events waiting. The senders' sockets then fill, their background
threads wait, and their bounded queues drop and count — the agent's memory stays bounded and
no save ever waits.
"""
from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections import deque
from typing import Callable

from ckptwatch import events, paths
from monitor.ingest import codec
from monitor.ingest.throttle import ThrottledWarning
from monitor.verify.rights import Rights, peer_rights

log = logging.getLogger("ckptwatch.ingest")

_PEERCRED = struct.Struct("3i")     # struct ucred: pid, uid, gid
_CRED_SPACE = socket.CMSG_SPACE(_PEERCRED.size)    # room for one SCM_CREDENTIALS per read
_CHUNK = 256 * 1024                 # bytes per recv: thousands of small events per syscall
_READS_PER_TURN = 8                 # then serve other connections (fairness)
_BACKLOG = 4096                     # the kernel caps it at net.core.somaxconn
MAX_NOTICES = 256                   # notice frames waiting for the server thread
ACK_INTERVAL = 0.05                 # at most one ack per connection this often (seconds)
_MAX_RECEIPTS = 256                 # unacknowledged reads remembered per connection
# Agent-side field set on every accepted event: the sender's credentials (monitor.verify.rights), from
# the kernel, never from the wire (a client's own field of this name is overwritten).
RIGHTS = "agent_rights"


class IngestError(RuntimeError):
    """The ingest socket cannot be set up; the message says why and what to do."""


class AgentAlreadyRunning(IngestError):
    """Another agent is alive and answering on the socket path."""


def namespace_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """The pid that `pid` has inside its own (innermost) pid namespace, or None if unknown."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


# Job-scope events ("remote", "hazard", "jobscope": ckptwatch/events.py) speak about other
# processes and cannot be checked, so each connection may send only so many: a token bucket
# of JOB_SCOPE_BURST refilled at JOB_SCOPE_RATE per second; the rest are rejected as
# "rate_limited". A hook reports at most ~64 remote writes per save of its own.
JOB_SCOPE_RATE = 64.0
JOB_SCOPE_BURST = 512.0


class _Conn:
    __slots__ = ("sock", "pid", "uid", "ns_pid", "rights", "reader", "last_active",
                 "partial_since", "tokens", "tokens_at", "wants_notices", "unsent",
                 "wants_acks", "frames", "receipts", "ackable", "acked", "acked_at")

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int, now: float):
        self.sock = sock
        self.pid = pid
        self.uid = uid
        # What the peer may read (monitor.verify.rights) and what it calls itself when it lives in a
        # nested pid namespace (else == pid): one read of /proc/<pid>/status per connection.
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
        # once the consumer has finished that batch (module doc, "Acknowledgements").
        self.receipts: deque = deque()
        self.ackable = 0                     # frames taken in (the consumer finished them)
        self.acked = 0                       # the last count acknowledged
        self.acked_at = -1e9

    def take_token(self, now: float) -> bool:
        self.tokens = min(JOB_SCOPE_BURST, self.tokens + (now - self.tokens_at) * JOB_SCOPE_RATE)
        self.tokens_at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def _last_active(conn: _Conn) -> float:
    return conn.last_active


REFUSE_REASONS = ("pid_limit", "uid_limit")          # a new connection closed at once
# An open connection closed by the agent; foreign_writer: bytes from a process other than
# the one that connected (a forked child on an inherited connection).
EVICT_REASONS = ("make_room", "stalled_frame", "foreign_writer")


class IngestServer:
    """Unix stream socket server feeding validated events to on_event."""

    def __init__(self, path: str, on_event: Callable[[dict], None],
                 on_reject: Callable[[str], None], socket_mode: int = 0o660,
                 socket_group: int | str | None = None, max_connections: int = 1024,
                 on_events: Callable[[list], None] | None = None,
                 backlog: Callable[[], int] | None = None, max_backlog: int = 200_000,
                 max_per_pid: int = 16, max_per_uid: int = 256, frame_timeout: float = 30.0,
                 log_interval: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 processed: Callable[[], int] | None = None):
        if min(max_per_pid, max_per_uid, max_connections) < 1:
            raise ValueError("connection limits must be >= 1, got "
                             f"{max_per_pid}, {max_per_uid}, {max_connections}")
        self.path = path
        self._on_event = on_event
        self._on_events = on_events
        self._backlog = backlog
        self._max_backlog = max_backlog
        self._on_reject = on_reject
        self._mode = socket_mode
        self._group = socket_group
        self._max_connections = max_connections
        self.max_per_uid = min(max_per_uid, max_connections)
        self.max_per_pid = min(max_per_pid, self.max_per_uid)
        self._frame_timeout = frame_timeout
        self._clock = clock
        self._per_pid: dict[int, int] = {}
        self._per_uid: dict[int, int] = {}
        self._refusals = ThrottledWarning(log, "connections refused or evicted",
                                          log_interval, clock)
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None   # (st_dev, st_ino) of our socket file
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.errors_total = 0          # unexpected errors, logged and survived
        # New connections refused at a per-peer cap, and open ones the agent closed (see
        # _accept and _sweep_stalled); exported as ckptwatch_ingest_connections_*_total.
        self.refused: dict[str, int] = {reason: 0 for reason in REFUSE_REASONS}
        self.evicted: dict[str, int] = {reason: 0 for reason in EVICT_REASONS}
        # Notices (see module doc): waiting frames, and what became of them.
        self._notices: deque = deque()
        self.notices: dict[str, int] = {"sent": 0, "dropped": 0, "no_reader": 0}
        # Acknowledgements (see module doc): on_events batches handed on so far, the
        # consumer's count of those it finished, the connections owed an ack.
        self._handed = 0
        self._processed = processed
        self._owed: set = set()
        self.acks: dict[str, int] = {"sent": 0, "deferred": 0}

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket and start serving. Raises AgentAlreadyRunning or IngestError."""
        self._prepare_path()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Inherited by every accepted socket: credentials on each message (see module doc).
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            listener.bind(self.path)
            st = os.lstat(self.path)
            self._identity = (st.st_dev, st.st_ino)
            os.chmod(self.path, self._mode)
            if self._group is not None:
                os.chown(self.path, -1, self._resolve_group(self._group))
            listener.listen(_BACKLOG)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            self._unlink_if_ours()
            raise IngestError(f"cannot listen on {self.path}: {exc.strerror or exc}") from exc
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name="ckptwatch-ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection, join the thread, remove the socket file if still ours."""
        if self._thread is None:
            return
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        self._thread = None
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._selector.close()
        self._listener = self._wake_r = self._wake_w = self._selector = None
        self._unlink_if_ours()

    @property
    def connections(self) -> int:
        """Currently connected clients (for a gauge)."""
        return len(self._conns)

    def socket_intact(self) -> bool:
        """Is the file at our path still the socket we bound? False once it was removed or
        replaced (by anyone who could write the directory): hooks would then send elsewhere."""
        if self._identity is None:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    @property
    def alive(self) -> bool:
        """True while the server thread runs; /healthz reports unhealthy otherwise."""
        return self._thread is not None and self._thread.is_alive()

    def notify(self, pid: int, frame: bytes) -> None:
        """Queue a notice frame for `pid`'s connections (any thread; see module doc)."""
        if len(self._notices) >= MAX_NOTICES:
            self.notices["dropped"] += 1
            return
        self._notices.append((pid, frame))
        try:
            self._wake_w.send(b"n")
        except (OSError, AttributeError):
            pass        # not serving (stopped): the frame is dropped with the server

    # --- socket path -------------------------------------------------------------------------

    def _prepare_path(self) -> None:
        # Trust (ckptwatch.paths.directory_problem): a directory another user can change lets
        # them replace our socket and receive every event; one they own, or a symbolic link,
        # may have been planted before we started. Refuse, never repair someone else's.
        directory = os.path.dirname(self.path) or "."
        self._make_directory(directory)
        uid = os.geteuid()
        problem = paths.directory_problem(directory, uid)
        if problem is not None:
            raise IngestError(
                f"refusing socket directory: {problem}. Use a directory owned by the agent's "
                "user (or root) that no other user can write (0700; 0750, or 1770 with the "
                "sticky bit, for a --ingest.socket-group), or choose another --ingest.socket")
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise IngestError(f"{self.path} exists and is not a socket; refusing to replace it "
                              "(remove it yourself or choose another --ingest.socket)")
        if st.st_uid not in (uid, 0):
            raise IngestError(f"{self.path} is owned by uid {st.st_uid}, not by the agent's "
                              f"uid {uid} or root; refusing to use or remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            # Nobody listens: a socket left by an agent that died without cleaning up.
            log.info("replacing stale socket %s", self.path)
            os.unlink(self.path)
            return
        except OSError as exc:
            if exc.errno == errno.EAGAIN:   # backlog full: someone is listening
                raise AgentAlreadyRunning(self._already_running_message()) from exc
            raise IngestError(f"cannot tell whether {self.path} is in use: "
                              f"{exc.strerror or exc}") from exc
        finally:
            probe.close()
        raise AgentAlreadyRunning(self._already_running_message())

    def _make_directory(self, directory: str) -> None:
        """Create the socket directory if missing: 0700, or 0750 and our group with
        --ingest.socket-group, or 0755 when the socket mode lets others connect."""
        try:
            os.lstat(directory)
            return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise IngestError(f"cannot inspect socket directory {directory}: "
                              f"{exc.strerror or exc}") from exc
        mode = 0o750 if self._group is not None else 0o700
        if self._mode & 0o006:
            mode |= 0o005
        try:
            os.makedirs(os.path.dirname(directory) or ".", mode=0o755, exist_ok=True)
            os.mkdir(directory, 0o700)     # then widened: never more open than meant, even
            if self._group is not None:    # for a moment
                os.chown(directory, -1, self._resolve_group(self._group))
            os.chmod(directory, mode)
        except FileExistsError:
            pass                # created meanwhile by someone: the trust check decides
        except OSError as exc:
            raise IngestError(f"cannot create socket directory {directory}: "
                              f"{exc.strerror or exc}") from exc

    def _already_running_message(self) -> str:
        return (f"another ckptwatch agent is already listening on {self.path}; stop it first "
                "or choose another --ingest.socket")

    def _unlink_if_ours(self) -> None:
        # Only remove the file we created: a newer agent may have replaced it meanwhile.
        if self._identity is None:
            return
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove socket %s: %s", self.path, exc)
        self._identity = None

    @staticmethod
    def _resolve_group(group: int | str) -> int:
        if isinstance(group, int):
            return group
        import grp
        try:
            return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise OSError(errno.EINVAL, f"unknown group {group!r}") from None

    # --- server thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        select_timeout = min(1.0, self._frame_timeout / 2)
        next_sweep = self._clock() + select_timeout
        while not self._stopping.is_set():
            if self._owed:
                try:
                    self._send_acks()
                except Exception:
                    self._unexpected("sending acks failed")
            if self._backed_up():
                self._stopping.wait(0.005)      # let the consumer catch up (see module doc)
                continue
            try:
                ready = self._selector.select(
                    timeout=ACK_INTERVAL if self._owed else select_timeout)
            except Exception:
                self._unexpected("select failed")
                continue
            readable = []
            for key, _ in ready:
                sock = key.fileobj
                try:
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._drain_wakeup()
                    else:
                        readable.append(key.data)
                except Exception:
                    self._unexpected("connection handling failed")
                    if key.data is not None:
                        self._close(key.data)
            # Least recently read first, and no further once backed up (checked per
            # connection here and per chunk in _read): one turn over many busy connections
            # must not queue past the limit, and the ones a turn skips come first in the next
            # (epoll reports ready connections in the same order every time: without this a
            # flood's connections would always be read first and a hook's starve).
            readable.sort(key=_last_active)
            for conn in readable:
                if self._backed_up():
                    break
                try:
                    self._read(conn)
                except Exception:
                    self._unexpected("connection handling failed")
                    self._close(conn)
            if self._notices:
                try:
                    self._send_notices()
                except Exception:
                    self._unexpected("sending notices failed")
            now = self._clock()
            if now >= next_sweep:
                next_sweep = now + select_timeout
                try:
                    self._sweep_stalled(now)
                    self._refusals.tick(now)
                except Exception:
                    self._unexpected("connection sweep failed")

    def _send_acks(self) -> None:
        """Acknowledge what the consumer has finished, to every connection owed an ack and
        not acknowledged within ACK_INTERVAL (see module doc)."""
        now = self._clock()
        done = self._processed() if self._processed is not None else self._handed
        for conn in list(self._owed):
            if self._conns.get(conn.sock.fileno()) is not conn:
                self._owed.discard(conn)        # closed meanwhile
                continue
            receipts = conn.receipts
            while receipts and receipts[0][0] <= done:
                conn.ackable = receipts.popleft()[1]
            if conn.ackable > conn.acked and now - conn.acked_at >= ACK_INTERVAL:
                if self._send_frame(conn, events.ack_frame(conn.ackable)):
                    conn.acked, conn.acked_at = conn.ackable, now
                    self.acks["sent"] += 1
                else:
                    self.acks["deferred"] += 1  # no room now: a later one says it all
            if not receipts and conn.ackable == conn.acked:
                self._owed.discard(conn)

    def _receipt(self, conn: _Conn) -> None:
        """Frames read from `conn` up to now count as taken in once the batch handed on last
        (if any) is finished."""
        if not conn.wants_acks:
            return
        receipts = conn.receipts
        if receipts and (receipts[-1][0] == self._handed or len(receipts) >= _MAX_RECEIPTS):
            # The same batch, or too many waiting: the newest one covers both (acknowledged
            # later, never sooner, than each would be).
            receipts[-1] = (self._handed, conn.frames)
        else:
            receipts.append((self._handed, conn.frames))
        self._owed.add(conn)

    def _send_notices(self) -> None:
        while self._notices:
            pid, frame = self._notices.popleft()
            targets = [c for c in self._conns.values() if c.pid == pid and c.wants_notices]
            if not targets:
                self.notices["no_reader"] += 1
            for conn in targets:
                self._send_notice(conn, frame)

    def _send_notice(self, conn: _Conn, frame: bytes) -> None:
        if self._send_frame(conn, frame):
            self.notices["sent"] += 1
        else:
            self.notices["dropped"] += 1

    def _send_frame(self, conn: _Conn, frame: bytes) -> bool:
        """Send a frame to a hook without waiting: False if none of it could go now."""
        # A partly sent frame goes first, or the hook's stream would no longer be frames.
        if conn.unsent:
            rest = self._send_some(conn, conn.unsent)
            conn.unsent = rest or b""
            if rest is None or rest:
                return False
        rest = self._send_some(conn, frame)
        if rest is None or len(rest) == len(frame):
            return False
        conn.unsent = rest
        return True

    @staticmethod
    def _send_some(conn: _Conn, data: bytes) -> bytes | None:
        """What is left of `data` after one non-blocking send; None if the socket failed."""
        try:
            sent = conn.sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return data
        except OSError:
            return None     # the peer is gone; the read side notices and closes it
        return data[sent:]

    def _backed_up(self) -> bool:
        return self._backlog is not None and self._backlog() > self._max_backlog

    def _drain_wakeup(self) -> None:
        try:
            self._wake_r.recv(4096)
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:      # EMFILE and friends: log, keep serving the others
                self._unexpected(f"accept failed: {exc}", exc_info=False)
                return
            try:
                pid, uid, gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
                sock.setblocking(False)
            except OSError as exc:      # the peer vanished already
                log.debug("dropping connection without credentials: %s", exc)
                sock.close()
                continue
            reason = self._over_peer_cap(pid, uid)
            if reason is not None:
                self.refused[reason] += 1
                self._refusals.occurred(
                    reason, "refusing connection from pid %d uid %d: %s (%d open for the pid, "
                    "%d for the uid)", pid, uid, reason, self._per_pid.get(pid, 0),
                    self._per_uid.get(uid, 0))
                sock.close()
                continue
            if len(self._conns) >= self._max_connections:
                self._make_room()
            conn = _Conn(sock, pid, uid, gid, self._clock())
            self._conns[sock.fileno()] = conn
            self._per_pid[pid] = self._per_pid.get(pid, 0) + 1
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _over_peer_cap(self, pid: int, uid: int) -> str | None:
        # A hook holds one connection per process; the caps leave the rest of the agent to
        # everyone else (docs/decisions.md, "Connection caps").
        if self._per_pid.get(pid, 0) >= self.max_per_pid:
            return "pid_limit"
        if self._per_uid.get(uid, 0) >= self.max_per_uid:
            return "uid_limit"
        return None

    def _make_room(self) -> None:
        """The agent is full: close the least recently active connection of the uid holding
        the most, rather than refuse a newcomer. Only runs at the cap, O(connections)."""
        top_uid = max(self._per_uid, key=self._per_uid.__getitem__)
        victim = min((c for c in self._conns.values() if c.uid == top_uid),
                     key=lambda c: (c.reader.pending(), c.last_active))
        self.evicted["make_room"] += 1
        self._refusals.occurred("make_room", "connection cap %d reached: closing the oldest "
                                "idle connection of uid %d (pid %d), which holds %d",
                                self._max_connections, top_uid, victim.pid,
                                self._per_uid[top_uid])
        if victim.reader.pending():
            self._reject(events.REJECT_TRUNCATED)
        self._close(victim)

    def _sweep_stalled(self, now: float) -> None:
        """Close connections whose unfinished frame is older than frame_timeout (a slowloris
        holding a connection and a buffer). Idle connections without a partial frame are a
        hook between saves and stay. Each one is read first: the agent may have paused
        reading (back-pressure) while the rest of the frame waited in the socket."""
        for conn in [c for c in self._conns.values() if c.partial_since is not None
                     and now - c.partial_since > self._frame_timeout]:
            self._read(conn)
            if conn.sock.fileno() in self._conns and conn.partial_since is not None \
                    and now - conn.partial_since > self._frame_timeout:
                self.evicted["stalled_frame"] += 1
                log.debug("closing connection of pid %d: a frame unfinished for %.0fs",
                          conn.pid, now - conn.partial_since)
                self._reject(events.REJECT_TRUNCATED)
                self._close(conn)

    def _read(self, conn: _Conn) -> None:
        for _ in range(_READS_PER_TURN):
            try:
                data, ancillary, _flags, _addr = conn.sock.recvmsg(_CHUNK, _CRED_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:             # ECONNRESET etc.: same as a close
                data, ancillary = b"", ()
            if ancillary and data and self._foreign_writer(conn, ancillary):
                return
            if not data:
                if conn.reader.pending():
                    self._reject(events.REJECT_TRUNCATED)
                self._close(conn)
                return
            try:
                payloads = conn.reader.feed(data)
            except events.EventError as exc:
                # A bad length: the rest of the stream cannot be framed any more. Frames that
                # were complete before it in this chunk are still good events.
                self._deliver(conn, exc.payloads)
                self._reject(exc.reason)
                self._close(conn)
                return
            conn.frames += len(payloads)
            conn.last_active = now = self._clock()
            if not conn.reader.pending():
                conn.partial_since = None
            elif payloads or conn.partial_since is None:
                conn.partial_since = now
            self._deliver(conn, payloads)
            self._receipt(conn)
            if len(data) < _CHUNK or self._backed_up():
                return

    def _foreign_writer(self, conn: _Conn, ancillary) -> bool:
        """Were these bytes written by a process other than the connection's peer? Then
        reject them and close the connection (see module doc)."""
        for level, kind, data in ancillary:
            if level != socket.SOL_SOCKET or kind != socket.SCM_CREDENTIALS \
                    or len(data) < _PEERCRED.size:
                continue
            writer = _PEERCRED.unpack_from(data)[0]
            if writer == conn.pid or writer == 0:   # 0: bytes that carry no credentials
                return False
            self.evicted["foreign_writer"] += 1
            self._refusals.occurred(
                "foreign_writer", "closing the connection of pid %d: pid %d wrote on it "
                "(a forked child on an inherited connection?)", conn.pid, writer)
            self._reject(events.REJECT_PID_MISMATCH)
            self._close(conn)
            return True
        return False

    def _deliver(self, conn: _Conn, payloads: list) -> None:
        good = []
        for event in codec.decode_many(payloads):
            if type(event) is not dict:
                self._reject(event.reason)
                continue
            claimed = event["pid"]
            if claimed != conn.pid or conn.pid <= 0:
                if conn.pid <= 0 or claimed != conn.ns_pid:
                    self._reject(events.REJECT_PID_MISMATCH)
                    continue
                event["pid"] = conn.pid  # the node-unique, agent-visible pid (see module doc)
            if event["type"] in events.JOB_SCOPE_TYPES and not conn.take_token(self._clock()):
                self._reject(events.REJECT_RATE_LIMITED)
                continue
            if event["type"] == "hello":    # a connection property, not an event
                conn.wants_acks = conn.wants_acks or event.get("ack") is True
                conn.wants_notices = conn.wants_notices or event.get("notices") is True
                continue
            if "source" in event:
                del event["source"]     # the socket speaks for the hook only: no claiming "fs"
            if "notices" in event:
                if event["notices"] is True:
                    conn.wants_notices = True
                del event["notices"]    # a connection property, not the write's
            event[RIGHTS] = conn.rights
            good.append(event)
        if not good:
            return
        if self._on_events is not None:
            self._handed += 1
            try:
                self._on_events(good)
            except Exception:
                self._unexpected("on_events callback failed")
            return
        for event in good:
            try:
                self._on_event(event)
            except Exception:
                self._unexpected("on_event callback failed")

    def _reject(self, reason: str) -> None:
        try:
            self._on_reject(reason)
        except Exception:
            self._unexpected("on_reject callback failed")

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is conn:
            for counts, key in ((self._per_pid, conn.pid), (self._per_uid, conn.uid)):
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _unexpected(self, what: str, exc_info: bool = True) -> None:
        self.errors_total += 1
        log.error("ingest: %s", what, exc_info=exc_info)
