"""Default locations shared by the hook and the agent (stdlib only)."""
from __future__ import annotations

import os

SOCKET_ENV = "CKPTWATCH_SOCKET"
DISABLE_ENV = "CKPTWATCH_DISABLE"
DEFAULT_METRICS_ADDRESS = ":19400"


def default_socket_path(environ=None) -> str:
    """$XDG_RUNTIME_DIR/ckptwatch/agent.sock, else /tmp/ckptwatch-<uid>/agent.sock."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ckptwatch", "agent.sock")
    return os.path.join("/tmp", f"ckptwatch-{os.getuid()}", "agent.sock")


def socket_path(environ=None) -> str:
    """The agent socket an instrumented process sends to: CKPTWATCH_SOCKET or the default."""
    env = os.environ if environ is None else environ
    return env.get(SOCKET_ENV) or default_socket_path(env)


def disabled(environ=None) -> bool:
    """CKPTWATCH_DISABLE=1 (or true/yes/on) turns the hook off entirely."""
    env = os.environ if environ is None else environ
    return env.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
