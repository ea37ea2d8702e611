"""MetricsServer: serves a registry on /metrics (or --web.telemetry-path), the health
endpoints (/-/healthy, /-/ready as Prometheus has them, and /healthz) and an index page at /,
over TLS and behind basic auth when the web config says so, from a bounded set of handler
threads. Every GET endpoint also answers HEAD (the same status and headers, no body). It
counts the connections it closes early (drops(), read by
exporters.metrics.components.HttpCollector)."""
from __future__ import annotations

import errno
import gzip
import html
import http.server
import logging
import socket
import ssl
import sys
import threading
import time
from types import MappingProxyType
from typing import Callable, Mapping
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ckptwatch.version import __version__
from exporters.metrics.listen import HEALTH_ROUTES, RESERVED_PATHS, parse_listen_address
from exporters.webconfig import BasicAuth, WebConfig

log = logging.getLogger(__name__)

# tls_handshake: a connection that failed the TLS handshake (plain HTTP to a TLS port, a
# client certificate the CA did not sign, an old protocol version).
HTTP_DROP_REASONS = ("timeout", "client_gone", "evicted", "refused", "tls_handshake")


class _Server(http.server.ThreadingHTTPServer):
    """One thread per connection, at most max_handlers of them (set by MetricsServer).

    A thread costs ~8 MB of address space and a connection costs a client nothing, so
    connections that have not sent a whole request must not be able to take every thread. A
    connection is *waiting* from its accept (and again between two requests of a kept-alive
    connection) until its request head -- request line and every header -- is complete; a
    waiting connection does not hold its place: when all threads are taken, the oldest waiting
    one is shut down to make room (its thread then ends at once), and only if every thread is
    answering a request is the newcomer closed. A head must also be complete within
    head_timeout of the accept (or of the previous answer): the accept loop shuts down a
    waiting connection past its deadline, so a client sending its headers a byte at a time
    (slowloris: each byte arrives within the socket timeout) holds a thread for head_timeout
    at most, and never keeps a scrape out. The handler's socket timeout bounds every read and
    write after that.
    """

    daemon_threads = True
    allow_reuse_address = True
    dual_stack = False
    max_handlers = 16
    head_timeout = 10.0
    on_dropped: Callable[[str], None] = staticmethod(lambda reason: None)
    ssl_context: ssl.SSLContext | None = None

    def get_request(self):
        request, address = super().get_request()
        if self.ssl_context is not None:
            # No handshake here: this is the accept loop, and one slow or silent client must
            # not stall it. The handler thread shakes hands under its socket timeout.
            request = self.ssl_context.wrap_socket(request, server_side=True,
                                                   do_handshake_on_connect=False)
        return request, address

    def __init__(self, *args, **kwargs):
        self._slots_lock = threading.Lock()
        self._handlers = 0
        # Waiting sockets (no whole request head yet), oldest first, with their deadline.
        self._waiting: dict = {}
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        evicted, refused = None, False
        with self._slots_lock:
            if self._handlers >= self.max_handlers:
                evicted = next(iter(self._waiting), None)
                if evicted is None:
                    refused = True
                else:
                    del self._waiting[evicted]
            if not refused:
                self._handlers += 1
                self._waiting[request] = time.monotonic() + self.head_timeout
        if evicted is not None:
            self.dropped("evicted")
            try:
                evicted.shutdown(socket.SHUT_RDWR)     # its blocked read returns, its thread ends
            except OSError:
                pass
        if refused:
            self.dropped("refused")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._slots_lock:
            self._handlers -= 1
            self._waiting.pop(request, None)

    def request_started(self, request) -> bool:
        """The handler read a whole request head: this connection holds its place now.
        False if it was shut down meanwhile (evicted, or past its deadline): not answered."""
        with self._slots_lock:
            return self._waiting.pop(request, False) is not False

    def request_awaited(self, request) -> None:
        """The handler waits for a request head on this connection (the first since the
        accept, which is waiting already, or the next on a kept-alive connection): it is
        waiting until the head is complete, within head_timeout from now."""
        with self._slots_lock:
            if request not in self._waiting:
                self._waiting[request] = time.monotonic() + self.head_timeout

    def service_actions(self):
        """The accept loop's turn (every poll interval): shut down the waiting connections
        whose head did not come within head_timeout."""
        now = time.monotonic()
        with self._slots_lock:
            late = [r for r, deadline in self._waiting.items() if deadline <= now]
            for request in late:
                del self._waiting[request]
        for request in late:
            self.dropped("timeout")
            try:
                request.shutdown(socket.SHUT_RDWR)     # its blocked read returns, its thread ends
            except OSError:
                pass

    def dropped(self, reason: str) -> None:
        try:
            self.on_dropped(reason)
        except Exception:
            log.exception("counting a dropped metrics connection failed")

    def handle_error(self, request, client_address):
        # socketserver would print a traceback to stderr, outside the log format.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            self.dropped("timeout" if isinstance(exc, TimeoutError) else "client_gone")
            log.debug("metrics client %s: %s", client_address[0], exc)
        else:
            log.error("metrics request from %s failed", client_address[0], exc_info=True)

    def server_bind(self):
        if self.dual_stack:
            # ":port" means every interface, IPv6 and IPv4 (as node_exporter does).
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _bind_candidates(host: str, port: int) -> list[tuple[type, tuple[str, int]]]:
    """Server classes and bind addresses to try in order for a parsed listen address.

    "" means every interface: dual-stack IPv6 first (as node_exporter does), then IPv4 for
    kernels or containers where IPv6 is disabled.
    """
    if host == "":
        dual = type("_DualStackServer", (_Server,),
                    {"address_family": socket.AF_INET6, "dual_stack": True})
        return [(dual, ("::", port)), (_Server, ("0.0.0.0", port))]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve listen host {host!r}: {exc}") from None
    out = []
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET6:
            out.append((type("_Server6", (_Server,), {"address_family": family}),
                        (sockaddr[0], port)))
        elif family == socket.AF_INET:
            out.append((_Server, (sockaddr[0], port)))
    return out


