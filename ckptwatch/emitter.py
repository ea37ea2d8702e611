"""In-process event sender: a save's frames go to the kernel from the save path itself.

Loaded into training processes: standard library only. The contract with the caller (the
torch.save hook): nothing here blocks on I/O or raises on the caller's thread.

On record before the first byte (issue 16 item 2). A save's start frame is written to the
agent's socket by the thread that saves, before torch writes the file, and its end frame as
soon as the save returns or raises: record(frame) sends it at once with a non-blocking send
(MSG_DONTWAIT) on the process's connection. Once send() returned, the bytes are in the agent's
socket (a Unix stream socket queues them on the receiver's side): a process that then exits
through os._exit, dies of SIGTERM's default action, SIGKILL or a segfault leaves them behind,
and the agent reads them. record() never waits. It hands the frame to the sender thread's
queue instead (counted in stats()["fallback"], by reason) when:

- "unconnected": there is no connection and none could be made now. The save path connects
  itself when there is none (below), so this means the agent is absent, its socket untrusted,
  or its listen backlog full -- or a connect failed within the backoff (BACKOFF_MIN..MAX).
- "busy": another thread held the connection for longer than BUSY_WAIT (2 ms). Only our own
  threads hold it (the sender thread writing or reading acks, another saving thread), each
  across non-blocking calls only, so a save that finds it taken waits for it -- a thread
  switch, bounded -- rather than leave its frame in user space. A save from a signal handler
  that interrupted a save holding it on the same thread waits the bound and falls back.
- "full": the socket buffer is full (the agent is not reading: stopped, stalled, behind), or
  took only part of the frame (the rest is finished by the sender thread, first in line).
- "behind": frames recorded or queued before this one wait for room in the socket, or more
  than BATCH_MAX of them wait. Otherwise the save path writes the earlier ones itself (a
  job-scope event in the queue, frames to send again after a reconnect) and then its own
  frame: order is kept (a start always goes before its end, everything on a connection in
  the order it was recorded) and the frame does not wait for the sender thread.
- "broken": the send failed (the agent closed the connection or died); the sender reconnects.

What is then at risk: a frame in the queue is in user space until the sender thread writes it
-- it is woken at once (no batching delay), so on a healthy node that is a thread switch, but
while the agent is absent, stalled or not reading it is as long as that lasts. A process that
dies meanwhile takes those frames with it; the queue is bounded (max_queue; beyond, dropped and
counted, and the count is sent as a "dropped" event once the agent is reachable).

Connecting. The save path connects when there is no connection, with a non-blocking connect:
on a Unix stream socket connect() completes at once or fails with EAGAIN (the listener's
backlog is full); it never waits for the agent to accept. So the first save of a process --
a forked or spawned child that saves and exits within milliseconds -- writes the connection's
hello and its start before its first byte like any other save. Nothing connects at install
time: every process that imports torch under `ckptwatch run` (DataLoader workers, compile
workers, torchrun's own agent) would hold a connection to the agent without ever saving. A
failed connect sets the backoff, so a save does not retry an absent agent more than about once
a second; the sender thread retries on the same schedule while it has frames to send.

One connection, two writers. The connection, the frames not completely written (_unsent) and
the frames written but not acknowledged (_unacked) belong to whoever holds _io, a plain lock:
the save path waits BUSY_WAIT at most for it (else "busy"), the sender thread as long as it
takes, and neither holds it across anything that waits (the sender polls for room, and runs the
notice handler, without it). Frames are written in the order they are recorded: whoever holds
the lock moves the queue into _unsent and writes from its head, so the save path writes what
was recorded before its frame, then its frame.

Cost (issue 22; bench/hook_overhead.py, docs/performance.md). Python work on a background
thread while the training thread runs makes the two trade the GIL, and each hand-over costs
the training thread a futex wake-up -- on a virtual machine several times the work handed over.
So the save path builds its frames itself (ckptwatch/hook.py formats them from pre-encoded
parts) and writes them itself; the sender thread has nothing to do while saves go directly, and
wakes only to read acknowledgements (every ACK_POLL while frames wait for one, or when
UNACKED_KICK of them have piled up), for the queue, and to reconnect.

emit() queues a finished frame (bytes), or a dict or (builder, *args) that the sender thread
builds: events that are not a save's own (job scope, drop reports, tests).

Transport: one AF_UNIX SOCK_STREAM connection per process, frames from ckptwatch.events. Every
connection begins with a "hello" frame asking the agent for acknowledgements, and for notices
under the warn policy. The socket is non-blocking: a frame partly written stays first in line,
and the sender thread waits for room (poll, without the GIL or the lock), so no frame is ever
cut short on a live connection and a save never waits for the agent.

Acknowledgements (issue 8, item 9): the agent answers "ack" frames that say how many frames of
this connection it has taken in (handed on to its loop, not merely read off the socket). Frames
written but not acknowledged yet -- by the save path or the sender thread alike -- are kept, at
most MAX_UNACKED (beyond, the oldest is forgotten and counted as "unconfirmed"). When the agent
ends the connection -- it was killed or restarted, or it closed us -- the acknowledgements still
readable are read, and every frame still unacknowledged is sent again first on the next
connection ("resent"). A frame the old agent took in but died before acknowledging is so seen
twice; the agent ignores a write it has already seen while it lives (monitor.detect), and a
record repeated across a restart keeps its id. With an agent that never acknowledges (an older
one), only frames not completely written are sent again.

Fork: a forked child must not write into the parent's connection (the agent checks the peer pid
and the two streams would interleave), and it inherits a copy of the parent's queue with the
parent's events. An at-fork handler gives every Emitter in the child a fresh queue, locks, wake
event, thread and connection, and drops the inherited copy of the parent's socket object without
sending anything on it; the child's first save connects (above).

Notices (the warn policy, ckptwatch.policy): with on_notice set, the sender thread hands it the
notices the agent sends on the connection (wire contract: ckptwatch/events.py). It reads what
the agent sent each time it wakes, and at least every NOTICE_POLL seconds while idle and
connected (ACK_POLL while frames are unacknowledged). Reading never blocks; each frame is
bounded and validated (events.decode_agent_frame), a malformed one is counted and skipped, an
oversized one ends reading on that connection, and on_notice's own failures are counted. A notice
that arrives after the process has exited is lost (the agent reports the collision anyway).

Exit: an atexit handler flushes the queue within flush_timeout (CKPTWATCH_FLUSH_TIMEOUT
overrides) -- but does not wait at all when the agent cannot be reached, so a job without an
agent exits at normal speed; it waits for frames to be written, not for their acknowledgement.
A process that ends without atexit (os._exit, a signal) loses only what was in the queue (see
above). atexit runs handlers last-registered-first: a save made by a handler registered before
this module was imported (i.e. before torch, under the bootstrap) runs after our shutdown and
is dropped.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import os
import select
import socket
import struct
import threading
import time
import weakref

from ckptwatch import events
from ckptwatch import paths
from ckptwatch.identity import identity

FLUSH_TIMEOUT_ENV = "CKPTWATCH_FLUSH_TIMEOUT"
BATCH_MAX = 1024              # frames taken from the queue per turn: bounded work and memory
SEND_CHUNK = 256 * 1024       # bytes offered to one send()
SEND_WAIT = 0.5               # wait this long for room in the socket, then look around again
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
IDLE_WAIT = 5.0               # periodic wake-up; a lost wake-up costs at most this long
NOTICE_POLL = 0.2             # idle wake-up period while notices are read (warn policy)
ACK_POLL = 0.5                # idle wake-up period while frames wait for acknowledgement
AGENT_READS = 4               # recv calls per turn for acks and notices: bounded work
MAX_UNACKED = 4096            # frames kept for resending (~1-2 MB at most)
UNACKED_KICK = 1024           # the save path wakes the sender to read acks at this many
BUSY_WAIT = 0.002             # a save waits at most this long for the connection lock
FALLBACK_REASONS = ("unconnected", "busy", "full", "behind", "broken")
_PEERCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid
_NONBLOCKING = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL

_live: "weakref.WeakSet[Emitter]" = weakref.WeakSet()


class _Hello(bytes):
    """The frame that opens a connection: never sent again on another one."""


class _Report(bytes):
    """A "dropped" report: not one of the caller's events (not counted as sent)."""


