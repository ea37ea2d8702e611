"""`--web.config.file`: TLS and basic auth for /metrics, in the Prometheus exporter-toolkit format.

The same YAML node_exporter reads (https://github.com/prometheus/exporter-toolkit,
docs/web-configuration.md), so one file and one habit serve every exporter on a node:

    tls_server_config:
      cert_file: /etc/ckptwatch/tls.crt
      key_file: /etc/ckptwatch/tls.key
      client_auth_type: RequireAndVerifyClientCert   # optional, with client_ca_file
      client_ca_file: /etc/ckptwatch/ca.crt
      min_version: TLS12                              # default TLS12, as the toolkit's
    basic_auth_users:
      prometheus: $2b$12$...                          # bcrypt hash (htpasswd -nBC 12 ...)

load() reads and checks the whole file and reports every problem at once (WebConfigError
.errors), like the agent's other configuration; the certificate and key are loaded there too,
so a bad key fails at start, not at the first scrape. Keys the toolkit knows but ckptwatch does
not implement (cipher_suites, http_server_config, ...) are errors rather than silently ignored:
a user who set them expects them to hold.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

# client_auth_type values of the toolkit that Python's ssl module can honour. It cannot ask for
# a client certificate without verifying it (RequestClientCert, RequireAnyClientCert).
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
            "max_version"}
TLS_KEYS_UNSUPPORTED = {"cipher_suites", "curve_preferences", "prefer_server_cipher_suites",
                        "client_allowed_sans"}
TOP_KEYS = {"tls_server_config", "basic_auth_users"}
TOP_KEYS_UNSUPPORTED = {"http_server_config", "rate_limit"}
# A bcrypt hash: $2a$, $2b$ or $2y$, a two-digit cost, 22 characters of salt, 31 of digest.
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$([./A-Za-z0-9]{22})([./A-Za-z0-9]{31})")
# bcrypt's own base64 alphabet. The salt's 22 characters carry 132 bits for 128 and the
# digest's 31 carry 186 for 184: the unused low bits of the last character are zero in any
# hash bcrypt made. A salt that breaks this is refused by bcrypt ("Invalid salt") at every
# login; a digest that does can never match.
_B64 = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
MIN_BCRYPT_COST = 4               # bcrypt's own minimum
# Each check of a wrong password (and of an unknown user) costs 2**cost rounds, on a handler
# thread, for whoever can reach the port: cost 12 takes ~0.3 s on one core, 14 ~1.2 s, and
# 31 (which bcrypt accepts) days. htpasswd's -B default is 5, exporter-toolkit's docs use 10.
MAX_BCRYPT_COST = 14
MAX_FILE_BYTES = 1 << 20          # a web config is a few lines; refuse to parse a huge file
MAX_USERS = 1000
# Successful (user, password) checks remembered so a scrape every 15 s does not pay bcrypt's
# ~0.1-0.3 s each time. Bounded: only correct passwords get in, but keep it finite anyway.
AUTH_CACHE_SIZE = 64


class WebConfigError(Exception):
    """Invalid web configuration; .errors lists every problem, one line each."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    min_version: str = "TLS12"
    max_version: str | None = None

    def context(self) -> ssl.SSLContext:
        """A server SSLContext; raises OSError/ssl.SSLError for unreadable or bad files."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        if self.max_version:
            ctx.maximum_version = TLS_VERSIONS[self.max_version]
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file:
            ctx.load_verify_locations(cafile=self.client_ca_file)
        return ctx


@dataclass(frozen=True)
class WebConfig:
    """A parsed web config: tls is None for plain HTTP; users maps name -> bcrypt hash."""

    tls: TLSConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    path: str = ""


def _str(value: Any, where: str, errors: list[str]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        errors.append(f"{where}: expected a non-empty string, got {value!r}")
        return None
    return value


def _relative_to(base: str, path: str | None) -> str | None:
    # The toolkit resolves file names relative to the web config file's directory.
    if path is None:
        return None
    return path if os.path.isabs(path) else os.path.join(os.path.dirname(base), path)


def _tls(data: Any, path: str, errors: list[str]) -> TLSConfig | None:
    where = f"{path}: tls_server_config"
    if not isinstance(data, dict):
        errors.append(f"{where}: expected a mapping")
        return None
    for key in data:
        if key in TLS_KEYS_UNSUPPORTED:
            errors.append(f"{where}.{key}: not supported by ckptwatch (Python's ssl module "
                          "defaults are used); remove it")
        elif key not in TLS_KEYS:
            errors.append(f"{where}: unknown key {key!r}")
    cert = _relative_to(path, _str(data.get("cert_file"), f"{where}.cert_file", errors))
    key = _relative_to(path, _str(data.get("key_file"), f"{where}.key_file", errors))
    ca = _relative_to(path, _str(data.get("client_ca_file"), f"{where}.client_ca_file", errors))
    if cert is None or key is None:
        errors.append(f"{where}: cert_file and key_file are both required")
    auth = _str(data.get("client_auth_type"), f"{where}.client_auth_type", errors)
    if auth is None:
        # As the toolkit: a client CA alone means clients must present a certificate it signed.
        auth = "RequireAndVerifyClientCert" if ca else "NoClientCert"
    if auth in UNSUPPORTED_CLIENT_AUTH:
        errors.append(f"{where}.client_auth_type: {auth} is not supported (Python's ssl module "
                      "cannot request a client certificate without verifying it); use "
                      "VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    elif auth not in CLIENT_AUTH:
        errors.append(f"{where}.client_auth_type: expected one of {', '.join(CLIENT_AUTH)}, "
                      f"got {auth!r}")
    elif auth != "NoClientCert" and not ca:
        errors.append(f"{where}: client_auth_type {auth} needs client_ca_file")
    versions = {}
    for name, default in (("min_version", "TLS12"), ("max_version", None)):
        value = _str(data.get(name), f"{where}.{name}", errors) or default
        if value is not None and value not in TLS_VERSIONS:
            errors.append(f"{where}.{name}: expected one of {', '.join(TLS_VERSIONS)}, "
                          f"got {value!r}")
            value = default
        versions[name] = value
    if (versions["max_version"] and
            TLS_VERSIONS[versions["max_version"]] < TLS_VERSIONS[versions["min_version"]]):
        errors.append(f"{where}: max_version {versions['max_version']} is below min_version "
                      f"{versions['min_version']}")
    if errors or cert is None or key is None:
        return None
    tls = TLSConfig(cert, key, auth, ca, versions["min_version"], versions["max_version"])
    try:
        tls.context()
    except (OSError, ssl.SSLError, ValueError) as exc:
        errors.append(f"{where}: cannot load the certificate, key or client CA: {exc}")
        return None
    return tls


def _users(data: Any, path: str, errors: list[str]) -> dict[str, bytes]:
    where = f"{path}: basic_auth_users"
    if not isinstance(data, dict):
        errors.append(f"{where}: expected a mapping of user name to bcrypt hash")
        return {}
    if len(data) > MAX_USERS:
        errors.append(f"{where}: {len(data)} users, at most {MAX_USERS}")
        return {}
    users = {}
    for name, hashed in data.items():
        if not isinstance(name, str) or not name or ":" in name:
            errors.append(f"{where}: invalid user name {name!r} (non-empty, no ':')")
        elif not isinstance(hashed, str) or not _BCRYPT.fullmatch(hashed):
            errors.append(f"{where}.{name}: not a bcrypt hash ($2b$<cost>$...); {_MAKE_ONE}")
        elif (problem := _bcrypt_problem(hashed)) is not None:
            errors.append(f"{where}.{name}: {problem}")
        else:
            users[name] = hashed.encode("ascii")
    return users


_MAKE_ONE = ("create one with `htpasswd -nBC 12 USER` or python -c 'import bcrypt; "
             "print(bcrypt.hashpw(b\"PASSWORD\", bcrypt.gensalt(12)).decode())'")


def _bcrypt_problem(hashed: str) -> str | None:
    """Why a well-formed bcrypt hash cannot be used (None if it can): its cost outside
    MIN_BCRYPT_COST..MAX_BCRYPT_COST, or a salt or digest bcrypt never makes."""
    cost, salt, digest = _BCRYPT.fullmatch(hashed).groups()
    if not MIN_BCRYPT_COST <= int(cost) <= MAX_BCRYPT_COST:
        return (f"bcrypt cost {int(cost)} is outside {MIN_BCRYPT_COST}..{MAX_BCRYPT_COST} (every "
                f"check of a password costs 2^cost rounds, for anyone who can reach the port); "
                f"{_MAKE_ONE}")
    if _B64.index(salt[-1]) % 16:
        return (f"invalid bcrypt salt (its last character {salt[-1]!r} must be one of "
                f"'.', 'O', 'e', 'u'): every login would be refused; {_MAKE_ONE}")
    if _B64.index(digest[-1]) % 4:
        return (f"invalid bcrypt digest (its last character {digest[-1]!r} is not one bcrypt "
                f"writes): no password can match it; {_MAKE_ONE}")
    return None


def cost_of(hashed: bytes) -> int:
    """The cost of a bcrypt hash that load() accepted."""
    return int(hashed[4:6])


def load(path: str) -> WebConfig:
    """Parse and check a web config file; WebConfigError lists every problem."""
    import yaml

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise WebConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise WebConfigError([f"{path}: larger than {MAX_FILE_BYTES} bytes"])
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise WebConfigError([f"{path}: cannot parse YAML: {detail}"]) from None
    if not isinstance(data, dict):
        raise WebConfigError([f"{path}: expected a mapping at the top level"])
    errors: list[str] = []
    for key in data:
        if key in TOP_KEYS_UNSUPPORTED:
            errors.append(f"{path}: {key} is not supported by ckptwatch; remove it")
        elif key not in TOP_KEYS:
            errors.append(f"{path}: unknown key {key!r} (expected tls_server_config, "
                          "basic_auth_users)")
    tls = _tls(data["tls_server_config"], path, errors) \
        if data.get("tls_server_config") is not None else None
    users = _users(data["basic_auth_users"], path, errors) \
        if data.get("basic_auth_users") is not None else {}
    if errors:
        raise WebConfigError(errors)
    return WebConfig(tls=tls, users=users, path=path)


class BasicAuth:
    """Checks `Authorization: Basic ...` headers against bcrypt hashes.

    Every user name is compared in constant time and an unknown user costs one bcrypt check
    against the configured hash of the highest cost, so an unknown name answers no faster
    than the slowest real one (give every user the same cost and no name stands out).
    Correct passwords are remembered (a keyed digest, never the password) so regular scrapes
    skip bcrypt.
    """

    def __init__(self, users: Mapping[str, bytes]):
        self._users = dict(users)
        self._key = os.urandom(32)
        # Checked against when the user is unknown (the answer is "no" whatever bcrypt says),
        # so that case costs what the costliest user's wrong password does. Not a hash made
        # for the purpose: making one at the first unknown user made that answer twice as slow.
        self._dummy: bytes | None = max(self._users.values(), key=cost_of) \
            if self._users else None
        self._cache: dict[bytes, None] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def check(self, header: str | None) -> bool:
        """True if the header carries a configured user and its password."""
        if not self._users:
            return True
        user, password = _parse_basic(header)
        if user is None:
            return False
        hashed = None
        for name, candidate in self._users.items():
            if hmac.compare_digest(name.encode("utf-8", "surrogateescape"),
                                   user.encode("utf-8", "surrogateescape")):
                hashed = candidate
        digest = hmac.new(self._key, b"%s\0%s\0%s" % (
            user.encode("utf-8", "surrogateescape"), password, hashed or b""),
            hashlib.sha256).digest()
        with self._lock:
            if hashed is not None and digest in self._cache:
                return True
        import bcrypt
        try:
            ok = bcrypt.checkpw(password, hashed or self._dummy) and hashed is not None
        except ValueError:
            ok = False
        if ok:
            with self._lock:
                if len(self._cache) >= AUTH_CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[digest] = None
        return ok


def _parse_basic(header: str | None) -> tuple[str | None, bytes]:
    if not header:
        return None, b""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or len(value) > 4096:
        return None, b""
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None, b""
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None, b""
    # bcrypt only reads the first 72 bytes; longer is either a mistake or a probe.
    if len(password) > 72:
        return None, b""
    return user.decode("utf-8", "surrogateescape"), password
