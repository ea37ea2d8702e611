"""Listen addresses for the metrics port (--web.listen-address), as node_exporter spells
them, and the URL paths the server keeps for itself. A module of its own so the agent's flag
validation needs no HTTP server."""
from __future__ import annotations

import ipaddress

# Health endpoints, open to probes (a kubelet cannot send basic auth): the route -> which check.
# /-/healthy and /-/ready are Prometheus' own names (exporters.health says what each means);
# /healthz is the readiness check under its older name, kept for existing probes.
HEALTH_ROUTES = {"/-/healthy": "healthy", "/-/ready": "ready", "/healthz": "ready"}
# Paths --web.telemetry-path may not take: the index page and the health endpoints.
RESERVED_PATHS = ("/", *HEALTH_ROUTES)


def parse_listen_address(text: str) -> tuple[str, int]:
    """Parse ":19400", "127.0.0.1:19400", "[::1]:19400", "host:0" into (host, port).

    host is "" for "all interfaces". Raises ValueError with a message naming the problem.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("listen address is empty; expected host:port, e.g. :19400")
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"listen address {text!r}: missing ']' after IPv6 address")
        host, rest = text[1:close], text[close + 1:]
        if not rest.startswith(":"):
            raise ValueError(f"listen address {text!r}: expected ':port' after ']'")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"listen address {text!r}: {host!r} is not an IPv6 address") \
                from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"listen address {text!r}: missing port; expected host:port, "
                             "e.g. :19400")
        if ":" in host:
            raise ValueError(f"listen address {text!r}: put IPv6 addresses in brackets, "
                             "e.g. [::1]:19400")
    if not port_text.isdigit():
        raise ValueError(f"listen address {text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"listen address {text!r}: port {port} is out of range 0-65535")
    return host, port