def accepts_gzip(header: str | None) -> bool:
    """True if an Accept-Encoding header accepts gzip (not "gzip;q=0"; "*" counts)."""
    for item in (header or "").split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "*"):
            continue
        quality = params.strip().lower()
        if quality.startswith("q="):
            try:
                return float(quality[2:]) > 0
            except ValueError:
                return False
        return True
    return False


class _Handler(http.server.BaseHTTPRequestHandler):
    # Set per server in MetricsServer.start(). timeout: the socket timeout of every read and
    # write (StreamRequestHandler applies it), so an idle or slow client cannot hold a thread.
    registry: CollectorRegistry
    health: Callable[[], tuple[bool, str]]
    healthy: Callable[[], tuple[bool, str]]
    auth: BasicAuth = BasicAuth({})
    telemetry_path = "/metrics"
    timeout = 10.0

    def handle(self):
        if isinstance(self.request, ssl.SSLSocket):
            try:
                self.request.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                self.server.dropped("tls_handshake")
                log.debug("metrics client %s: TLS handshake failed: %s",
                          self.client_address[0], exc)
                self.close_connection = True
                return
        try:
            super().handle()
        except ConnectionError as exc:      # BrokenPipe, reset: the client hung up mid-answer
            self.server.dropped("client_gone")
            log.debug("metrics client %s went away: %s", self.client_address[0], exc)

    def handle_one_request(self):
        self.server.request_awaited(self.request)
        super().handle_one_request()

    def parse_request(self):
        # Reads the headers: the head is complete (or refused) once it returns.
        try:
            parsed = super().parse_request()
        finally:
            ours = self.server.request_started(self.request)
        if not ours:            # shut down while its head came in: nobody to answer
            self.close_connection = True
            return False
        return parsed

    def log_error(self, format, *args):  # noqa: A002 (signature from http.server)
        # http.server reports a read or write that hit the socket timeout only through here.
        if format.startswith("Request timed out"):
            self.server.dropped("timeout")
        self.log_message(format, *args)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        route = urlsplit(self.path).path
        authorized = self.auth.check(self.headers.get("Authorization"))
        if route in HEALTH_ROUTES:
            # Open to probes, but without the reason unless authorized: it may name paths.
            check = self.healthy if HEALTH_ROUTES[route] == "healthy" else self.health
            self._healthz(check, detail=authorized)
        elif not authorized:
            self._reply(401, b"Unauthorized\n", "text/plain; charset=utf-8",
                        {"WWW-Authenticate": 'Basic realm="ckptwatch", charset="UTF-8"'})
        elif route == self.telemetry_path:
            self._metrics()
        elif route == "/":
            self._index()
        else:
            self._reply(404, b"not found\n", "text/plain; charset=utf-8")

    def do_HEAD(self):  # noqa: N802 (http.server's naming)
        # The same answer as GET without the body (_reply leaves it out): what a load
        # balancer's or uptime checker's HEAD probe expects, instead of http.server's 501.
        self.do_GET()

    def _index(self):
        # A landing page as node_exporter has: what this is and where the metrics are.
        path = html.escape(self.telemetry_path, quote=True)
        body = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
                f"<title>ckptwatch agent</title></head>\n<body>\n"
                f"<h1>ckptwatch agent</h1>\n"
                f"<p>Runtime write-collision monitor for torch.save checkpoints, version "
                f"{html.escape(__version__)}.</p>\n<ul>\n"
                f"<li><a href=\"{path}\">Metrics</a> ({path})</li>\n"
                f"<li><a href=\"/-/healthy\">Healthy</a> (/-/healthy: alive)</li>\n"
                f"<li><a href=\"/-/ready\">Ready</a> (/-/ready: started and keeping "
                f"up; also /healthz)</li>\n"
                f"</ul>\n</body></html>\n").encode()
        self._reply(200, body, "text/html; charset=utf-8")

    def _metrics(self):
        encoder, content_type = choose_encoder(self.headers.get("Accept"))
        try:
            body = encoder(self.registry)
        except Exception as exc:  # a broken collector must not kill the server thread
            log.exception("metrics collection failed")
            self._reply(500, f"collection failed: {exc}\n".encode(), "text/plain")
            return
        # Prometheus always asks for gzip; the text format shrinks ~10x. prometheus_client's
        # own handlers do this too, but this server is http.server's, so we do it here.
        if accepts_gzip(self.headers.get("Accept-Encoding")):
            self._reply(200, gzip.compress(body, compresslevel=6), content_type,
                        {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        else:
            self._reply(200, body, content_type, {"Vary": "Accept-Encoding"})

    def _healthz(self, check: Callable[[], tuple[bool, str]], detail: bool = True):
        try:
            ok, reason = check()
        except Exception as exc:
            ok, reason = False, f"health check raised {type(exc).__name__}: {exc}"
        if ok:
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")
        elif not detail:
            self._reply(503, b"unhealthy\n", "text/plain; charset=utf-8")
        else:
            self._reply(503, (reason or "unhealthy").encode() + b"\n",
                        "text/plain; charset=utf-8")

    def _reply(self, code: int, body: bytes, content_type: str,
               headers: Mapping[str, str] = MappingProxyType({})):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for name, text in headers.items():
            self.send_header(name, text)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (signature from http.server)
        # Scrapes every 15 s would flood the agent log; keep them at debug level.
        log.debug("%s %s", self.address_string(), format % args)


class MetricsServer:
    """Serves the metrics (telemetry_path, default /metrics), /-/healthy, /-/ready, /healthz
    and an index page at / from a daemon thread, GET and HEAD; over TLS and behind basic auth
    when web_config says so (exporters.webconfig; the health endpoints stay open to probes).

    address: ":19400", "127.0.0.1:19400", "[::1]:19400", "host:0" (0 = an ephemeral port;
    read .port after start()). A malformed address raises ValueError here, before start(), so
    the agent reports it with the other configuration errors. health() (/-/ready, /healthz)
    and healthy() (/-/healthy; default: the server answers) return (ok, reason).
    Connections closed early are counted by reason (drops()) and also handed to on_dropped.
    """

    def __init__(self, address: str, registry: CollectorRegistry,
                 health: Callable[[], tuple[bool, str]] = lambda: (True, ""),
                 timeout: float = 10.0, max_handlers: int = 16, head_timeout: float = 10.0,
                 on_dropped: Callable[[str], None] | None = None,
                 web_config: WebConfig | None = None, telemetry_path: str = "/metrics",
                 healthy: Callable[[], tuple[bool, str]] = lambda: (True, "")):
        if timeout <= 0 or max_handlers < 1 or head_timeout <= 0:
            raise ValueError(f"need timeout > 0, head_timeout > 0 and max_handlers >= 1, got "
                             f"{timeout}, {head_timeout}, {max_handlers}")
        if not telemetry_path.startswith("/") or telemetry_path in RESERVED_PATHS:
            raise ValueError(f"telemetry path {telemetry_path!r}: must start with / and be "
                             f"none of {', '.join(RESERVED_PATHS)}")
        self.web_config = web_config or WebConfig()
        self.telemetry_path = telemetry_path
        self.timeout, self.max_handlers, self._on_dropped = timeout, max_handlers, on_dropped
        self.head_timeout = head_timeout
        self.host, self._requested_port = parse_listen_address(address)
        self.address = address
        self._registry = registry
        self._health = health
        self._healthy = healthy
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.port: int | None = None
        # Handler threads and the accept loop count at once; their own lock, so counting never
        # waits for start() or stop().
        self._drops_lock = threading.Lock()
        self._drops = {reason: 0 for reason in HTTP_DROP_REASONS}

    def drops(self) -> dict[str, int]:
        """Connections closed early since construction, by reason (HTTP_DROP_REASONS, each
        present from the start)."""
        with self._drops_lock:
            return dict(self._drops)

    def _dropped(self, reason: str) -> None:
        with self._drops_lock:
            self._drops[reason] = self._drops.get(reason, 0) + 1
        if self._on_dropped is not None:
            self._on_dropped(reason)

    def start(self) -> None:
        """Bind and serve; a second call is a no-op. Raises OSError if the bind fails."""
        with self._lock:
            if self._server is not None:
                return
            handler = type("Handler", (_Handler,),
                           {"registry": self._registry, "health": staticmethod(self._health),
                            "healthy": staticmethod(self._healthy),
                            "timeout": self.timeout,
                            "auth": BasicAuth(self.web_config.users),
                            "telemetry_path": self.telemetry_path})
            tls = self.web_config.tls.context() if self.web_config.tls else None
            server, error = None, None
            for server_cls, bind in _bind_candidates(self.host, self._requested_port):
                try:
                    server = server_cls(bind, handler)
                    break
                except OSError as exc:
                    error = error or exc
                    if exc.errno == errno.EADDRINUSE:
                        break  # the port is taken: another family would only hide that
            if server is None:
                raise error or OSError(f"cannot listen on {self.address!r}")
            server.max_handlers = self.max_handlers
            server.head_timeout = self.head_timeout
            server.ssl_context = tls
            server.on_dropped = self._dropped
            self.port = server.server_address[1]
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name=f"ckptwatch-metrics:{self.port}", daemon=True)
            thread.start()
            self._server, self._thread = server, thread
            log.info("serving metrics on %s (port %d, path %s, tls=%s, basic_auth=%s)",
                     self.address, self.port, self.telemetry_path, tls is not None,
                     bool(self.web_config.users))

    def stop(self) -> None:
        """Stop serving and join the thread; a second call is a no-op."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        thread.join()
