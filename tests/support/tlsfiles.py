"""Test certificates and web config files made with the openssl CLI (no test keys in the repo),
and the pki fixture and web configs the TLS tests of both tiers serve with.

    files = make_pki(tmp_path)   # files.ca, files.server_cert/key (127.0.0.1, localhost),
                                 # files.client_cert/key (signed by the same CA)
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from exporters import webconfig

# A cheap cost keeps the suite fast; the server reads the cost from the hash.
BCRYPT_COST = 4


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: str) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def make_pki(directory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = str(directory)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=ckptwatch test CA",
             cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                 "extendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext)
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile",
                 f"{name}.ext", cwd=d)
    j = lambda n: os.path.join(d, n)  # noqa: E731
    return Pki(j("ca.crt"), j("server.crt"), j("server.key"), j("client.crt"), j("client.key"))


def bcrypt_hash(password: str) -> str:
    import bcrypt
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()


def write_web_config(path, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


# The password of the user "prometheus" in web_config()'s basic_auth_users.
PASSWORD = "correct horse"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """One CA, server and client certificate per test module (openssl takes a while)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def web_config(tmp_path, pki, users=True, client_auth=None):
    """A loaded exporter-toolkit web config serving TLS with pki's server certificate; users:
    basic auth for "prometheus" with PASSWORD; client_auth: its client_auth_type."""
    text = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
    if client_auth:
        text += f"  client_auth_type: {client_auth}\n  client_ca_file: {pki.ca}\n"
    if users:
        text += f"basic_auth_users:\n  prometheus: {bcrypt_hash(PASSWORD)}\n"
    return webconfig.load(write_web_config(tmp_path / "web.yml", text))
