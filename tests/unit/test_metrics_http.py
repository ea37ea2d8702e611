"""MetricsServer against a hostile HTTP client: an idle connection is closed after the
timeout (many of them, and clients that hang up mid-response, are tests/e2e/test_metrics_http.py).
Real TCP sockets."""
import time

from helpers import wait_for
from metricsserve import Slowloris, get, idle_connection


def test_idle_connection_is_closed_after_the_timeout(serve_metrics):
    server = serve_metrics(timeout=0.5).server
    with idle_connection(server.port) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""          # the server hung up, without a request from us
        assert time.monotonic() - started < 5


# ---- request heads that never end (issue 17 item 4) -------------------------------------

def test_a_head_that_never_ends_is_cut_at_the_head_deadline(serve_metrics):
    # One header byte every 0.1 s: each read returns well within the socket timeout, so on
    # the old code the connection held its thread as long as the client liked.
    served = serve_metrics(timeout=30, head_timeout=1.0)
    with Slowloris(served.port, 1, interval=0.1) as loris:
        started = time.monotonic()
        wait_for(lambda: loris.closed_by_server, timeout=10,
                 message="the server to hang up on a head that never ends")
        assert time.monotonic() - started < 5
    assert "timeout" in served.dropped


def test_connections_still_sending_their_head_never_keep_a_scrape_out(serve_metrics):
    # Every thread taken by a connection whose head is still coming in: a scrape evicts the
    # oldest. Old code: those connections held their place once their request line was read,
    # and the scrape was refused.
    served = serve_metrics(timeout=30, max_handlers=4)
    with Slowloris(served.port, 4, interval=0.2):
        wait_for(lambda: served.server._server._handlers == 4, timeout=5,
                 message="four slow heads taken in")
        status, _, body = get(served.port, "/metrics")
        assert status == 200 and "ckptwatch_build_info" in body
    assert "evicted" in served.dropped and "refused" not in served.dropped

