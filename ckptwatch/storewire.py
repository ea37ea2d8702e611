"""A client of torch's TCPStore, spoken from the standard library (socket, select).

Loaded into training processes: standard library only. Job scope (ckptwatch/jobscope.py) uses
it instead of torch.distributed.TCPStore because a C++ store call made from a Python thread can
neither be bounded nor interrupted: a blocked call outlives its timeout, and one that returns
while the interpreter shuts down aborts the whole process ("terminate called without an active
exception", issue 17). Here every operation has a deadline of our own, nothing blocks outside
select.poll with that deadline, and every value read is bounded as it is read.

The wire format (torch/csrc/distributed/c10d/TCPStoreBackend.hpp and Utils.hpp; the same for the
libuv and the classic server): a command is one byte (QueryType), a key or value is a u64
length and its bytes, numbers are native-endian (little on every platform torch supports). A
connection first sends VALIDATE with the magic number (a server that does not know it closes
the connection), then PING with a nonce that the server echoes: a server that does not echo it
is not one we know, and job scope turns itself off instead of guessing.

Commands used, and their replies:
  APPEND key value      -> nothing            (the write announcements: no reply to wait for)
  GET key               -> value              (an absent key: empty; the server never waits)
  ADD key i64           -> i64                (the exit count)
  COMPARE_SET key e n   -> value              (compaction of a path's log)
  DELETE_KEY key        -> i64
  PING u32              -> u32

Sending is split so that the save path can hand a frame to the kernel without ever waiting:
push() takes the send lock only if it is free, writes what the socket takes at once
(non-blocking) and keeps the rest for the next sender; request() (the job-scope thread) sends
what is kept first, then its own command, then reads its reply. Frames never interleave (one
lock), and replies stay in order because only request() sends commands that have one.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
PING = 13
VALIDATION_MAGIC = 0x3C85F7CE

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

MAX_KEY_BYTES = 4096            # the server refuses keys over 8 KiB; ours are < 100 bytes
MAX_OUT_BYTES = 1 << 20         # frames kept for the next sender; beyond, push() drops
CHUNK = 65536


class StoreError(Exception):
    """The store cannot be used (unreachable, too slow, not a TCPStore we know, or it sent
    more than we read). The connection is closed; `reason` is a short fixed text."""

    def __init__(self, reason: str, permanent: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent      # retrying cannot help: the server is not one we know


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def frame(command: int, *parts) -> bytes:
    """One command: its byte, then each part (bytes: length-prefixed; int: an i64)."""
    out = [_U8.pack(command)]
    for part in parts:
        out.append(_I64.pack(part) if isinstance(part, int) else _string(part))
    return b"".join(out)


def append_frame(key: str, value: bytes) -> bytes:
    return frame(APPEND, key.encode("utf-8", "surrogatepass"), value)


class StoreClient:
    """One connection to a TCPStore. connect() and request() are for one thread (job scope's);
    push() may be called from any thread and never waits."""

    def __init__(self, host: str, port: int, *, op_timeout: float = 5.0,
                 clock=time.monotonic):
        self.host, self.port = host, int(port)
        self.op_timeout = op_timeout
        self._clock = clock
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._out = bytearray()
        self.pushed_dropped = 0
        self.ops = 0                 # commands sent (pushes included)
        self.bytes_out = 0
        self.bytes_in = 0

    # ---- connection ---------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, timeout: float) -> None:
        """Connect, validate, and check the server echoes a ping; StoreError otherwise."""
        deadline = self._clock() + timeout
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as exc:
            raise StoreError(f"unreachable ({type(exc).__name__})") from None
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self._sock = sock
        nonce = (id(self) ^ int(self._clock() * 1e6)) & 0xFFFFFFFF
        self._send_now(_U8.pack(VALIDATE) + _U32.pack(VALIDATION_MAGIC)
                       + _U8.pack(PING) + _U32.pack(nonce), deadline)
        try:
            echoed = _U32.unpack(self._recv_exact(4, deadline))[0]
        except StoreError as exc:
            # Silent or closed: a busy server, or one that refused our validation -- retried
            # (within the caller's budget), then given up with this reason.
            self.close()
            raise StoreError(f"no answer to the handshake ({exc.reason})") from None
        if echoed != nonce:
            self.close()
            raise StoreError("not a TCPStore server of a protocol we know (bad ping echo)",
                             permanent=True)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # ---- sending ------------------------------------------------------------------------

    def push(self, data: bytes) -> bool:
        """Hand a reply-less frame to the kernel without waiting: True when it is sent or kept
        for the next sender, False when the lock is busy or there is no connection (the caller
        queues it for the thread instead). Never raises, never blocks."""
        if self._sock is None or not self._lock.acquire(blocking=False):
            return False
        try:
            if len(self._out) + len(data) > MAX_OUT_BYTES:
                self.pushed_dropped += 1
                return True
            self._out += data
            self.ops += 1
            self._flush_some()
            return True
        finally:
            self._lock.release()

    def _flush_some(self) -> None:
        sock = self._sock
        if sock is None or not self._out:
            return
        try:
            n = sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return                      # the thread's next request finds the error
        self.bytes_out += n
        del self._out[:n]

    def send(self, data: bytes, deadline: float | None = None) -> None:
        """Send a reply-less frame from the job-scope thread (waits up to the deadline)."""
        self._request(data, None, deadline)

    def request(self, data: bytes, reply, deadline: float | None = None):
        """Send a command and read its reply with reply(self, deadline)."""
        return self._request(data, reply, deadline)

    def _request(self, data: bytes, reply, deadline):
        if self._sock is None:
            raise StoreError("not connected")
        if deadline is None:
            deadline = self._clock() + self.op_timeout
        if not self._lock.acquire(timeout=max(0.0, deadline - self._clock())):
            raise StoreError("timed out")
        try:
            self._out += data
            self.ops += 1
            out, self._out = bytes(self._out), bytearray()
            self._send_now(out, deadline)
        finally:
            self._lock.release()
        return reply(self, deadline) if reply is not None else None

    def _send_now(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            sock = self._wait(select.POLLOUT, deadline)
            try:
                n = sock.send(view)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                self.close()
                raise StoreError(f"send failed ({type(exc).__name__})") from None
            self.bytes_out += n
            view = view[n:]

    # ---- receiving ----------------------------------------------------------------------

    def _wait(self, events: int, deadline: float) -> socket.socket:
        sock = self._sock
        if sock is None:
            raise StoreError("not connected")
        remaining = deadline - self._clock()
        if remaining <= 0:
            self.close()
            raise StoreError("timed out")
        poller = select.poll()
        poller.register(sock, events)
        if not poller.poll(remaining * 1000.0):
            self.close()
            raise StoreError("timed out")
        return sock

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            sock = self._wait(select.POLLIN, deadline)
            try:
                chunk = sock.recv(min(CHUNK, n - len(buf)))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                self.close()
                raise StoreError(f"receive failed ({type(exc).__name__})") from None
            if not chunk:
                self.close()
                raise StoreError("connection closed by the store")
            self.bytes_in += len(chunk)
            buf += chunk
        return bytes(buf)

    def read_i64(self, deadline: float) -> int:
        return _I64.unpack(self._recv_exact(8, deadline))[0]

    def read_value(self, deadline: float, limit: int, budget: int):
        """A value as bytes, or None when it is longer than `limit` (its bytes are read and
        thrown away, up to `budget`; a longer one closes the connection: StoreError)."""
        size = _U64.unpack(self._recv_exact(8, deadline))[0]
        if size <= limit:
            return self._recv_exact(size, deadline)
        if size > budget:
            self.close()
            raise StoreError("the store sent a value over our read budget")
        left = size
        while left:
            left -= len(self._recv_exact(min(CHUNK, left), deadline))
        return None

    # ---- commands -----------------------------------------------------------------------

    def append(self, key: str, value: bytes, deadline: float | None = None) -> None:
        self.send(append_frame(key, value), deadline)

    def get(self, key: str, limit: int, budget: int, deadline: float | None = None):
        """The key's value (b"" when absent), None when longer than `limit`."""
        return self.request(frame(GET, _key(key)),
                            lambda c, d: c.read_value(d, limit, budget), deadline)

    def add(self, key: str, amount: int, deadline: float | None = None) -> int:
        return self.request(frame(ADD, _key(key), amount), lambda c, d: c.read_i64(d),
                            deadline)

    def compare_set(self, key: str, expected: bytes, desired: bytes, limit: int,
                    budget: int, deadline: float | None = None):
        return self.request(frame(COMPARE_SET, _key(key), expected, desired),
                            lambda c, d: c.read_value(d, limit, budget), deadline)

    def delete_key(self, key: str, deadline: float | None = None) -> int:
        return self.request(frame(DELETE_KEY, _key(key)), lambda c, d: c.read_i64(d),
                            deadline)


def _key(key: str) -> bytes:
    data = key.encode("utf-8", "surrogatepass")
    if len(data) > MAX_KEY_BYTES:
        raise StoreError("key too long")
    return data
