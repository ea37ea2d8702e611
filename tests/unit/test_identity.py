"""ckptwatch.identity: rank/node/job from torchrun, SLURM and Open MPI environments."""
import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env
from ckptwatch import identity as identity_mod
from ckptwatch.identity import from_environ

PY = sys.executable

TORCHRUN_ENV = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "run-7",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
}


def test_torchrun_environment():
    ident = from_environ({**TORCHRUN_ENV, "CKPTWATCH_NODE": "node-a"})
    assert ident == {"node": "node-a", "pid": os.getpid(), "rank": 3, "local_rank": 1,
                     "world_size": 8, "local_world_size": 2, "node_rank": 1, "job": "run-7",
                     "master": "10.0.0.1:29500", "restart": 2}


def test_slurm_environment():
    ident = from_environ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16",
                          "SLURM_NODEID": "2", "SLURM_JOB_ID": "4242",
                          "SLURM_RESTART_COUNT": "1"})
    assert (ident["rank"], ident["local_rank"], ident["world_size"], ident["node_rank"]) == \
        (5, 1, 16, 2)
    assert ident["job"] == "4242"
    assert ident["restart"] == 1
    assert ident["local_world_size"] is None
    assert ident["master"] is None


def test_open_mpi_environment():
    ident = from_environ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                          "OMPI_COMM_WORLD_SIZE": "12", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                          "OMPI_COMM_WORLD_NODE_RANK": "1"})
    assert (ident["rank"], ident["local_rank"], ident["world_size"],
            ident["local_world_size"], ident["node_rank"]) == (6, 2, 12, 4, 1)
    assert ident["job"] is None


def test_torchrun_wins_over_slurm_when_both_are_set():
    # torchrun launched inside a SLURM allocation: the worker's own rank is RANK.
    ident = from_environ({**TORCHRUN_ENV, "SLURM_PROCID": "0", "SLURM_JOB_ID": "99"})
    assert ident["rank"] == 3
    assert ident["job"] == "run-7"


def test_job_precedence():
    env = {"CKPTWATCH_JOB": "mine", "TORCHELASTIC_RUN_ID": "elastic", "SLURM_JOB_ID": "17"}
    assert from_environ(env)["job"] == "mine"
    del env["CKPTWATCH_JOB"]
    assert from_environ(env)["job"] == "elastic"
    del env["TORCHELASTIC_RUN_ID"]
    assert from_environ(env)["job"] == "17"


def test_unparseable_ints_become_none():
    ident = from_environ({"RANK": "zero", "WORLD_SIZE": "", "LOCAL_RANK": " 2 "})
    assert ident["rank"] is None
    assert ident["world_size"] is None
    assert ident["local_rank"] == 2


def test_master_needs_both_address_and_port():
    assert from_environ({"MASTER_ADDR": "h"})["master"] is None
    assert from_environ({"MASTER_PORT": "1"})["master"] is None
    assert from_environ({"MASTER_ADDR": "h", "MASTER_PORT": "1"})["master"] == "h:1"


def test_node_defaults_to_host_name():
    assert from_environ({})["node"] == socket.gethostname()
    assert from_environ({"CKPTWATCH_NODE": "n7"})["node"] == "n7"


def test_identity_is_cached_until_reset(monkeypatch):
    identity_mod.reset()
    try:
        monkeypatch.setenv("RANK", "4")
        monkeypatch.setenv("CKPTWATCH_NODE", "cached-node")
        first = identity_mod.identity()
        monkeypatch.setenv("RANK", "5")
        assert identity_mod.identity() is first
        assert first["rank"] == 4
        identity_mod.reset()
        assert identity_mod.identity()["rank"] == 5
    finally:
        identity_mod.reset()


def test_identity_follows_variables_a_launcher_adds_later(monkeypatch):
    # PyTorch Lightning's rank 0 exports LOCAL_RANK, WORLD_SIZE, MASTER_* into its own
    # environment after the user's script started (and maybe already saved).
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    identity_mod.reset()
    try:
        early = identity_mod.identity()
        assert early["local_rank"] is None and early["master"] is None
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        later = identity_mod.identity()
        assert (later["local_rank"], later["world_size"], later["master"]) == \
            (0, 2, "127.0.0.1:29500")
    finally:
        identity_mod.reset()


