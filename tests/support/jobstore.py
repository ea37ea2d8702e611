"""Job scope in this process: a job's master store and JobScopes driven as ranks' hooks drive
them, for the job-scope tests of both tiers. The store is torch's TCPStore (imported only when
one is made); JobScope itself is the standard library's."""
from __future__ import annotations

import datetime
import time

import pytest

from ckptwatch import jobscope
from ckptwatch.jobscope import JobScope
from ckptwatch.sharedfs import SharedPaths

# Marked shared storage for every Rank (CKPTWATCH_SHARED_PATHS), never created.
SHARED = "/tmp/ckptwatch-test-shared"


def master_store(port: int = 0):
    """A job's store as torchrun's master runs it (torch's TCPStore server, on loopback)."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def torch_key(wire_key: str) -> str:
    """The name torch's own TCPStore client gives a key job scope writes on the wire (torch's
    client puts "/" before every key it is given)."""
    assert wire_key.startswith("/")
    return wire_key[1:]


def ident(node: str, rank: int, local_rank: int, job="job-1", restart=0) -> dict:
    # One test process plays every rank: each gets its own pid in what it announces.
    return {"node": node, "pid": 100000 + rank, "rank": rank, "local_rank": local_rank,
            "world_size": 4, "local_world_size": 2, "node_rank": rank // 2, "job": job,
            "master": "127.0.0.1:29500", "restart": restart}


class Rank:
    """A JobScope as one rank's hook drives it, with what it sends to its agent."""

    def __init__(self, port: int, node: str, rank: int, local_rank: int, *,
                 shared_paths: str = SHARED, **kw):
        self.sent: list[dict] = []
        self.ident = ident(node, rank, local_rank)
        self.seq = 0
        self.scope = JobScope("127.0.0.1", port, self.ident, emit=self.sent.append,
                              shared=SharedPaths({"CKPTWATCH_SHARED_PATHS": shared_paths}),
                              **kw).start()

    def begin(self, path: str, writer: str | None = None):
        """A write starts; writer: the library (ckptwatch/writers), None: torch.save."""
        self.seq += 1
        pending = (self.ident, self.seq, path, None, None, time.time(), time.monotonic())
        if writer is None:
            self.scope.started(pending)             # as the torch.save hook calls it
        else:
            self.scope.started(pending, writer)
        return pending

    def end(self, pending, size: int = 4096) -> None:
        self.scope.ended(pending, time.time(), time.monotonic(), "ok", size)

    def save(self, path: str, hold: float = 0.0) -> None:
        pending = self.begin(path)
        time.sleep(hold)
        self.end(pending)

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.sent if e["type"] == kind]

    def active(self) -> bool:
        return self.scope.state == jobscope.STATE_ACTIVE

    def idle(self) -> bool:
        """Everything this rank announced has been sent and its notes taken in."""
        return not self.scope._frames and not self.scope._notes

    def remote_writers(self) -> list:
        """(node, rank, overlap) of the remote writes it reported, in report order."""
        return [(e["writer"]["node"], e["writer"]["rank"], e["overlap"])
                for e in self.of_type("remote")]


@pytest.fixture
def job_store():
    """A master store on a free port (tests that use it are marked torch)."""
    return master_store()
