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

Callbacks run on the server thread: on_events(list) with the valid events, one list per
socket read (one hand-off per few hundred events is what lets the agent keep up at tens of
thousands of events/s), on_reject(reason) (reason from ckptwatch.events.REJECT_REASONS) for
every rejected input. They should be quick.

Acknowledgements: a connection whose hello frame asked for them ("ack": true) is told, with an
"ack" frame (ckptwatch/events.py), how many of its frames the agent has taken in. Taken in
means handed on AND processed by the consumer: with processed(), the number of on_events
batches the consumer has finished, each read's frames are acknowledged once the batch holding
them is finished (frames rejected or without events once every earlier batch is). So frames
still in the socket or in the agent's queue when it is killed are not acknowledged, and the
hook sends them again to the next agent. At most one ack per connection per ACK_INTERVAL
(a burst of reads makes one ack); non-blocking, and a dropped ack is covered by the next one
(cumulative).

Notices (the other thing the agent sends back): notify(pid, frame, writes) queues a notice
frame for the open connections of `pid` that asked for notices (a hello or an event with
"notices": true; ckptwatch/events.py) AND whose own start, end or hazard frames named one of
`writes`, the (seq, path) pairs the notice is about. A notice thus only ever reaches the
connection that made the write: never a process that reused a dead writer's pid, never one a
"remote" report named (those are not its frames), never another connection of the same
process that did not make the write. Each connection remembers its last
MAX_WRITES_REMEMBERED writes (monitor/ingest/connections.py). The server thread sends them — it owns the sockets, so a connection
closed meanwhile is never written to under a recycled fd — with a non-blocking send: a notice
that does not fit the peer's socket buffer is dropped and counted, and a partly sent one is
finished before any other (at most one frame waits per connection), so the agent never waits
on a hook that does not read. The queue is bounded (MAX_NOTICES; beyond, dropped and counted).

Queries (the resume guard): a "query" frame is not an event; on_query(query, rights) builds
its answer on this thread from the agent's table of verdicts, and it is sent at once like a
notice (never waiting). Queries share a connection's job-scope token bucket: a flood of them
is answered at that rate, the rest not at all (the guard then goes on without an answer).

Back-pressure: with backlog() and max_backlog, the server stops reading while the consumer
has more than max_backlog events waiting. The senders' sockets then fill, their background
threads wait, and their bounded queues drop and count — the agent's memory stays bounded and
no save ever waits.

