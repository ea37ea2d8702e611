"""--web.config.file parsing (exporter-toolkit format) and basic-auth checks."""
from __future__ import annotations

import base64
import subprocess
import sys

import pytest

from exporters import webconfig
from exporters.webconfig import BasicAuth, WebConfigError
from helpers import REPO_ROOT, subprocess_env
from monitor.agent import config
from tlsfiles import bcrypt_hash, make_pki, write_web_config


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_node_exporter_style_file_loads(tmp_path):
    pki = make_pki(tmp_path)
    hashed = bcrypt_hash("s3cret")
    path = write_web_config(tmp_path / "web.yml", f"""
tls_server_config:
  cert_file: server.crt          # relative to this file, as the toolkit resolves them
  key_file: {pki.server_key}
  client_ca_file: ca.crt
  client_auth_type: VerifyClientCertIfGiven
  min_version: TLS13
basic_auth_users:
  prometheus: {hashed}
""")
    web = webconfig.load(path)
    assert web.tls.cert_file == pki.server_cert
    assert web.tls.client_ca_file == pki.ca
    assert web.tls.client_auth_type == "VerifyClientCertIfGiven"
    assert web.tls.min_version == "TLS13"
    assert web.users == {"prometheus": hashed.encode()}


def test_client_ca_alone_requires_client_certificates(tmp_path):
    pki = make_pki(tmp_path)
    path = write_web_config(tmp_path / "web.yml", f"""
tls_server_config: {{cert_file: {pki.server_cert}, key_file: {pki.server_key},
                     client_ca_file: {pki.ca}}}
""")
    assert webconfig.load(path).tls.client_auth_type == "RequireAndVerifyClientCert"


def test_every_error_is_reported_at_once(tmp_path):
    path = write_web_config(tmp_path / "web.yml", """
tls_server_config:
  cert_file: /nonexistent/server.crt
  client_auth_type: RequireAnyClientCert
  min_version: TLS9
  cipher_suites: [TLS_AES_128_GCM_SHA256]
  bogus: 1
basic_auth_users:
  alice: plaintext-password
  "bad:name": $2b$04$abcdefghijklmnopqrstuuWq0jY8mS3A4r0Z1iX1v6x4w2b2pZ8Lm
http_server_config: {http2: true}
extra: 1
""")
    with pytest.raises(WebConfigError) as info:
        webconfig.load(path)
    text = "\n".join(info.value.errors)
    for needle in ("key_file are both required", "RequireAnyClientCert is not supported",
                   "min_version: expected one of", "cipher_suites: not supported",
                   "unknown key 'bogus'", "alice: not a bcrypt hash", "invalid user name",
                   "http_server_config is not supported", "unknown key 'extra'"):
        assert needle in text, needle
    assert len(info.value.errors) >= 9


def test_unreadable_certificate_fails_at_load_not_at_first_scrape(tmp_path):
    pki = make_pki(tmp_path)
    path = write_web_config(tmp_path / "web.yml", f"""
tls_server_config: {{cert_file: {pki.server_cert}, key_file: {pki.client_key}}}
""")
    with pytest.raises(WebConfigError, match="cannot load the certificate"):
        webconfig.load(path)


@pytest.mark.parametrize("text", ["[1, 2", "- a list\n", "x" * (webconfig.MAX_FILE_BYTES + 2)])
def test_hostile_files_are_errors_not_tracebacks(tmp_path, text):
    path = write_web_config(tmp_path / "web.yml", text)
    with pytest.raises(WebConfigError):
        webconfig.load(path)


def test_agent_flags_report_web_config_errors_with_the_others(tmp_path):
    path = write_web_config(tmp_path / "web.yml", "basic_auth_users: {bob: nothash}\n")
    with pytest.raises(config.ConfigError) as info:
        config.load([f"--web.config.file={path}", "--web.telemetry-path=/", "--log.level=x"])
    errors = "\n".join(info.value.errors)
    assert "--web.config.file:" in errors and "bob: not a bcrypt hash" in errors
    assert "--web.telemetry-path:" in errors and "--log.level:" in errors


def test_agent_exits_2_on_a_bad_web_config(tmp_path):
    path = write_web_config(tmp_path / "web.yml", "tls_server_config: {cert_file: /x}\n")
    result = subprocess.run([sys.executable, "agent.py", f"--web.config.file={path}"],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert "cert_file and key_file are both required" in result.stderr


def test_telemetry_path_flag():
    assert config.load([]).telemetry_path == "/metrics"
    assert config.load(["--web.telemetry-path=/probe/metrics"]).telemetry_path == \
        "/probe/metrics"
    for bad in ("metrics", "/", "/healthz", "/a b", "/m?x=1"):
        with pytest.raises(config.ConfigError):
            config.load([f"--web.telemetry-path={bad}"])


# --- BasicAuth ----------------------------------------------------------------------------

def test_basic_auth_accepts_only_the_right_user_and_password():
    auth = BasicAuth({"prometheus": bcrypt_hash("s3cret").encode(),
                      "grafana": bcrypt_hash("other").encode()})
    assert auth.check(basic("prometheus", "s3cret"))
    assert auth.check(basic("grafana", "other"))
    for header in (None, "", basic("prometheus", "wrong"), basic("grafana", "s3cret"),
                   basic("nobody", "s3cret"), basic("Prometheus", "s3cret"),
                   "Bearer abc", "Basic !!!notbase64", "Basic " +
                   base64.b64encode(b"no-colon").decode(),
                   basic("prometheus", "s3cret" + "x" * 80), "Basic " + "A" * 5000):
        assert not auth.check(header), header


def test_basic_auth_disabled_without_users():
    assert BasicAuth({}).check(None)


def test_successful_checks_are_cached_failures_are_not(monkeypatch):
    import bcrypt
    calls = []
    real = bcrypt.checkpw

    def counting(password, hashed):
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    auth = BasicAuth({"prometheus": bcrypt_hash("s3cret").encode()})
    for _ in range(5):
        assert auth.check(basic("prometheus", "s3cret"))
    assert len(calls) == 1                    # one bcrypt check, then the cache
    for _ in range(3):
        assert not auth.check(basic("prometheus", "wrong"))
    assert len(calls) == 4                    # wrong passwords always pay bcrypt
    # An unknown user pays bcrypt too, so latency does not reveal which names exist.
    assert not auth.check(basic("mallory", "s3cret"))
    assert len(calls) == 5
