"""A small test receiver for hook events: a real Unix stream socket server in one thread.

It speaks the wire contract of ckptwatch/events.py (FrameReader + decode) and records every
decoded event with the peer's pid from SO_PEERCRED, so tests can see exactly what an agent would.

    with Receiver(path) as rx:
        ... run something that sends events ...
        ends = rx.wait_for(lambda evs: [e for e in evs if e["type"] == "end"], message="end")
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading

from helpers import wait_for
from ckptwatch import events

_PEERCRED = struct.Struct("3i")


class Receiver:
    """Collects events sent to a Unix socket at `path`. start()/stop() may be repeated to
    simulate an agent restart (stop closes every connection, like a dying agent)."""

    def __init__(self, path: str, ack: bool = False):
        self.path = path
        self.ack = ack                     # acknowledge every frame read, as an agent does
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self.rejects: list[str] = []
        self.hellos: list[dict] = []       # connection-opening frames, not events
        self.peer_pids: list[int] = []     # peer pid of each event, parallel to events
        self.connections = 0
        self.closed_peers: list[int] = []  # peer pid of each connection read to its end
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._wake_r = self._wake_w = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "Receiver":
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="test-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._wake_w.send(b"x")
        self._thread.join(5)
        self._thread = None
        self._wake_w.close()
        self._wake_r.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def __enter__(self) -> "Receiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- results ---------------------------------------------------------------------------

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def wait_for(self, predicate, timeout: float = 10.0, message: str = ""):
        """Wait until predicate(events) is truthy; return its value."""
        return wait_for(lambda: predicate(self.events), timeout=timeout,
                        message=message or "events")

    def wait_count(self, kind: str, count: int, timeout: float = 10.0) -> list[dict]:
        """Wait for at least `count` events of type `kind`; return them all."""
        return self.wait_for(lambda evs: len([e for e in evs if e["type"] == kind]) >= count
                             and [e for e in evs if e["type"] == kind],
                             timeout=timeout, message=f"{count} {kind!r} events")

    def wait_drained(self, timeout: float = 10.0) -> None:
        """Wait until every client so far has been read to its end: the positive signal that
        proves an absence once the clients have exited (no event can still be in transit).

        A probe connection of our own tells a client that never got accepted from one not yet
        accepted: connections are accepted in arrival order, so once the probe is seen closed
        every earlier connection has been accepted, and once every accepted connection is
        closed, all their bytes were read."""
        me = os.getpid()
        with self._lock:
            probes = self.closed_peers.count(me)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(self.path)
        probe.close()

        def drained() -> bool:
            with self._lock:
                return (self.closed_peers.count(me) > probes
                        and len(self.closed_peers) == self.connections)
        wait_for(drained, timeout=timeout, message="every client read to its end")

    # ---- server thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        conns: dict[socket.socket, tuple[events.FrameReader, int]] = {}
        try:
            while True:
                for key, _ in sel.select(1.0):
                    if key.data == "wake":
                        return
                    if key.data == "listen":
                        try:
                            conn, _ = self._listener.accept()
                        except BlockingIOError:
                            continue
                        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _PEERCRED.size)
                        pid = _PEERCRED.unpack(creds)[0]
                        conn.setblocking(False)
                        conns[conn] = [events.FrameReader(), pid, 0]
                        sel.register(conn, selectors.EVENT_READ, "conn")
                        with self._lock:
                            self.connections += 1
                        continue
                    conn = key.fileobj
                    reader, pid, _ = conns[conn]
                    try:
                        data = conn.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        if reader.pending():
                            self._reject(events.REJECT_TRUNCATED)
                        sel.unregister(conn)
                        conn.close()
                        del conns[conn]
                        with self._lock:
                            self.closed_peers.append(pid)
                        continue
                    conns[conn][2] += self._feed(reader, data, pid)
                    if self.ack:
                        try:
                            conn.send(events.ack_frame(conns[conn][2]))
                        except OSError:
                            pass
        finally:
            for conn in conns:
                conn.close()
            sel.close()
            self._listener.close()

    def _feed(self, reader: events.FrameReader, data: bytes, pid: int) -> int:
        """Record the frames in `data`; return how many were complete."""
        try:
            payloads = reader.feed(data)
        except events.EventError as exc:
            self._reject(exc.reason)
            return 0
        for payload in payloads:
            try:
                event = events.decode(payload)
            except events.EventError as exc:
                self._reject(exc.reason)
                continue
            with self._lock:
                if event["type"] == "hello":
                    self.hellos.append(event)
                    continue
                self._events.append(event)
                self.peer_pids.append(pid)
        return len(payloads)

    def _reject(self, reason: str) -> None:
        with self._lock:
            self.rejects.append(reason)
