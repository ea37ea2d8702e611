"""A real Prometheus scraping /metrics over TLS with basic auth (tests/support/prom.py): from a
MetricsServer in this process and from the real agent process (the TLS server alone is
tests/unit/test_metrics_tls.py)."""
from __future__ import annotations

from agentproc import launch_agent
from helpers import wait_for
from metricsserve import get
from prom import start_prometheus, wait_for_query
from tlsfiles import PASSWORD, bcrypt_hash, web_config, write_web_config


def test_prometheus_scrapes_over_tls_with_basic_auth(serve_metrics, pki, tmp_path):
    s = serve_metrics(web_config(tmp_path, pki), telemetry_path="/probe/metrics")
    target = f"127.0.0.1:{s.server.port}"
    options = {"scheme": "https", "metrics_path": "/probe/metrics",
               "tls_config": {"ca_file": pki.ca},
               "basic_auth": {"username": "prometheus", "password": PASSWORD}}
    with start_prometheus([target], scrape_options=options) as prom:
        result = wait_for_query(prom, 'ckptwatch_build_info{job="ckptwatch"}')
        assert result[0]["metric"]["instance"] == target
        assert [r["value"][1] for r in prom.query('up{job="ckptwatch"}')] == ["1"]


def test_prometheus_with_a_wrong_password_sees_the_target_down(serve_metrics, pki, tmp_path):
    s = serve_metrics(web_config(tmp_path, pki))
    options = {"scheme": "https", "tls_config": {"ca_file": pki.ca},
               "basic_auth": {"username": "prometheus", "password": "guess"}}
    with start_prometheus([f"127.0.0.1:{s.server.port}"], scrape_options=options) as prom:
        wait_for_query(prom, 'up{job="ckptwatch"} == 0')
        (target,) = prom.targets()
        assert "401" in target["lastError"]
        assert not prom.query("ckptwatch_build_info")


def test_agent_process_serves_tls_to_prometheus(pki, tmp_path):
    """The real agent (`python agent.py --web.config.file ...`) scraped by a real Prometheus."""
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
