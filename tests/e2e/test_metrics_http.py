"""MetricsServer against hostile HTTP clients in numbers: many idle connections, and clients
that hang up mid-response on the real agent (one idle connection is
tests/unit/test_metrics_http.py). Real TCP sockets."""
import socket
import struct
import threading
import urllib.request

from agentproc import start_agent
from helpers import wait_for
from metricsserve import Slowloris, idle_connection


def scrape(port, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        return resp.status, resp.read()


def test_many_idle_connections_hold_few_threads_and_do_not_stop_a_scrape(serve_metrics):
    served = serve_metrics(timeout=30, max_handlers=4)
    server, drops = served.server, served.dropped
    before = threading.active_count()
    idle = [idle_connection(server.port) for _ in range(50)]
    try:
        # All 50 taken in: 4 held by the handler threads, the others evicted for newer ones.
        wait_for(lambda: drops.count("evicted") >= 50 - 4, message="the server took in all 50")
        assert threading.active_count() <= before + 4 + 1
        status, body = scrape(server.port)
        assert status == 200 and b"ckptwatch_build_info" in body
        assert drops.count("evicted") >= 47      # 51 connections, 4 threads
    finally:
        for sock in idle:
            sock.close()


def test_client_hanging_up_mid_response_leaves_no_traceback(tmp_path):
    with start_agent(str(tmp_path)) as agent:
        for _ in range(30):
            sock = socket.create_connection(("127.0.0.1", agent.port))
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            # close with RST, before reading the answer: the server's write fails
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        wait_for(lambda: (agent.metric("ckptwatch_http_connections_dropped_total",
                                       reason="client_gone") or 0) >= 1,
                 message="a client that hung up counted")
        status, _ = scrape(agent.port)
        assert status == 200
        assert agent.metric("ckptwatch_http_connections_dropped_total",
                            reason="client_gone") >= 1
        log = agent.log
    assert "Traceback" not in log, log[-3000:]
    for line in log.splitlines():
        assert line.startswith("ts="), f"not a logfmt line: {line!r}"


def test_slow_request_heads_never_keep_a_scrape_out_of_the_real_agent(tmp_path):
    """Issue 17 item 4: 16 connections sending their headers a byte at a time (the agent's
    16 handler threads) refused every scrape for 40 s on the old code, without credentials."""
    with start_agent(str(tmp_path)) as agent, \
            Slowloris(agent.port, 16, interval=0.5) as loris:
        # Header bytes have followed every request line: each handler is reading headers.
        wait_for(lambda: loris.rounds >= 2, message="two header bytes on every connection")
        for _ in range(3):
            status, body = scrape(agent.port)
            assert status == 200 and b"ckptwatch_build_info" in body
        assert not agent.metric("ckptwatch_http_connections_dropped_total", reason="refused")
