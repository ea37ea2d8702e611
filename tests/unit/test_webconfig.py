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


# --- hashes that cannot work, and what an unknown user costs (issue 17 item 8) --------------

def _with_last(text: str, index: int, char: str) -> str:
    return text[:index] + char + text[index + 1:]


@pytest.mark.parametrize("spoil, message", [
    # bcrypt refuses this salt at every login ("Invalid salt"): the old code started
    # silently and refused everyone.
    (lambda h: _with_last(h, 28, "z"), "invalid bcrypt salt"),
    # A digest bcrypt never writes: no password can match it.
    (lambda h: _with_last(h, 59, "z"), "invalid bcrypt digest"),
    # bcrypt accepts cost 31: one login would burn a core for days.
    (lambda h: h[:4] + "31" + h[6:], "bcrypt cost 31 is outside 4..14"),
    (lambda h: h[:4] + "15" + h[6:], "bcrypt cost 15 is outside 4..14"),
    (lambda h: h[:4] + "03" + h[6:], "bcrypt cost 3 is outside 4..14"),
])
def test_a_hash_that_cannot_work_is_refused_at_start_with_a_clear_error(tmp_path, spoil,
                                                                         message):
    good = bcrypt_hash("s3cret")
    assert len(good) == 60 and webconfig.load(write_web_config(
        tmp_path / "ok.yml", f"basic_auth_users:\n  prometheus: '{good}'\n")).users
    path = write_web_config(tmp_path / "web.yml",
                            f"basic_auth_users:\n  prometheus: '{spoil(good)}'\n")
    with pytest.raises(WebConfigError) as info:
        webconfig.load(path)
    (error,) = info.value.errors
    assert error.startswith(f"{path}: basic_auth_users.prometheus: {message}"), error
    assert "htpasswd -nBC 12" in error


def test_an_unknown_user_costs_what_the_costliest_real_one_does(monkeypatch):
    # Old code: an unknown user was checked against a hash made (at the first unknown user)
    # with the cost of the FIRST configured user: with a cost-4 user listed first, unknown
    # names answered in ~1 ms and a cost-12 user's wrong password in ~0.3-1.7 s.
    import bcrypt
    cheap = bcrypt.hashpw(b"a", bcrypt.gensalt(4))
    dear = bcrypt.hashpw(b"b", bcrypt.gensalt(8))
    auth = BasicAuth({"ci": cheap, "prometheus": dear})
    costs = []
    real = bcrypt.checkpw

    def spy(password, hashed):
        costs.append(webconfig.cost_of(hashed))
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", spy)
    monkeypatch.setattr(bcrypt, "hashpw", lambda *a: pytest.fail("a hash made per request"))
    assert not auth.check(basic("mallory", "b"))     # the costliest user's password, too
    assert not auth.check(basic("prometheus", "wrong"))
    assert costs == [8, 8]
