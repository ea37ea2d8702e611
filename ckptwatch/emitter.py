"""In-process event sender: a bounded queue drained by one background thread.

Loaded into training processes: standard library only. The contract with the caller (the
torch.save hook) is that emit() never blocks and never raises: it appends to a deque and, only
when the sender thread is idle, sets an Event to wake it. Everything slow — JSON encoding,
connecting, sending — happens in the sender thread.

Transport: one AF_UNIX SOCK_STREAM connection per process, frames from ckptwatch.events.encode.
The connection is made lazily and re-made with backoff when the agent is absent or restarted;
events queued meanwhile are delivered once it is back, up to the queue bound. When the queue is
full new events are dropped and counted, and the count is sent as a "dropped" event once the
agent is reachable.

Fork: a forked child must not write into the parent's connection (the agent checks the peer pid
and the two streams would interleave), and it inherits a copy of the parent's queue with the
parent's events. An at-fork handler gives every Emitter in the child a fresh queue, lock, wake
event, thread and connection, and drops the inherited copy of the parent's socket object without
sending anything on it.

Notices (the warn policy, ckptwatch.policy): with on_notice set, the sender thread also reads
what the agent sends back on the connection — notices about unsafe saves (wire contract:
ckptwatch/events.py) — each time it wakes, and at most NOTICE_POLL seconds apart while idle
and connected. Reading never blocks (poll first, then recv); each frame is bounded and
validated (events.decode_notice), a malformed one is counted and skipped, an oversized one
ends notice reading on that connection, and on_notice's own failures are counted. So a notice
is acted on within NOTICE_POLL of its arrival while the process lives; one that arrives after
the process has exited is lost (the agent reports the collision anyway).

Exit: an atexit handler flushes within flush_timeout (CKPTWATCH_FLUSH_TIMEOUT overrides) — but
does not wait at all when the agent cannot be reached, so a job without an agent exits at
normal speed. Processes that end with os._exit (e.g. multiprocessing children) skip atexit and
lose whatever the sender had not sent yet. atexit runs handlers last-registered-first: a save
made by a handler registered before this module was imported (i.e. before torch, under the
bootstrap) runs after our flush and is dropped.
"""
from __future__ import annotations

import atexit
import collections
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
BATCH_MAX = 1024              # frames per sendall: one syscall for a burst, bounded memory
SEND_TIMEOUT = 2.0            # an agent that stops reading must not wedge the sender forever
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
IDLE_WAIT = 5.0               # periodic wake-up; a lost wake-up costs at most this long
LINGER = 0.02                 # collect events this long before sending (end-to-end latency)
NOTICE_POLL = 0.2             # idle wake-up period while notices are read (warn policy)
NOTICE_READS = 4              # recv calls per wake-up: bounded work per turn
_PEERCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid

