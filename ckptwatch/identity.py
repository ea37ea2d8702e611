"""Who is this process: node, pid, rank, job — read from the launcher's environment.

Loaded into training processes: standard library only. torch.distributed is consulted only when
the launcher set no rank variables, and only if torch is already imported (never imported here).

The result is cached per process and reset after fork (a forked child has a new pid). The cache
is refreshed when the number of environment variables changes, because some launchers export
rank variables into an already running process.
"""
from __future__ import annotations

import os
import socket
import sys

NODE_ENV = "CKPTWATCH_NODE"
JOB_ENV = "CKPTWATCH_JOB"

# Each field: environment variables in priority order (torchrun/torchelastic, SLURM, Open MPI).
# torchrun is checked first because a torchrun inside a SLURM allocation sets both, and its
# values describe the worker while SLURM's describe the launcher task.
_INT_FIELDS = {
    "rank": ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"),
    "local_rank": ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "world_size": ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"),
    "local_world_size": ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "node_rank": ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID", "OMPI_COMM_WORLD_NODE_RANK"),
    "restart": ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"),
}
_JOB_VARS = (JOB_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")

_cached: dict | None = None
_cached_env_len = -1
# os.environ's backing dict: len() of it is a C call, len(os.environ) a Python one, and this
# runs on every save. Falls back to the mapping itself where the private attribute is absent.
_ENV_DATA = getattr(os.environ, "_data", os.environ)


def _parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _first(environ, names) -> str | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return value
    return None


def from_environ(environ) -> dict:
    """The identity described by `environ` (pure apart from the host name and pid)."""
    ident = {
        "node": environ.get(NODE_ENV) or socket.gethostname(),
        "pid": os.getpid(),
    }
    for field, names in _INT_FIELDS.items():
        ident[field] = _parse_int(_first(environ, names))
    ident["job"] = _first(environ, _JOB_VARS)
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    ident["master"] = f"{addr}:{port}" if addr and port else None
    return ident


_modules = sys.modules
_dist_module = None
_dist_is_initialized = None
_c10d = None        # torch.distributed.distributed_c10d when its default group can be read
                    # directly (see _distributed_rank), else None


def _bind_distributed(dist) -> None:
    """Learn, once per torch.distributed module, how to ask whether it is initialised."""
    global _dist_module, _dist_is_initialized, _c10d
    _dist_module = dist
    # is_initialized only exists when torch was built with distributed support.
    _dist_is_initialized = getattr(dist, "is_initialized", None)
    _c10d = None
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    # is_initialized() is `GroupMember.WORLD is not None`, three Python calls down to
    # c10d._world._default_pg (torch 2.x). Read that attribute instead when it is there and
    # agrees with is_initialized() now; c10d._world is looked up afresh on every save, so a
    # replaced _world is followed too.
    if (_dist_is_initialized is not None and world is not None
            and "_default_pg" in getattr(world, "__dict__", ())
            and (world._default_pg is not None) == bool(_dist_is_initialized())):
        _c10d = c10d


def _distributed_rank() -> tuple[int, int] | None:
    """(rank, world_size) from an initialised torch.distributed; None if not available.

    Only looks in sys.modules: importing torch.distributed here would cost seconds in a process
    that never uses it, and the hook must never change what a process imports. Runs on every
    save of a process without a launcher rank (a process can call init_process_group after it
    saved, and destroy_process_group later), so it is asked every time, as cheaply as the
    installed torch allows: one attribute read where _bind_distributed found it, else
    is_initialized().
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist is not _dist_module:
            _bind_distributed(dist)
        c10d = _c10d
        if c10d is not None:
            if c10d._world._default_pg is None:
                return None
        elif _dist_is_initialized is None or not _dist_is_initialized():
            return None
        return dist.get_rank(), dist.get_world_size()
    except Exception:
        return None


def identity() -> dict:
    """This process's identity: node, pid, rank, local_rank, world_size, local_world_size,
    node_rank, job, master, restart.

    Cached, and read again when variables were added to or removed from os.environ since: some
    launchers (PyTorch Lightning's rank 0, for one) export LOCAL_RANK, WORLD_SIZE and
    MASTER_ADDR/PORT into the running process after it may already have saved. A rank-less
    identity asks torch.distributed again on later calls until it is initialised.
    """
    global _cached, _cached_env_len
    ident = _cached
    env_len = len(_ENV_DATA)
    if ident is not None and env_len == _cached_env_len:
        # The save path's common cases, without a further call (issue 22): a rank from the
        # launcher, or no process group yet where c10d's default group is read directly and
        # torch.distributed is still the module it was read from.
        if ident["rank"] is not None:
            return ident
        c10d = _c10d
        try:
            if (c10d is not None and c10d._world._default_pg is None
                    and _modules.get("torch.distributed") is _dist_module):
                return ident
        except Exception:
            pass            # asked again below, through _distributed_rank()
    if ident is None or env_len != _cached_env_len:
        ident = _cached = from_environ(os.environ)
        _cached_env_len = env_len
    if ident["rank"] is None:
        found = _distributed_rank()
        if found is not None:
            ident = dict(ident)
            ident["rank"], ident["world_size"] = found
            _cached = ident
    return ident


def reset() -> None:
    """Forget the cached identity (after fork, or in tests after changing the environment)."""
    global _cached
    _cached = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=reset)