def _run(code: str, **env) -> dict:
    out = subprocess.run([PY, "-c", code], env=subprocess_env(**env), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fork_child_gets_its_own_pid():
    result = _run("""
import json, os
from ckptwatch.identity import identity
parent = identity()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, json.dumps(identity()).encode()); os._exit(0)
os.waitpid(pid, 0)
child = json.loads(os.read(r, 65536))
print(json.dumps({"parent": parent["pid"], "child": child["pid"], "forked": pid,
                  "me": os.getpid(), "rank": child["rank"]}))
""", RANK="2")
    assert result["parent"] == result["me"]
    assert result["child"] == result["forked"] != result["me"]
    assert result["rank"] == 2


def test_identity_never_imports_torch():
    result = _run("""
import json, sys
from ckptwatch.identity import identity
identity()
print(json.dumps({"torch": "torch" in sys.modules}))
""")
    assert result == {"torch": False}


@pytest.mark.torch
def test_falls_back_to_initialised_torch_distributed():
    port = __import__("helpers").free_port()
    result = _run(f"""
import json
import torch.distributed as dist
from ckptwatch import identity as identity_mod
from ckptwatch.identity import identity
before = identity()["rank"]
# torch 2.13: the default group is read as an attribute, not through is_initialized()
direct = identity_mod._c10d is not None
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
after = identity()
dist.destroy_process_group()
print(json.dumps({{"before": before, "rank": after["rank"], "world": after["world_size"],
                  "direct": direct}}))
""")
    assert result == {"before": None, "rank": 0, "world": 1, "direct": True}



def test_node_rank_from_lightning_style_NODE_RANK():
    from ckptwatch.identity import from_environ
    assert from_environ({"NODE_RANK": "3"})["node_rank"] == 3
    # torchrun's GROUP_RANK wins where both are set.
    assert from_environ({"NODE_RANK": "3", "GROUP_RANK": "1"})["node_rank"] == 1


def test_default_group_read_directly_or_through_is_initialized(monkeypatch):
    # identity() asks torch.distributed on every save of a rank-less process: where c10d's
    # default group is a plain attribute (torch 2.x) it is read directly, else through
    # is_initialized(); either way a group made after the first save is seen at the next.
    import types
    from ckptwatch import identity as identity_mod
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)

    class World:
        def __init__(self):
            self._default_pg = None

    for layout in ("attribute", "is_initialized only"):
        world = World()
        dist = types.ModuleType("torch.distributed")
        dist.is_initialized = lambda: world._default_pg is not None
        dist.get_rank, dist.get_world_size = (lambda: 3), (lambda: 8)
        c10d = types.ModuleType("torch.distributed.distributed_c10d")
        if layout == "attribute":
            c10d._world = world
        monkeypatch.setitem(sys.modules, "torch.distributed", dist)
        monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
        identity_mod.reset()
        assert identity_mod.identity()["rank"] is None
        assert (identity_mod._c10d is c10d) == (layout == "attribute")
        world._default_pg = object()            # init_process_group after a first save
        found = identity_mod.identity()
        assert (found["rank"], found["world_size"]) == (3, 8), layout
    identity_mod.reset()


def test_a_torch_distributed_module_replaced_after_a_first_save_is_asked(monkeypatch):
    # identity()'s shortcut for a rank-less process reads the default group of the
    # torch.distributed it bound; a different module in sys.modules is asked afresh.
    import types
    from ckptwatch import identity as identity_mod
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)

    def fake(initialised: bool, rank: int):
        world = types.SimpleNamespace(_default_pg=object() if initialised else None)
        dist = types.ModuleType("torch.distributed")
        dist.is_initialized = lambda: world._default_pg is not None
        dist.get_rank, dist.get_world_size = (lambda: rank), (lambda: 8)
        c10d = types.ModuleType("torch.distributed.distributed_c10d")
        c10d._world = world
        return dist, c10d

    dist, c10d = fake(False, 3)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    identity_mod.reset()
    assert identity_mod.identity()["rank"] is None
    assert identity_mod.identity()["rank"] is None          # the shortcut, same answer
    dist, c10d = fake(True, 5)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    assert identity_mod.identity()["rank"] == 5
    identity_mod.reset()
