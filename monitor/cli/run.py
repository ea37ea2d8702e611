"""`ckptwatch run [--socket PATH] -- CMD [ARGS...]`: run CMD with the hook in every Python.

The command replaces this process (os.execvpe), so signals, exit status and the process tree are
exactly the command's own. The bootstrap directory goes first on PYTHONPATH; its
sitecustomize.py patches torch.save in each Python process that imports torch — torchrun and
its workers inherit the environment. Pythons started with -E or -I ignore PYTHONPATH and are
not instrumented.
"""
from __future__ import annotations

import os
import shutil
import sys

from ckptwatch import paths
from ckptwatch.bootstrap import BOOTSTRAP_DIR

EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


def build_env(environ, socket: str | None = None) -> dict:
    """The environment for the instrumented command: a copy of environ with the bootstrap
    directory first on PYTHONPATH (the existing entries kept, ours not repeated) and
    CKPTWATCH_SOCKET set when socket is given."""
    env = dict(environ)
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.abspath(p) != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + existing)
    if socket:
        env[paths.SOCKET_ENV] = os.path.abspath(socket)
    return env


def run(argv: list[str], socket: str | None = None, verbosity: int = 1) -> int:
    """Exec argv with the hook active. Returns only on error: 2 without a command, 127 when
    the command is not found, 126 when it cannot be executed. verbosity >= 2 (-v): say on
    stderr what the command gets (the bootstrap directory, the socket)."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("ckptwatch run: no command given (usage: ckptwatch run [--socket PATH] -- CMD ...)",
              file=sys.stderr)
        return EXIT_USAGE
    env = build_env(os.environ, socket)
    if shutil.which(argv[0], path=env.get("PATH")) is None and not os.path.exists(argv[0]):
        print(f"ckptwatch run: command not found: {argv[0]}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if verbosity >= 2:
        print(f"ckptwatch run: PYTHONPATH starts with {BOOTSTRAP_DIR}; events go to "
              f"{env.get(paths.SOCKET_ENV) or paths.default_socket_path()}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        print(f"ckptwatch run: command not found: {argv[0]}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as exc:
        print(f"ckptwatch run: cannot execute {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    return EXIT_NOT_EXECUTABLE  # not reached: execvpe does not return
