"""/metrics over real TLS with basic auth, the index page, the telemetry path, and a real
Prometheus scraping all of it (tests/prom.py)."""
from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl

import pytest

from exporters import webconfig
from exporters.prometheus import MetricsServer, MetricsState, build_registry
from helpers import wait_for
from prom import start_prometheus, wait_for_query
from tlsfiles import bcrypt_hash, make_pki, write_web_config

PASSWORD = "correct horse"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def web_config(tmp_path, pki, users=True, client_auth=None):
    text = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
    if client_auth:
        text += f"  client_auth_type: {client_auth}\n  client_ca_file: {pki.ca}\n"
    if users:
        text += f"basic_auth_users:\n  prometheus: {bcrypt_hash(PASSWORD)}\n"
    return webconfig.load(write_web_config(tmp_path / "web.yml", text))


class Served:
    def __init__(self, server, state):
        self.server, self.state = server, state
        self.dropped: list[str] = []


@pytest.fixture
def serve():
    servers = []

    def start(web=None, telemetry_path="/metrics", health=lambda: (True, "")):
        state = MetricsState()
        served = None
        server = MetricsServer("127.0.0.1:0", build_registry(state), health=health,
                               web_config=web, telemetry_path=telemetry_path,
                               on_dropped=lambda reason: served.dropped.append(reason))
        served = Served(server, state)
        server.start()
        servers.append(server)
        return served

    yield start
    for s in servers:
        s.stop()


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


def test_tls_with_basic_auth(serve, pki, tmp_path):
    s = serve(web_config(tmp_path, pki))
    port = s.server.port
    status, headers, body = get(port, "/metrics", pki, auth=("prometheus", PASSWORD))
    assert status == 200 and "ckptwatch_build_info" in body
    status, headers, _ = get(port, "/metrics", pki)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
    assert get(port, "/metrics", pki, auth=("prometheus", "wrong"))[0] == 401
    assert get(port, "/metrics", pki, auth=("root", PASSWORD))[0] == 401
    assert get(port, "/", pki)[0] == 401          # the index page is behind auth too
    # Probes cannot authenticate: /healthz answers them.
    assert get(port, "/healthz", pki)[:3:2] == (200, "ok\n")


def test_plain_http_to_a_tls_port_is_refused_and_counted(serve, pki, tmp_path):
    s = serve(web_config(tmp_path, pki, users=False))
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        get(s.server.port, "/metrics")
    wait_for(lambda: "tls_handshake" in s.dropped, timeout=5)
    # The server still serves TLS clients afterwards.
    assert get(s.server.port, "/metrics", pki)[0] == 200


def test_silent_client_does_not_block_tls_accepts(serve, pki, tmp_path):
    # Handshakes happen in handler threads: a connection that never says hello must not
    # stall the accept loop for everyone else.
    s = serve(web_config(tmp_path, pki, users=False))
    with socket.create_connection(("127.0.0.1", s.server.port)):
        assert get(s.server.port, "/metrics", pki, timeout=3)[0] == 200


def test_client_certificates_when_required(serve, pki, tmp_path):
    s = serve(web_config(tmp_path, pki, users=False, client_auth="RequireAndVerifyClientCert"))
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        get(s.server.port, "/metrics", pki)
    assert get(s.server.port, "/metrics", pki, cert=(pki.client_cert, pki.client_key))[0] == 200


def test_unhealthy_reason_only_for_authorized_callers(serve, pki, tmp_path):
    s = serve(web_config(tmp_path, pki),
              health=lambda: (False, "socket /run/ckptwatch/agent.sock was replaced"))
    status, _, body = get(s.server.port, "/healthz", pki)
    assert (status, body) == (503, "unhealthy\n")
    status, _, body = get(s.server.port, "/healthz", pki, auth=("prometheus", PASSWORD))
    assert status == 503 and "replaced" in body


def test_index_page_and_telemetry_path(serve):
    s = serve(telemetry_path="/probe/metrics")
    status, headers, body = get(s.server.port, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<a href="/probe/metrics">' in body and '<a href="/healthz">' in body
    assert get(s.server.port, "/probe/metrics")[0] == 200
    assert get(s.server.port, "/metrics")[0] == 404
    assert get(s.server.port, "/nope")[0] == 404


# --- a real Prometheus --------------------------------------------------------------------

@pytest.mark.e2e
def test_prometheus_scrapes_over_tls_with_basic_auth(serve, pki, tmp_path):
    s = serve(web_config(tmp_path, pki), telemetry_path="/probe/metrics")
    target = f"127.0.0.1:{s.server.port}"
    options = {"scheme": "https", "metrics_path": "/probe/metrics",
               "tls_config": {"ca_file": pki.ca},
               "basic_auth": {"username": "prometheus", "password": PASSWORD}}
    with start_prometheus([target], scrape_options=options) as prom:
        result = wait_for_query(prom, 'ckptwatch_build_info{job="ckptwatch"}')
        assert result[0]["metric"]["instance"] == target
        assert [r["value"][1] for r in prom.query('up{job="ckptwatch"}')] == ["1"]


@pytest.mark.e2e
def test_prometheus_with_a_wrong_password_sees_the_target_down(serve, pki, tmp_path):
    s = serve(web_config(tmp_path, pki))
    options = {"scheme": "https", "tls_config": {"ca_file": pki.ca},
               "basic_auth": {"username": "prometheus", "password": "guess"}}
    with start_prometheus([f"127.0.0.1:{s.server.port}"], scrape_options=options) as prom:
        wait_for_query(prom, 'up{job="ckptwatch"} == 0')
        (target,) = prom.targets()
        assert "401" in target["lastError"]
        assert not prom.query("ckptwatch_build_info")


@pytest.mark.e2e
def test_agent_process_serves_tls_to_prometheus(pki, tmp_path):
    """The real agent (`python agent.py --web.config.file ...`) scraped by a real Prometheus."""
    from agentproc import launch_agent
    path = write_web_config(tmp_path / "web.yml", f"""
tls_server_config:
  cert_file: {pki.server_cert}
  key_file: {pki.server_key}
basic_auth_users:
  prometheus: {bcrypt_hash(PASSWORD)}
""")
    agent = launch_agent(str(tmp_path), f"--web.config.file={path}")
    try:
        def healthy():
            assert agent.alive(), agent.log
            try:
                return get(agent.port, "/healthz", pki, timeout=1)[0] == 200
            except OSError:
                return False
        wait_for(healthy, timeout=30, message="agent /healthz over TLS")
        assert get(agent.port, "/metrics", pki)[0] == 401
        options = {"scheme": "https", "tls_config": {"ca_file": pki.ca},
                   "basic_auth": {"username": "prometheus", "password": PASSWORD}}
        with start_prometheus([f"127.0.0.1:{agent.port}"], scrape_options=options) as prom:
            wait_for_query(prom, 'ckptwatch_build_info{job="ckptwatch"}')
        assert "tls=True" in agent.log and "basic_auth=True" in agent.log
    finally:
        agent.close()