_live: "weakref.WeakSet[Emitter]" = weakref.WeakSet()


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
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._idle = True                  # sender is waiting with nothing in flight
        self._batch: list[bytes] = []      # frames taken from the queue, not yet sent
        self._batch_dropped = 0            # the dropped count carried by the current batch
        self._stopping = False
        self._closed = False
        self._flush_gen = 0                # bumped by flush(): connect now, once, ignoring backoff
        self._forced_gen = 0               # the last flush generation a connect was forced for
        self._drained_gen = 0              # the last flush generation the queue was empty for
        self._unreachable = False          # the last connect attempt failed
        self._next_connect = 0.0
        self._backoff = BACKOFF_MIN
        self._sent = 0
        self._dropped = 0                  # total dropped (queue full, too large, after close)
        self._dropped_reported = 0         # part of _dropped already sent to the agent
        self._errors = 0
        self._notice_reader = events.FrameReader(events.MAX_NOTICE_BYTES)
        self._notices_off = False          # this connection sent an oversized frame
        # Notices read, and skipped (see module doc); not in stats(), whose fields are fixed.
        self.notices = {"read": 0, "malformed": 0, "oversized": 0, "errors": 0}

    # ---- caller side (the save path) -------------------------------------------------------

    def emit(self, event) -> None:
        """Queue one event for sending. Never blocks on I/O, never raises.

        `event` is a dict, or a tuple (builder, *args) for which the sender thread calls
        builder(*args) to get the dict or the finished frame (events.frame) — this keeps
        building and encoding off the caller's hot path.
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
        return self._idle and not self._queue and not self._batch

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued event is sent. False on timeout or when the agent cannot be
        reached (then it returns at once instead of waiting out the timeout)."""
        timeout = self.flush_timeout if timeout is None else timeout
        thread = self._thread
        if thread is None or not thread.is_alive():
            return not self._queue
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

    def shutdown(self, timeout: float | None = None, join_timeout: float = SEND_TIMEOUT + 1.0
                 ) -> bool:
        """Flush within timeout, then stop the thread and close the connection. Idempotent.
        Returns whether everything queued was sent."""
        if self._closed:
            return not self._queue and not self._batch
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
            self._close_socket()
        return ok

    def stats(self) -> dict:
        """Counters for tests and diagnostics."""
        return {"sent": self._sent, "dropped": self._dropped, "queued": len(self._queue),
                "connected": self._sock is not None, "errors": self._errors}

    # ---- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:
                # A bug here must not kill the sender for good; count it and carry on.
                self._errors += 1
                self._close_socket()
                time.sleep(BACKOFF_MIN)
        self._read_notices()    # what already arrived; nothing is waited for at exit
        self._close_socket()

    def _has_work(self) -> bool:
        return bool(self._queue or self._batch or self._dropped > self._dropped_reported)

    def _step(self) -> None:
        if self.on_notice is not None:
            self._read_notices()
        if not self._has_work():
            self._drained_gen = self._flush_gen    # every flush() asked so far is served
            self._idle = True
            self._wake.clear()
            # Re-check after clear: an emit() between the check above and clear() saw
            # _idle False and did not set the event.
            if not self._has_work() and not self._stopping:
                reading = self.on_notice is not None and self._sock is not None
                self._wake.wait(NOTICE_POLL if reading else IDLE_WAIT)
            self._idle = False
            self._linger()
            return
        if self._sock is None and not self._connect():
            self._wait_backoff()
            return
        if not self._batch:
            self._fill_batch()
            if not self._batch:
                return
        try:
            self._sock.sendall(b"".join(self._batch), socket.MSG_NOSIGNAL)
        except OSError:
            # Keep the batch: it is sent again on the next connection (agent restarted).
            self._errors += 1
            self._close_socket()
            return
        self._sent += len(self._batch) - (1 if self._batch_dropped else 0)
        self._dropped_reported += self._batch_dropped
        self._batch = []
        self._batch_dropped = 0
        if len(self._queue) < BATCH_MAX:
            # What came in during the send is a few frames: gather more before the next.
            self._linger()

    def _read_notices(self) -> None:
        """Hand every complete notice waiting on the connection to on_notice. Never blocks."""
        sock, handler = self._sock, self.on_notice
        if sock is None or handler is None or self._notices_off:
            return
        try:
            # The socket has a timeout, so recv would wait for data: poll first (poll, not
            # select, which fails on descriptors above 1023).
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            for _ in range(NOTICE_READS):
                if not poller.poll(0):
                    return
                data = sock.recv(65536)
                if not data:
                    return      # the agent closed; the next send notices and reconnects
                try:
                    payloads = self._notice_reader.feed(data)
                except events.EventError:
                    self.notices["oversized"] += 1
                    self._notices_off = True
                    return
                for payload in payloads:
                    notice = events.decode_notice(payload)
                    if notice is None:
                        self.notices["malformed"] += 1
                        continue
                    self.notices["read"] += 1
                    try:
                        handler(notice)
                    except Exception:
                        self.notices["errors"] += 1
        except (OSError, ValueError):
            return

    def _linger(self) -> None:
        # Wait LINGER before sending, so that one wake-up and one sendall serve many saves:
        # each wake-up takes the GIL from the saving thread, and the sender's work done once
        # per save costs the training process several times what the save path does.
        # flush() and shutdown() cut the linger short, and it is skipped while a flush waits.
        self._wake.clear()
        if not self._stopping and self._flush_gen == self._drained_gen:
            self._wake.wait(LINGER)

    def _fill_batch(self) -> None:
        frames = []
        pending_drops = self._dropped - self._dropped_reported
        if pending_drops > 0:
            report = {"v": events.SCHEMA_VERSION, "type": "dropped",
                      "node": identity()["node"], "pid": os.getpid(), "count": pending_drops}
            frames.append(events.encode(report))
            self._batch_dropped = pending_drops
        queue = self._queue
        while queue and len(frames) < BATCH_MAX:
            event = queue.popleft()
            try:
                if type(event) is tuple:
                    event = event[0](*event[1:])
                frames.append(event if type(event) is bytes else events.encode(event))
            except Exception:
                # Too large for one frame, not JSON-serialisable, or a failing builder:
                # dropped and counted.
                self._count_drop()
        self._batch = frames

    def _connect(self) -> bool:
        forced = self._flush_gen != self._forced_gen
        if time.monotonic() < self._next_connect and not forced:
            return False
        self._forced_gen = self._flush_gen
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SEND_TIMEOUT)
        try:
            path = self.socket_path or paths.find_socket()
            if path is None:
                raise OSError("no trusted agent socket")
            sock.connect(path)
            if self.socket_path is None:
                _check_peer(sock)
        except OSError:
            sock.close()
            self._unreachable = True
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return False
        self._sock = sock
        self._notice_reader = events.FrameReader(events.MAX_NOTICE_BYTES)
        self._notices_off = False
        self._unreachable = False
        self._backoff = BACKOFF_MIN
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
