"""Small shared test helpers: waiting without sleeping blindly, short socket paths, ports."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

# tests/support/ -> the repository
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, message=""):
    """Poll predicate() until it returns a truthy value; return it, or fail after timeout.
    The one way tests wait for something to happen (a fixed sleep either waits too long or,
    on a busy machine, not long enough). message: what was awaited, or a function giving it
    (called at the timeout, so it can say what the state was then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            what = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def short_tmpdir(prefix: str = "cw") -> str:
    """A short directory under /tmp: Unix socket paths must stay below 108 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def overlapping(writers: int) -> tuple[list, dict]:
    """(program, env) for demo_job whose `writers` writers overlap by construction
    (tests/support/overlapjob.py), for tests that need a concurrent collision, not a race."""
    program = os.path.join(REPO_ROOT, "tests", "support", "overlapjob.py")
    return [program], {"OVERLAP_DIR": short_tmpdir("cwov"), "OVERLAP_WRITERS": str(writers)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def subprocess_env(**extra) -> dict:
    """Environment for child Pythons: the repo importable, no inherited ckptwatch settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env
