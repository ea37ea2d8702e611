"""A MetricsServer in this process for one test (the serve_metrics fixture: started on a free
loopback port, stopped after the test, no thread left behind), and the client side the HTTP
and TLS tests talk to it with."""
from __future__ import annotations

import base64
import http.client
import socket
import ssl

import pytest

from exporters.metrics.collector import build_registry
from exporters.metrics.server import MetricsServer
from exporters.metrics.state import MetricsState


class Served:
    """A started MetricsServer, the state it exports, and the reasons of the connections it
    dropped (its on_dropped calls, in order)."""

    def __init__(self, server, state):
        self.server, self.state = server, state
        self.dropped: list[str] = []

    @property
    def port(self) -> int:
        return self.server.port


@pytest.fixture
def serve_metrics(no_thread_leak):
    """serve_metrics(web=None, state=None, telemetry_path="/metrics", health=..., **options)
    -> Served: web is a loaded web config (TLS, basic auth), state a MetricsState (a fresh one
    by default); options go to MetricsServer (timeout, max_handlers, ...)."""
    servers = []

    def start(web=None, state=None, telemetry_path="/metrics", health=lambda: (True, ""),
              **options) -> Served:
        state = MetricsState() if state is None else state
        served = None
        server = MetricsServer("127.0.0.1:0", build_registry(state), health=health,
                               web_config=web, telemetry_path=telemetry_path,
                               on_dropped=lambda reason: served.dropped.append(reason),
                               **options)
        served = Served(server, state)
        server.start()
        servers.append(server)
        return served

    yield start
    for server in servers:
        server.stop()


def get(port, route, pki=None, auth=None, cert=None, timeout=5.0):
    """GET over HTTPS when pki is given (verifying the server against the test CA)."""
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(
            f"{auth[0]}:{auth[1]}".encode()).decode()
    if pki:
        ctx = ssl.create_default_context(cafile=pki.ca)
        if cert:
            ctx.load_cert_chain(*cert)
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", route, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode()
    finally:
        conn.close()


def idle_connection(port):
    """A TCP connection to the server that never sends a request."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


class Slowloris:
    """Connections that send a request line, then one header byte every `interval` seconds,
    from a thread of their own, until close(): each byte comes well within any socket
    timeout, the head never ends."""

    def __init__(self, port: int, count: int, interval: float = 0.5):
        import threading
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=10)
                      for _ in range(count)]
        for sock in self.socks:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        self.closed_by_server = set()
        self.rounds = 0              # header bytes sent on each connection so far
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        while not self._stop.wait(self._interval):
            for i, sock in enumerate(self.socks):
                if i in self.closed_by_server:
                    continue
                try:
                    sock.sendall(b"a")
                except OSError:
                    self.closed_by_server.add(i)
            self.rounds += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()

    def __enter__(self) -> "Slowloris":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
