"""MetricsServer against hostile HTTP clients: idle connections, many of them, clients that
hang up mid-response. Real TCP sockets; the last test runs the real agent."""
import socket
import struct
import threading
import time
import urllib.request

import pytest

from exporters.prometheus import MetricsServer, MetricsState, build_registry


@pytest.fixture
def make_server():
    servers = []

    def make(**options):
        server = MetricsServer("127.0.0.1:0", build_registry(MetricsState()), **options)
        server.start()
        servers.append(server)
        return server
    yield make
    for server in servers:
        server.stop()


def idle_connection(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def scrape(port, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        return resp.status, resp.read()


def test_idle_connection_is_closed_after_the_timeout(make_server):
    server = make_server(timeout=0.5)
    with idle_connection(server.port) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""          # the server hung up, without a request from us
        assert time.monotonic() - started < 5


@pytest.mark.e2e
def test_many_idle_connections_hold_few_threads_and_do_not_stop_a_scrape(make_server):
    drops = []
    server = make_server(timeout=30, max_handlers=4, on_dropped=drops.append)
    before = threading.active_count()
    idle = [idle_connection(server.port) for _ in range(50)]
    try:
        time.sleep(0.3)                     # let the server take them all in
        assert threading.active_count() <= before + 4 + 1
        status, body = scrape(server.port)
        assert status == 200 and b"ckptwatch_build_info" in body
        assert drops.count("evicted") >= 47      # 51 connections, 4 threads
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.e2e
def test_client_hanging_up_mid_response_leaves_no_traceback(tmp_path):
    from agentproc import start_agent
    with start_agent(str(tmp_path)) as agent:
        for _ in range(30):
            sock = socket.create_connection(("127.0.0.1", agent.port))
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            # close with RST, before reading the answer: the server's write fails
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        time.sleep(0.5)
        status, _ = scrape(agent.port)
        assert status == 200
        assert agent.metric("ckptwatch_http_connections_dropped_total",
                            reason="client_gone") >= 1
        log = agent.log
    assert "Traceback" not in log, log[-3000:]
    for line in log.splitlines():
        assert line.startswith("ts="), f"not a logfmt line: {line!r}"
