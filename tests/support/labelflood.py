"""The hostile label flood: writes, collisions and findings under thousands of distinct
training_job and rank values, fed to a MetricsState (tests/unit/test_prometheus_limits.py
asserts what it costs; bench/label_flood.py prints it)."""
from __future__ import annotations

from monitor.detect.model import KIND_CONCURRENT, Collision, Write, Writer

# 200 times the job cap and 20 times the (job, rank) cap (LabelLimits): past the caps every
# value costs the same, so more values only make the test slower (200,000 took 6 s, most of it
# under tracemalloc). Uncapped, these 20,000 values cost 18 MiB, far over the memory bound
# of test_prometheus_limits; 200,000 are sent by tests/e2e/test_soak.py and bench/label_flood.py.
FLOOD = 20_000
PATH = "/data/ckpt/last.pt"


def write(job, rank, pid=100, start=10.0, duration=0.5):
    writer = Writer(node="node-a", pid=pid, rank=rank, job=job)
    return Write(writer=writer, path=PATH, seq=1, start_wall=1e9 + start, start_mono=start,
                 end_wall=1e9 + start + duration, end_mono=start + duration, bytes=1000,
                 outcome="ok", site="train.py:42", func="save")


def collision(job):
    writes = (write(job, 0), write(job, 1, pid=101, start=10.2))
    return Collision(path=PATH, kind=KIND_CONCURRENT, writes=writes, detected_wall=1e9)


def flood(state, n: int = FLOOD) -> None:
    """What a hostile (or merely huge) node sends to `state` (a MetricsState): every write a
    new job and a new rank, plus collisions, findings and in-flight writes under fresh job ids."""
    for i in range(n):
        # Half the writes name a new job, half a new rank of one wide job.
        state.write_finished(write(f"job-{i}" if i % 2 else "wide", i))
    for i in range(n // 10):
        state.collision(collision(f"collided-{i}"))
        state.finding("size_fluctuation", f"fluct-{i}")
        state.finding("torn_read", f"torn-{i}")
    state.set_active_writes({f"active-{i}": 1 for i in range(n // 10)})
