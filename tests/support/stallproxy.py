"""A TCP proxy in front of a job's store that can stall (hold every byte, both ways) and recover:
a store that stops answering for a while, as an overloaded or paused master does.

Real sockets on loopback; one thread accepts, two threads per connection copy bytes. While
stalled, bytes read from either side are kept and delivered, in order, on resume()."""
from __future__ import annotations

import socket
import threading


class StallProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target = (host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(256)
        self.port = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        for s in [self._listener, *self._socks]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
