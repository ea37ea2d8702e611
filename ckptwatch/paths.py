"""Default locations shared by the hook and the agent, and who may own them (stdlib only).

The agent's socket is found, in order: CKPTWATCH_SOCKET if set (the operator's explicit
choice, used as given); else the system agent's well-known socket SYSTEM_SOCKET_DIR/agent.sock
when it exists and can be trusted; else $XDG_RUNTIME_DIR/ckptwatch/agent.sock; else
/tmp/ckptwatch-<uid>/agent.sock.

Trust (socket_problem): a default socket, and the directory holding it, must be owned by the
user asking or by root, the directory must be a real directory (not a symbolic link) that no
other user can change: not writable by others at all, and writable by its group only with the
sticky bit (then group members cannot remove or rename the agent's socket). Anybody who could
change that directory could swap the socket for their own and receive every event.
"""
from __future__ import annotations

import os
import stat

SOCKET_ENV = "CKPTWATCH_SOCKET"
DISABLE_ENV = "CKPTWATCH_DISABLE"
DEFAULT_METRICS_ADDRESS = ":19400"
SOCKET_NAME = "agent.sock"
# A system agent's socket directory. A module constant, not an environment variable: tests
# point it elsewhere in a subprocess; a job has CKPTWATCH_SOCKET to name any other socket.
SYSTEM_SOCKET_DIR = "/run/ckptwatch"


def system_socket_path() -> str:
    return os.path.join(SYSTEM_SOCKET_DIR, SOCKET_NAME)


def default_socket_path(environ=None) -> str:
    """$XDG_RUNTIME_DIR/ckptwatch/agent.sock, else /tmp/ckptwatch-<uid>/agent.sock: the
    per-user socket (the agent's default --ingest.socket)."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ckptwatch", SOCKET_NAME)
    return os.path.join("/tmp", f"ckptwatch-{os.getuid()}", SOCKET_NAME)


def candidate_socket_paths(environ=None) -> list[str]:
    """Where the hook looks for an agent when CKPTWATCH_SOCKET is unset, in order."""
    return [system_socket_path(), default_socket_path(environ)]


def socket_path(environ=None) -> str:
    """The socket a process would send to now: CKPTWATCH_SOCKET, else the first trusted
    candidate that exists, else the per-user default."""
    env = os.environ if environ is None else environ
    explicit = env.get(SOCKET_ENV)
    if explicit:
        return explicit
    return find_socket(env) or default_socket_path(env)


def find_socket(environ=None, uid: int | None = None) -> str | None:
    """The first candidate socket that exists and passes socket_problem(), or None."""
    uid = os.getuid() if uid is None else uid
    for path in candidate_socket_paths(environ):
        if socket_problem(path, uid) is None:
            return path
    return None


def directory_problem(directory: str, uid: int) -> str | None:
    """Why `directory` may not hold a socket that `uid` trusts, or None if it may."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"cannot inspect {directory}: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid not in (uid, 0):
        return f"{directory} is owned by uid {st.st_uid}, not by uid {uid} or root"
    if st.st_mode & stat.S_IWOTH:
        return f"{directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_ISVTX:
        return (f"{directory} is writable by its group without the sticky bit (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): group members could replace the socket")
    return None


def socket_problem(path: str, uid: int) -> str | None:
    """Why the socket at `path` may not be trusted by `uid`, or None (see module doc)."""
    problem = directory_problem(os.path.dirname(path) or ".", uid)
    if problem is not None:
        return problem
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror or exc}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if st.st_uid not in (uid, 0):
        return f"{path} is owned by uid {st.st_uid}, not by uid {uid} or root"
    return None


def disabled(environ=None) -> bool:
    """CKPTWATCH_DISABLE=1 (or true/yes/on) turns the hook off entirely."""
    env = os.environ if environ is None else environ
    return env.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