Reading pace (read_pause, READ_PAUSE by default): after a turn that read from a connection,
the server waits until read_pause has passed since that turn began before it selects again.
Every frame a hook sends wakes a reader waiting on its socket, and that wake-up is paid in the
sender's system time, on the save path (two sends per save: start and end). A reader that is
not waiting costs the sender nothing, so pausing between turns makes the frames that arrive
meanwhile ride on one wake-up (issue 22, docs/decisions.md "Ingest reads at a pace"). The
evidence is unchanged: every frame is in the kernel (the socket) when the hook's send returns,
and a sender's death still leaves it there. What the pause costs is latency: a frame that
arrives on an established connection while the server pauses is read up to read_pause later
(1 ms); the first frame after an idle moment is read at once, and a turn that took longer
than read_pause is followed by no pause at all (so a busy agent reads as fast as before). A
pause waits on the listener and the wake pipe only: a new connection (a resume guard's query,
which has CKPTWATCH_LOAD_WAIT_MS, 5 ms by default, for its answer; a new process's hello), a
notice to send or the stop request ends it, and a turn that accepted a connection is followed
by no pause, so a new connection's first frames are read at once.

Hang-ups (with hangups=True, as the agent runs it): when a peer ends its side of a connection
(its process exited or was killed: the kernel closes a dying process's sockets), on_events gets
one more batch, [{"type": HANGUP, "pid": peer pid, "mono", "wall"}], the agent's clocks when the
end of the stream was read, after every event of that connection. The detector takes it as the
last time that process is known alive (monitor.detect.detector, Detector.hung_up). It is made
here, never decoded: no sender can send one (an unknown type is rejected).

The socket file's ownership and trust rules are monitor/ingest/socketfile.py; the connections'
caps, eviction and stalled frames are monitor/ingest/connections.py. This module is the server
thread: accept, read, deliver, acknowledge, send notices.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from typing import Callable

from ckptwatch import events
from monitor.ingest import codec
from monitor.ingest.connections import Connection, Connections, last_active, write_key
from monitor.ingest.socketfile import AgentAlreadyRunning, IngestError, SocketFile

# start() raises the errors (refused and evicted count by monitor.ingest.connections' reasons).
__all__ = ["IngestServer", "IngestError", "AgentAlreadyRunning", "RIGHTS", "MAX_NOTICES",
           "ACK_INTERVAL", "HANGUP"]

HANGUP = "hangup"           # the event type of a peer's hang-up (see module doc, "Hang-ups")

log = logging.getLogger("ckptwatch.ingest")

_PEERCRED = struct.Struct("3i")     # struct ucred: pid, uid, gid
_CRED_SPACE = socket.CMSG_SPACE(_PEERCRED.size)    # room for one SCM_CREDENTIALS per read
_CHUNK = 256 * 1024                 # bytes per recv: thousands of small events per syscall
_READS_PER_TURN = 8                 # then serve other connections (fairness)
_BACKLOG = 4096                     # the kernel caps it at net.core.somaxconn
MAX_NOTICES = 256                   # notice frames waiting for the server thread
ACK_INTERVAL = 0.05                 # at most one ack per connection this often (seconds)
READ_PAUSE = 0.001                  # seconds from a turn that read to the next select
_MAX_RECEIPTS = 256                 # unacknowledged reads remembered per connection
# The frames that name a write of the sender's own: a notice may be about one of those.
_OWN_WRITE_TYPES = frozenset({"start", "end", "hazard"})
# Agent-side field set on every accepted event: the sender's credentials (monitor.verify.rights), from
# the kernel, never from the wire (a client's own field of this name is overwritten).
RIGHTS = "agent_rights"


class IngestServer:
    """Unix stream socket server feeding validated events to on_events."""

    def __init__(self, path: str, on_events: Callable[[list], None],
                 on_reject: Callable[[str], None], socket_mode: int = 0o660,
                 socket_group: int | str | None = None, max_connections: int = 1024,
                 backlog: Callable[[], int] | None = None, max_backlog: int = 200_000,
                 max_per_pid: int = 16, max_per_uid: int = 256, frame_timeout: float = 30.0,
                 log_interval: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 processed: Callable[[], int] | None = None, hangups: bool = False,
                 on_query: Callable[[dict, object], bytes | None] | None = None,
                 read_pause: float = READ_PAUSE):
        self._hangups = hangups
        self._read_pause = max(0.0, float(read_pause))
        self._conns = Connections(max_connections, max_per_pid, max_per_uid, frame_timeout,
                                  log_interval, clock)
        self.path = path
        self._file = SocketFile(path, socket_mode, socket_group)
        self._on_events = on_events
        self._backlog = backlog
        self._max_backlog = max_backlog
        self._on_reject = on_reject
        # on_query(query, rights) -> answer frame: a resume guard's "query" (ckptwatch/
        # events.py), answered here on the server thread (monitor/agent/verdictbook.py).
        self._on_query = on_query
        self._clock = clock
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._pause_selector: selectors.BaseSelector | None = None   # listener + wake pipe
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.errors_total = 0          # unexpected errors, logged and survived
        # Connections refused and evicted, by reason (monitor/ingest/connections.py).
        self.refused = self._conns.refused
        self.evicted = self._conns.evicted
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
        self._file.prepare()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Inherited by every accepted socket: credentials on each message (see module doc).
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._file.bind(listener)
            listener.listen(_BACKLOG)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            self._file.unlink_if_ours()
            raise IngestError(f"cannot listen on {self.path}: {exc.strerror or exc}") from exc
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        # What a pause waits on: a new connection or the wake pipe ends it; the established
        # connections are not watched, so their frames wake nobody (module doc).
        self._pause_selector = selectors.DefaultSelector()
        self._pause_selector.register(listener, selectors.EVENT_READ, None)
        self._pause_selector.register(self._wake_r, selectors.EVENT_READ, None)
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
        for conn in list(self._conns.by_fd.values()):
            conn.sock.close()
        self._conns.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._selector.close()
        self._pause_selector.close()
        self._listener = self._wake_r = self._wake_w = self._selector = None
        self._pause_selector = None
        self._file.unlink_if_ours()

    @property
    def connections(self) -> int:
        """Currently connected clients (for a gauge)."""
        return len(self._conns)

    @property
    def max_per_pid(self) -> int:
        return self._conns.max_per_pid

    @property
    def max_per_uid(self) -> int:
        return self._conns.max_per_uid

    def socket_intact(self) -> bool:
        """Is the file at our path still the socket we bound? False once it was removed or
        replaced (by anyone who could write the directory): hooks would then send elsewhere."""
        return self._file.intact()

    @property
    def alive(self) -> bool:
        """True while the server thread runs; /healthz reports unhealthy otherwise."""
        return self._thread is not None and self._thread.is_alive()

    def notify(self, pid: int, frame: bytes, writes) -> None:
        """Queue a notice frame for the connections of `pid` that made one of `writes`
        ((seq, path) pairs) and asked for notices (any thread; see module doc)."""
        if len(self._notices) >= MAX_NOTICES:
            self.notices["dropped"] += 1
            return
        self._notices.append((pid, frame, frozenset(write_key(seq, path)
                                                    for seq, path in writes)))
        try:
            self._wake_w.send(b"n")
        except (OSError, AttributeError):
            pass        # not serving (stopped): the frame is dropped with the server

    # --- server thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        select_timeout = min(1.0, self._conns.frame_timeout / 2)
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
            turn_began = time.monotonic()
            readable = []
            accepted = False
            for key, _ in ready:
                sock = key.fileobj
                try:
                    if sock is self._listener:
                        accepted = True
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
            readable.sort(key=last_active)
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
                    self._conns.refusals.tick(now)
                except Exception:
                    self._unexpected("connection sweep failed")
            if readable and self._read_pause and not accepted:
                self._pause(turn_began)

    def _pause(self, turn_began: float) -> None:
        """Wait out the rest of read_pause from `turn_began` (module doc, "Reading pace"):
        frames sent meanwhile stay in the kernel and wake nobody."""
        rest = turn_began + self._read_pause - time.monotonic()
        if rest > 0 and not self._stopping.is_set():
            try:
                self._pause_selector.select(rest)   # a new connection or a stop ends it
            except Exception:
                self._stopping.wait(rest)

    def _send_acks(self) -> None:
        """Acknowledge what the consumer has finished, to every connection owed an ack and
        not acknowledged within ACK_INTERVAL (see module doc)."""
        now = self._clock()
        done = self._processed() if self._processed is not None else self._handed
        for conn in list(self._owed):
            if not self._conns.is_open(conn):
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

    def _receipt(self, conn: Connection) -> None:
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
            pid, frame, keys = self._notices.popleft()
            targets = [c for c in self._conns.by_fd.values()
                       if c.pid == pid and c.wants_notices
                       and not keys.isdisjoint(c.writes)]
            if not targets:
                self.notices["no_reader"] += 1
            for conn in targets:
                self._send_notice(conn, frame)

    def _send_notice(self, conn: Connection, frame: bytes) -> None:
        if self._send_frame(conn, frame):
            self.notices["sent"] += 1
        else:
            self.notices["dropped"] += 1

    def _send_frame(self, conn: Connection, frame: bytes) -> bool:
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
    def _send_some(conn: Connection, data: bytes) -> bytes | None:
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
            if self._conns.refuse(pid, uid):
                sock.close()
                continue
            if self._conns.full():
                self._make_room()
            conn = self._conns.add(sock, pid, uid, gid, self._clock())
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _make_room(self) -> None:
        """At the total cap: close the connection monitor/ingest/connections.py chooses."""
        victim = self._conns.make_room()
        if victim.reader.pending():
            self._reject(events.REJECT_TRUNCATED)
        self._close(victim)

    def _sweep_stalled(self, now: float) -> None:
        """Close connections whose unfinished frame is older than frame_timeout. Each one is
        read first: the agent may have paused reading (back-pressure) while the rest of the
        frame waited in the socket."""
        for conn in self._conns.stalled(now):
            self._read(conn)
            if self._conns.still_stalled(conn, now):
                self._reject(events.REJECT_TRUNCATED)
                self._close(conn)

    def _read(self, conn: Connection) -> None:
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
                self._hung_up(conn)
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

    def _foreign_writer(self, conn: Connection, ancillary) -> bool:
        """Were these bytes written by a process other than the connection's peer? Then
        reject them and close the connection (see module doc)."""
        for level, kind, data in ancillary:
            if level != socket.SOL_SOCKET or kind != socket.SCM_CREDENTIALS \
                    or len(data) < _PEERCRED.size:
                continue
            writer = _PEERCRED.unpack_from(data)[0]
            if writer == conn.pid or writer == 0:   # 0: bytes that carry no credentials
                return False
            self._conns.foreign_writer(conn, writer)
            self._reject(events.REJECT_PID_MISMATCH)
            self._close(conn)
            return True
        return False

    def _deliver(self, conn: Connection, payloads: list) -> None:
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
            if event["type"] == "query":    # answered here, never an event
                self._answer(conn, event)
                continue
            if "source" in event:
                del event["source"]     # the socket speaks for the hook only: no claiming "fs"
            if "notices" in event:
                if event["notices"] is True:
                    conn.wants_notices = True
                del event["notices"]    # a connection property, not the write's
            if conn.wants_notices and event["type"] in _OWN_WRITE_TYPES:
                conn.made(event["seq"], event["path"])    # see module doc, "Notices"
            event[RIGHTS] = conn.rights
            good.append(event)
        if not good:
            return
        self._handed += 1
        try:
            self._on_events(good)
        except Exception:
            self._unexpected("on_events callback failed")

    def _hung_up(self, conn: Connection) -> None:
        """The peer ended the connection: one hang-up batch (see module doc, "Hang-ups")."""
        if not self._hangups or conn.pid <= 0:
            return
        self._handed += 1           # a batch like any other, for the acknowledgements' count
        try:
            self._on_events([{"type": HANGUP, "pid": conn.pid, "mono": self._clock(),
                              "wall": time.time()}])
        except Exception:
            self._unexpected("on_events callback failed")

    def _answer(self, conn: Connection, query: dict) -> None:
        if self._on_query is None or not conn.take_token(self._clock()):
            return          # no answer: the guard's wait ends, the load goes on
        try:
            frame = self._on_query(query, conn.rights)
        except Exception:
            self._unexpected("on_query callback failed")
            return
        if frame is not None:
            self._send_frame(conn, frame)

    def _reject(self, reason: str) -> None:
        try:
            self._on_reject(reason)
        except Exception:
            self._unexpected("on_reject callback failed")

    def _close(self, conn: Connection) -> None:
        self._conns.remove(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _unexpected(self, what: str, exc_info: bool = True) -> None:
        self.errors_total += 1
        log.error("ingest: %s", what, exc_info=exc_info)
