"""MetricsServer against a hostile HTTP client: an idle connection is closed after the
timeout (many of them, and clients that hang up mid-response, are tests/e2e/test_metrics_http.py).
Real TCP sockets."""
import time

from metricsserve import idle_connection


def test_idle_connection_is_closed_after_the_timeout(serve_metrics):
    server = serve_metrics(timeout=0.5).server
    with idle_connection(server.port) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""          # the server hung up, without a request from us
        assert time.monotonic() - started < 5