def _flush_timeout_from_env(default: float) -> float:
    try:
        value = float(os.environ[FLUSH_TIMEOUT_ENV])
    except (KeyError, ValueError):
        return default
    return value if value >= 0 else default


def _check_peer(sock: socket.socket) -> None:
    """The process listening on a default socket must run as us or as root: a file that
    passed the ownership checks can still be served by another user's process (a listener
    bound elsewhere, or a socket whose owner was changed). Once per connection."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid not in (0, os.getuid()):
        raise OSError(f"agent socket served by uid {uid}")


class Emitter:
    """Bounded, non-blocking event sender to the agent's Unix socket.

    socket_path: an explicit socket (CKPTWATCH_SOCKET), used as given; None: look for the
    agent at every connect attempt among ckptwatch.paths' default sockets, using only one
    that passes the ownership checks there and whose listener runs as us or as root.
    """

    def __init__(self, socket_path: str | None, max_queue: int = 8192, flush_timeout: float = 0.5):
        self.socket_path = socket_path
        self.max_queue = max_queue
        self.flush_timeout = flush_timeout
        self.on_notice = None     # callable(notice dict), run on the sender thread (warn policy)
        self._reset_state()
        _live.add(self)

    def _reset_state(self) -> None:
        # Everything a process must own privately; called again in a forked child.
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        # Only for thread start and the (rare) drop path. Reentrant: a signal handler that saves
        # a checkpoint can interrupt emit() while the main thread holds it.
        self._lock = threading.RLock()
        # The connection and what is written on it (module doc, "One connection, two
        # writers"). Not reentrant: a save from a signal handler that interrupted a save
        # holding it must fail its non-blocking acquire, not write into the middle of a frame.
        self._io = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._idle = True                  # sender is waiting with nothing in flight
        self._unsent: collections.deque = collections.deque()   # frames not fully written
        self._offset = 0                   # bytes of _unsent[0] already written
        self._unacked: collections.deque = collections.deque()  # written, not acknowledged
        self._acked = 0                    # frames of this connection acked or forgotten
        self._acking = False               # the agent acknowledged on this connection
        self._stopping = False
        self._closed = False
        self._flush_gen = 0                # bumped by flush(): connect now, once, ignoring backoff
        self._forced_gen = 0               # the last flush generation a connect was forced for
        self._drained_gen = 0              # the last flush generation the queue was empty for
        self._unreachable = False          # the last connect attempt failed
        self._next_connect = 0.0
        self._backoff = BACKOFF_MIN
        self._sent = 0                     # event frames completely written (again if resent)
        self._direct = 0                   # of which written by record() on the caller's thread
        self._fallback = dict.fromkeys(FALLBACK_REASONS, 0)   # record()s handed to the thread
        self._resent = 0                   # frames sent again after the agent ended a connection
        self._unconfirmed = 0              # frames forgotten before any acknowledgement
        self._dropped = 0                  # total dropped (queue full, too large, after close)
        self._dropped_reported = 0         # part of _dropped already sent to the agent
        self._errors = 0
        self._agent_reader = events.FrameReader(events.MAX_NOTICE_BYTES)
        self._agent_frames_off = False     # this connection sent an oversized frame
        # Notices read, and skipped (see module doc); not in stats().
        self.notices = {"read": 0, "malformed": 0, "oversized": 0, "errors": 0}

    # ---- caller side (the save path) -------------------------------------------------------

    def record(self, frame: bytes) -> None:
        """Write a save's finished frame (events.frame) to the agent's socket now, from the
        caller's thread, without waiting; if it cannot go now, queue it for the sender thread
        (module doc: the reasons, and what is then at risk). Never blocks, never raises."""
        io = self._io
        # Held only by our own threads, across non-blocking calls (module doc, "busy"): a
        # holder is a thread switch from releasing it, so waiting BUSY_WAIT at most keeps the
        # frame out of user space. A save from a signal handler that interrupted its own
        # thread's hold waits the bound and falls back.
        if not io.acquire(False) and not io.acquire(True, BUSY_WAIT):
            self._fall_back(frame, "busy")
            return
        try:
            sock = self._sock
            if sock is None:
                reason = self._connect_and_write(frame)
            elif self._unsent or self._queue:
                reason = self._write_after_earlier(frame)
            else:
                try:
                    written = sock.send(frame, _NONBLOCKING)
                except (BlockingIOError, InterruptedError):
                    reason = "full"
                except OSError:
                    reason = "broken"    # the sender finds the connection gone and reconnects
                else:
                    if written == len(frame):
                        # self._written(frame), inline: this is the save path's common case
                        self._direct += 1
                        self._sent += 1
                        unacked = self._unacked
                        unacked.append(frame)
                        count = len(unacked)
                        if count > MAX_UNACKED or count == UNACKED_KICK:
                            self._many_unacked()
                        return
                    # Part of it is in the socket: the rest goes before anything else.
                    self._unsent.append(frame)
                    self._offset = written
                    self._fallback["full"] += 1
                    reason = None
        except Exception:
            self._errors += 1
            reason = "broken"
        finally:
            io.release()
        if self._thread is None:
            self._start()        # after the frame: a thread start is not evidence
        if reason is not None:
            self._fall_back(frame, reason)
        elif self._idle:
            self._wake.set()

    def _many_unacked(self) -> None:
        # Under _io, after record() wrote a frame directly: forget the oldest beyond
        # MAX_UNACKED (as _written does), and wake the sender to read acks at UNACKED_KICK.
        unacked = self._unacked
        if len(unacked) > MAX_UNACKED:
            unacked.popleft()
            self._acked += 1
            if self._acking:
                self._unconfirmed += 1
        if len(unacked) == UNACKED_KICK and self._idle:
            self._wake.set()     # time to read acks (module doc, "Cost")

    def _connect_and_write(self, frame: bytes) -> str | None:
        """record() without a connection (under _io): connect without waiting, then write the
        hello and the frame. The fallback reason, or None once the frame is written or in
        _unsent."""
        if self._closed or not self._connect_locked(forced=False):
            return "unconnected"
        return self._write_after_earlier(frame)

    def _write_after_earlier(self, frame: bytes) -> str | None:
        """record() while frames recorded before this one still wait -- a new connection's
        hello, job-scope events in the queue, frames to send again, a frame the full socket
        took in part (under _io): the caller's thread writes them, then the frame, so it never
        waits in user space for a thread switch ("behind" in the module doc used to mean
        that). None once the frame is written, or in _unsent behind frames the socket has no
        room for (counted "full", or "broken" when the connection is gone; the sender thread
        finishes); "behind" when more than BATCH_MAX wait: the sender's work, bounded here."""
        self._fill()
        unsent = self._unsent
        if self._queue or len(unsent) >= BATCH_MAX:
            return "behind"
        unsent.append(frame)
        try:
            done = self._send()
        except OSError:
            done = False
            self._fallback["broken"] += 1   # the sender finds the connection gone, sends again
        else:
            if not done:
                self._fallback["full" if unsent[0] is frame else "behind"] += 1
        if done:
            self._direct += 1
        return None

    def _fall_back(self, frame: bytes, reason: str) -> None:
        self._fallback[reason] += 1
        self.emit(frame)

    def emit(self, event) -> None:
        """Queue one event for the sender thread. Never blocks on I/O, never raises.

        `event` is a finished frame (bytes, events.frame), a dict, or a tuple (builder, *args)
        for which the sender thread calls builder(*args) to get the dict or the frame.
        """
        try:
            if self._thread is None:
                self._start()
            queue = self._queue
            if len(queue) >= self.max_queue or self._closed:
                self._count_drop()
                return
            queue.append(event)
            if self._idle:
                self._wake.set()
        except Exception:
            self._errors += 1

    def _count_drop(self) -> None:
        with self._lock:
            self._dropped += 1

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            thread = threading.Thread(target=self._run, name="ckptwatch-emitter", daemon=True)
            self._thread = thread   # before start(): a re-entrant emit must not start another
            thread.start()

    # ---- control ---------------------------------------------------------------------------

    def _drained(self) -> bool:
        return self._idle and not self._queue and not self._unsent

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued event is written to the agent's socket. False on timeout
        or when the agent cannot be reached (then it returns at once instead of waiting out
        the timeout)."""
        timeout = self.flush_timeout if timeout is None else timeout
        thread = self._thread
        if thread is None or not thread.is_alive():
            return not self._queue and not self._unsent
        deadline = time.monotonic() + timeout
        self._unreachable = False
        self._flush_gen += 1
        self._wake.set()
        while True:
            if self._drained():
                return True
            if self._unreachable or not thread.is_alive():
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def shutdown(self, timeout: float | None = None, join_timeout: float = SEND_WAIT + 1.0
                 ) -> bool:
        """Flush within timeout, then stop the thread and close the connection. Idempotent.
        Returns whether everything queued was sent."""
        if self._closed:
            return not self._queue and not self._unsent
        ok = self.flush(timeout)
        self._closed = True
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)
        if thread is None or not thread.is_alive():
            # Otherwise the sender is still inside a send on this socket; closing the fd
            # under it could hand the number to another file. It closes it when it stops.
            with self._io:
                self._close_socket()
        return ok

    def stats(self) -> dict:
        """Counters for tests and diagnostics. direct: frames record() wrote on the caller's
        thread; fallback: record()s handed to the sender thread instead (by reason)."""
        return {"sent": self._sent, "dropped": self._dropped, "queued": len(self._queue),
                "connected": self._sock is not None, "errors": self._errors,
                "unacked": len(self._unacked), "resent": self._resent,
                "unconfirmed": self._unconfirmed, "direct": self._direct,
                "fallback": dict(self._fallback)}

    # ---- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:
                # A bug here must not kill the sender for good; count it and carry on.
                self._errors += 1
                with self._io:
                    self._connection_lost()
                time.sleep(BACKOFF_MIN)
        if self._sock is not None:
            self._read_agent()  # what already arrived; nothing is waited for at exit
        with self._io:
            self._close_socket()

    def _has_work(self) -> bool:
        return bool(self._queue or self._unsent or self._dropped > self._dropped_reported)

    def _step(self) -> None:
        if self._sock is not None and not self._read_agent():
            with self._io:
                self._connection_lost()
        if not self._has_work():
            self._drained_gen = self._flush_gen    # every flush() asked so far is served
            self._idle = True
            self._wake.clear()
            # Re-check after clear: an emit() between the check above and clear() saw
            # _idle False and did not set the event.
            if not self._has_work() and not self._stopping:
                self._wake.wait(self._idle_wait())
            self._idle = False
            return
        io = self._io
        if self._sock is None:
            with io:
                forced = self._flush_gen != self._forced_gen
                self._forced_gen = self._flush_gen
                connected = self._connect_locked(forced)
            if not connected:
                self._wait_backoff()
                return
        with io:
            self._fill()
            try:
                done = self._send()
                lost = False
            except OSError:
                lost = True
        if lost:
            # The agent ended the connection (killed, restarted, or it closed us): take the
            # acknowledgements still readable, then everything unacknowledged goes again.
            self._read_agent()
            with io:
                self._connection_lost()
        elif not done:
            self._wait_writable()

    def _idle_wait(self) -> float:
        if self._sock is None:
            return IDLE_WAIT
        wait = IDLE_WAIT
        if self._unacked:
            wait = ACK_POLL
        if self.on_notice is not None:
            wait = min(wait, NOTICE_POLL)
        return wait

    def _fill(self) -> None:
        """Move into _unsent (under _io): a drop report, then queued events, built where
        needed."""
        pending_drops = self._dropped - self._dropped_reported
        if pending_drops > 0:
            report = {"v": events.SCHEMA_VERSION, "type": "dropped",
                      "node": identity()["node"], "pid": os.getpid(), "count": pending_drops}
            self._unsent.append(_Report(events.encode(report)))
            self._dropped_reported += pending_drops
        queue, unsent = self._queue, self._unsent
        while queue and len(unsent) < BATCH_MAX:
            self._add(queue.popleft())

    def _add(self, event) -> None:
        try:
            if type(event) is tuple:
                event = event[0](*event[1:])
            self._unsent.append(event if type(event) is bytes else events.encode(event))
        except Exception:
            # Too large for one frame, not JSON-serialisable, or a failing builder:
            # dropped and counted.
            self._count_drop()

    def _send(self) -> bool:
        """Write what the socket takes, frames in order (under _io); True once _unsent is
        empty, False when the socket is full. OSError: the connection is gone."""
        unsent, sock = self._unsent, self._sock
        while unsent:
            first = unsent[0]
            parts = [first[self._offset:] if self._offset else first]
            size = len(parts[0])
            for frame in itertools.islice(unsent, 1, None):
                if size >= SEND_CHUNK:
                    break
                parts.append(frame)
                size += len(frame)
            try:
                written = sock.send(b"".join(parts) if len(parts) > 1 else parts[0],
                                    _NONBLOCKING)
            except (BlockingIOError, InterruptedError):
                return False
            written += self._offset
            while unsent and written >= len(unsent[0]):
                frame = unsent.popleft()
                written -= len(frame)
                self._written(frame)
            self._offset = written
        return True

    def _written(self, frame: bytes) -> None:
        # Under _io.
        if type(frame) is bytes:
            self._sent += 1
        unacked = self._unacked
        unacked.append(frame)
        if len(unacked) > MAX_UNACKED:
            unacked.popleft()
            self._acked += 1
            if self._acking:
                self._unconfirmed += 1

    def _wait_writable(self) -> None:
        # Without the GIL or _io; flush(), shutdown() and new events do not need to cut this
        # short: the socket is full, nothing can be sent before the agent reads.
        try:
            poller = select.poll()      # poll, not select: descriptors above 1023 exist
            poller.register(self._sock, select.POLLOUT)
            poller.poll(SEND_WAIT * 1000)
        except (OSError, ValueError, TypeError):
            pass

    def _read_agent(self) -> bool:
        """Take the acknowledgements and notices waiting on the connection. Never blocks.
        False when the agent has ended the connection. Sender thread only: the save path
        never closes the socket, so it is read without _io."""
        sock = self._sock
        if sock is None:
            return False
        try:
            for _ in range(AGENT_READS):
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return True
                if not data:
                    return False
                if self._agent_frames_off:
                    continue
                try:
                    payloads = self._agent_reader.feed(data)
                except events.EventError:
                    self.notices["oversized"] += 1
                    self._agent_frames_off = True
                    continue
                for payload in payloads:
                    self._agent_frame(payload)
            return True
        except OSError:
            return False

    def _agent_frame(self, payload: bytes) -> None:
        kind, value = events.decode_agent_frame(payload)
        if kind == "ack":
            with self._io:
                self._acknowledged(value)
        elif kind == "notice":
            handler = self.on_notice
            if handler is None:
                return
            self.notices["read"] += 1
            try:
                handler(value)
            except Exception:
                self.notices["errors"] += 1
        else:
            self.notices["malformed"] += 1

    def _acknowledged(self, count: int) -> None:
        """The agent has taken in the first `count` frames of this connection (under _io)."""
        self._acking = True
        unacked = self._unacked
        done = min(count - self._acked, len(unacked))
        if done <= 0:
            return
        if done == len(unacked):
            unacked.clear()
        else:
            popleft = unacked.popleft
            for _ in range(done):
                popleft()
        self._acked += done

    def _connection_lost(self) -> None:
        """Close; what must go again goes first on the next connection (module doc). Under
        _io."""
        if self._sock is None:
            return
        self._close_socket()
        again = [f for f in self._unacked if type(f) is not _Hello] if self._acking else []
        self._unsent.extendleft(reversed(again))
        self._resent += len(again)
        self._offset = 0
        if self._unsent and type(self._unsent[0]) is _Hello:
            self._unsent.popleft()      # a hello not fully written: the next one replaces it
        self._unacked.clear()
        self._acked = 0
        self._acking = False

    def _connect_locked(self, forced: bool) -> bool:
        """Connect without waiting (module doc, "Connecting"), under _io: True when connected
        (now or already), with the hello first in line."""
        if self._sock is not None:
            return True
        if time.monotonic() < self._next_connect and not forced:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            path = self.socket_path or paths.find_socket()
            if path is None:
                raise OSError("no trusted agent socket")
            sock.connect(path)      # at once, or EAGAIN: the listener's backlog is full
            if self.socket_path is None:
                _check_peer(sock)
        except OSError:
            sock.close()
            self._unreachable = True
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return False
        self._sock = sock
        self._agent_reader = events.FrameReader(events.MAX_NOTICE_BYTES)
        self._agent_frames_off = False
        self._unreachable = False
        self._backoff = BACKOFF_MIN
        self._unsent.appendleft(_Hello(events.hello_frame(
            identity()["node"], os.getpid(), notices=self.on_notice is not None)))
        return True

    def _wait_backoff(self) -> None:
        delay = self._next_connect - time.monotonic()
        if delay > 0 and not self._stopping:
            # A flush() bumps _flush_gen and sets the event to make us retry at once.
            self._wake.clear()
            if self._flush_gen == self._forced_gen:
                self._wake.wait(delay)

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _after_fork_in_child(self) -> None:
        # The parent's connection object is inherited as a copy of the fd. Detach without
        # shutdown() (which would end the parent's stream too) and close only our copy.
        sock = self._sock
        if sock is not None:
            try:
                os.close(sock.detach())
            except OSError:
                pass
        closed = self._closed
        self._reset_state()
        self._closed = closed


_singleton: Emitter | None = None
_singleton_lock = threading.RLock()


def get_emitter() -> Emitter:
    """The process's emitter: to CKPTWATCH_SOCKET, else to the first trusted default socket
    (ckptwatch.paths), looked up again at each connect. Created on first use."""
    global _singleton
    emitter = _singleton
    if emitter is None:
        with _singleton_lock:
            if _singleton is None:
                _singleton = Emitter(os.environ.get(paths.SOCKET_ENV) or None,
                                     flush_timeout=_flush_timeout_from_env(0.5))
            emitter = _singleton
    return emitter


def _after_fork_in_child() -> None:
    global _singleton_lock
    _singleton_lock = threading.RLock()
    for emitter in list(_live):
        emitter._after_fork_in_child()


def _shutdown_all() -> None:
    for emitter in list(_live):
        try:
            # The thread is a daemon: at exit, do not wait for a send stuck on a slow agent
            # beyond the flush bound.
            emitter.shutdown(_flush_timeout_from_env(emitter.flush_timeout), join_timeout=0.1)
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown_all)
