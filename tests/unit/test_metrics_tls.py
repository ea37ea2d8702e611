"""/metrics over real TLS with basic auth, the index page and the telemetry path (a real
Prometheus scraping all of it is tests/e2e/test_metrics_tls.py)."""
from __future__ import annotations

import http.client
import socket
import ssl

import pytest

from helpers import wait_for
from metricsserve import get
from tlsfiles import PASSWORD, web_config


def test_tls_with_basic_auth(serve_metrics, pki, tmp_path):
    s = serve_metrics(web_config(tmp_path, pki))
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


def test_plain_http_to_a_tls_port_is_refused_and_counted(serve_metrics, pki, tmp_path):
    s = serve_metrics(web_config(tmp_path, pki, users=False))
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        get(s.server.port, "/metrics")
    wait_for(lambda: "tls_handshake" in s.dropped, timeout=5)
    # The server still serves TLS clients afterwards.
    assert get(s.server.port, "/metrics", pki)[0] == 200


def test_silent_client_does_not_block_tls_accepts(serve_metrics, pki, tmp_path):
    # Handshakes happen in handler threads: a connection that never says hello must not
    # stall the accept loop for everyone else.
    s = serve_metrics(web_config(tmp_path, pki, users=False))
    with socket.create_connection(("127.0.0.1", s.server.port)):
        assert get(s.server.port, "/metrics", pki, timeout=3)[0] == 200


def test_client_certificates_when_required(serve_metrics, pki, tmp_path):
    s = serve_metrics(web_config(tmp_path, pki, users=False, client_auth="RequireAndVerifyClientCert"))
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        get(s.server.port, "/metrics", pki)
    assert get(s.server.port, "/metrics", pki, cert=(pki.client_cert, pki.client_key))[0] == 200


def test_unhealthy_reason_only_for_authorized_callers(serve_metrics, pki, tmp_path):
    s = serve_metrics(web_config(tmp_path, pki),
              health=lambda: (False, "socket /run/ckptwatch/agent.sock was replaced"))
    status, _, body = get(s.server.port, "/healthz", pki)
    assert (status, body) == (503, "unhealthy\n")
    status, _, body = get(s.server.port, "/healthz", pki, auth=("prometheus", PASSWORD))
    assert status == 503 and "replaced" in body


def test_index_page_and_telemetry_path(serve_metrics):
    s = serve_metrics(telemetry_path="/probe/metrics")
    status, headers, body = get(s.server.port, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<a href="/probe/metrics">' in body and '<a href="/-/ready">' in body
    assert get(s.server.port, "/probe/metrics")[0] == 200
    assert get(s.server.port, "/metrics")[0] == 404
    assert get(s.server.port, "/nope")[0] == 404
