"""ckptwatch.jobscope: key layout, ticket order, an unreachable or late store (the store's
growth under 10,000 saves is tests/e2e/test_jobscope.py).

Real TCPStore servers (torch, loopback: the tests marked torch) and real JobScope threads; the
events they would send to the agent are collected from their emit callback.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from ckptwatch import jobscope
from ckptwatch.jobkeys import place_remote, run_prefix
from helpers import free_port, wait_for
from jobstore import SHARED, Rank, ident, master_store


# ---- pure parts ---------------------------------------------------------------------------

def test_run_prefix_separates_restarts_and_static_rendezvous_jobs():
    base = ident("a", 0, 0)
    assert run_prefix(base) == run_prefix(dict(base, rank=3, node="b"))   # one run, any rank
    assert run_prefix(base) != run_prefix(dict(base, restart=1))          # elastic restart
    none = dict(base, job="none")
    # TORCHELASTIC_RUN_ID=none: two jobs with different masters are two runs
    assert run_prefix(none) != run_prefix(dict(none, master="10.0.0.2:29500"))
    # ... while a named job does not depend on the master's address
    assert run_prefix(base) == run_prefix(dict(base, master="10.0.0.2:29500"))
    assert run_prefix(base).startswith("ckptwatch/")


def test_place_remote_follows_the_store_order_not_the_walls():
    own = {"sw": 1000.0, "sm": 50.0, "ew": 1001.0, "em": 51.0, "ts": 10, "te": 20}
    # The remote node's clock runs 5 s ahead: by walls no overlap, by tickets an overlap.
    start, end, overlap = place_remote(own, {"sw": 1005.2, "ew": 1006.0, "ts": 12, "te": 22})
    assert overlap is True and start < own["em"] and end > own["sm"]
    # Walls overlap (remote clock behind) but the store saw it start after ours ended.
    start, end, overlap = place_remote(own, {"sw": 1000.5, "ew": 1000.9, "ts": 21, "te": 22})
    assert overlap is False and start >= own["em"] and end >= start
    # ... or end before ours started.
    start, end, overlap = place_remote(own, {"sw": 1000.5, "ew": 1000.9, "ts": 5, "te": 9})
    assert overlap is False and end <= own["sm"] and start <= end
    # Without tickets the walls decide, mapped through our wall-mono offset.
    start, end, overlap = place_remote(own, {"sw": 1000.5, "ew": 1000.7})
    assert overlap is None and (start, end) == pytest.approx((50.5, 50.7))


# ---- with a real store --------------------------------------------------------------------

@pytest.mark.torch
def test_two_nodes_learn_each_others_overlapping_write_and_name_the_hazards(job_store):
    a = Rank(job_store.port, "node-a", 0, 0)
    b = Rank(job_store.port, "node-b", 2, 0)
    c = Rank(job_store.port, "node-a", 1, 1)             # a local peer of a: not reported remote
    wait_for(lambda: a.active() and b.active() and c.active(), message="connected")
    path = os.path.join(SHARED, "last.pt")
    pa, pb, pc = a.begin(path), b.begin(path), c.begin(path)
    # The three starts have their store tickets before any end takes one: the writes overlap
    # in the store's order, whatever the scheduler does with the scopes' threads.
    wait_for(lambda: all(r.scope.counters["announced"] == 1 for r in (a, b, c)),
             message="the three starts announced")
    for rank, pending in ((a, pa), (b, pb), (c, pc)):
        rank.end(pending)
    wait_for(lambda: a.of_type("remote") and b.of_type("remote"), message="remote reports")
    # No more reports are to come (c is a's local peer): one poll of the path (POLL_FIRST)
    # and slack after the first reports would have brought them.
    time.sleep(jobscope.POLL_FIRST + 0.1)
    remote_a = a.of_type("remote")
    assert [(e["writer"]["node"], e["writer"]["rank"], e["overlap"]) for e in remote_a] == [
        ("node-b", 2, True)]
    assert remote_a[0]["seq"] == pa[1] and remote_a[0]["path"] == path
    assert remote_a[0]["start_mono"] <= remote_a[0]["end_mono"]
    assert sorted(e["writer"]["rank"] for e in b.of_type("remote")) == [0, 1]
    # local_rank_guard: only b (local rank 0, global rank 2); multi-writer: all three.
    assert [h["kind"] for h in b.of_type("hazard")].count("local_rank_guard") == 1
    assert "local_rank_guard" not in [h["kind"] for h in a.of_type("hazard")]
    multi = [h for h in a.of_type("hazard") if h["kind"] == "shared_storage_multi_writer"]
    assert multi and multi[0]["ranks"] == [0, 1, 2]
    for rank in (a, b, c):
        assert rank.of_type("jobscope")[0]["state"] == "active"


@pytest.mark.torch
def test_a_later_writer_is_found_by_the_earlier_ones_poll(job_store):
    a = Rank(job_store.port, "node-a", 0, 0)
    b = Rank(job_store.port, "node-b", 2, 0)
    wait_for(lambda: a.active() and b.active(), message="connected")
    path = os.path.join(SHARED, "later.pt")
    a.save(path)
    # a's end read the path and its first polls (POLL_FIRST, then twice that) re-read it:
    # alone on it, a has nothing to report.
    time.sleep(0.5)
    assert a.of_type("remote") == []
    b.save(path)
    # a learns of b by re-reading its recent path (not at its own end, which was earlier).
    found = wait_for(lambda: a.of_type("remote"), timeout=10, message="a's poll")
    assert found[0]["overlap"] is False and found[0]["writer"]["rank"] == 2


def test_unreachable_store_never_blocks_a_save_and_disables_job_scope():
    port = free_port()                   # nobody listens
    a = Rank(port, "node-a", 2, 0, connect_budget=0.5)
    t0 = time.perf_counter()
    for i in range(1000):
        a.save(os.path.join(SHARED, "x.pt"))
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0                 # the save path is a deque append, store or not
    wait_for(lambda: a.scope.state == "disabled", timeout=10, message="disabled")
    states = a.of_type("jobscope")
    assert [s["state"] for s in states] == ["disabled"] and "unreachable" in states[0]["reason"]
    # local_rank_guard needs no store.
    wait_for(lambda: a.of_type("hazard"), message="the hazard without a store")
    assert a.of_type("remote") == []


@pytest.mark.torch
def test_ranks_started_before_the_store_connect_once_it_is_up():
    port = free_port()
    a = Rank(port, "node-a", 0, 0)
    # The store comes up after the rank has been trying for a while (0.5 s of a 60 s
    # CONNECT_BUDGET: it keeps trying instead of giving up).
    time.sleep(0.5)
    assert a.scope.state == "connecting"
    server = master_store(port)
    wait_for(lambda: a.active(), timeout=15, message="connected after the store came up")
    assert server.num_keys() == 0       # connecting wrote nothing


@pytest.mark.torch
def test_a_store_that_goes_away_disables_job_scope_and_saves_go_on():
    port = free_port()
    holder = {}
    ready = threading.Event()

    def serve():
        holder["server"] = master_store(port)
        ready.set()

    threading.Thread(target=serve, daemon=True).start()
    ready.wait(10)
    a = Rank(port, "node-a", 0, 0, op_timeout=1.0)
    wait_for(lambda: a.active(), message="connected")
    del holder["server"]                 # the server shuts down with its last reference
    import gc
    gc.collect()
    for _ in range(20):
        a.save(os.path.join(SHARED, "gone.pt"))
    wait_for(lambda: a.scope.state == "disabled", timeout=20, message="disabled after loss")
    assert [s["state"] for s in a.of_type("jobscope")] == ["active", "disabled"]


def test_start_if_distributed_needs_the_whole_environment(monkeypatch):
    monkeypatch.setattr(jobscope, "_instance", None)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0"}
    assert jobscope.start_if_distributed(ident("a", 0, 0), env) is None
    assert jobscope.start_if_distributed(ident("a", 0, 0),
                                         dict(env, WORLD_SIZE="2", CKPTWATCH_JOBSCOPE="0")) is None
    # a single-node job (every rank local): its agent sees all of them already
    assert jobscope.start_if_distributed(ident("a", 0, 0),
                                         dict(env, WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")) is None
