"""ckptwatch.jobscope and ckptwatch.jobkeys: the write log and its order, what each rank reports,
an unreachable, late, gone or hostile store (the store's growth under 10,000 saves is
tests/e2e/test_jobscope.py; the wire client alone is tests/unit/test_storewire.py).

Real TCPStore servers (torch, loopback: the tests marked torch) and real JobScope threads; the
events they would send to the agent are collected from their emit callback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from ckptwatch import jobscope
from ckptwatch.jobkeys import (compacted, end_line, group_of, group_open, linked, log_key,
                               parse_log, path_hash, place_remote, run_prefix, start_line)
from helpers import REPO_ROOT, free_port, subprocess_env, wait_for
from jobstore import SHARED, Rank, ident, master_store, torch_key
from receiver import Receiver


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
    assert run_prefix(base).startswith("/ckptwatch/2/")


def test_place_remote_follows_the_store_order_not_the_walls():
    own = {"sw": 1000.0, "sm": 50.0, "ew": 1001.0, "em": 51.0, "ts": 10, "te": 20}
    # The remote node's clock runs 5 s ahead: by walls no overlap, by the log an overlap.
    start, end, overlap = place_remote(own, {"sw": 1005.2, "ew": 1006.0, "ts": 12, "te": 22})
    assert overlap is True and start < own["em"] and end > own["sm"]
    # Walls overlap (remote clock behind) but the store saw it start after ours ended.
    start, end, overlap = place_remote(own, {"sw": 1000.5, "ew": 1000.9, "ts": 21, "te": 22})
    assert overlap is False and start >= own["em"] and end >= start
    # ... or end before ours started.
    start, end, overlap = place_remote(own, {"sw": 1000.5, "ew": 1000.9, "ts": 5, "te": 9})
    assert overlap is False and end <= own["sm"] and start <= end
    # Without positions the walls decide, mapped through our wall-mono offset.
    start, end, overlap = place_remote(own, {"sw": 1000.5, "ew": 1000.7})
    assert overlap is None and (start, end) == pytest.approx((50.5, 50.7))


def _log(*events) -> bytes:
    """A write log from (kind, node, pid, seq, wall) tuples, in store order."""
    out = b""
    for kind, node, pid, seq, wall in events:
        who = dict(ident(node, 0, 0), pid=pid)
        out += start_line(who, seq, None, None, wall) if kind == "s" else \
            end_line(who, seq, wall, 10, "ok", "mount:nfs4")
    return out


def test_groups_are_decided_on_the_logs_order_so_every_reader_agrees():
    # a and b overlap, b and c overlap, a and c do not: one group of three, whoever reads it.
    log = _log(("s", "a", 1, 1, 10.0), ("s", "b", 2, 1, 10.1), ("e", "a", 1, 1, 10.2),
               ("s", "c", 3, 1, 10.3), ("e", "b", 2, 1, 10.4), ("e", "c", 3, 1, 10.5),
               ("s", "d", 4, 1, 10.6), ("e", "d", 4, 1, 10.7))
    writes = parse_log(log)
    by_node = {w.node: w for w in writes}
    for reader in "abc":
        assert {w.node for w in group_of(writes, by_node[reader])} == {"a", "b", "c"}
    assert [w.node for w in group_of(writes, by_node["d"])] == ["d"]
    # The same log read before c's end: the group is still open for every one of them.
    partial = parse_log(log[:log.index(b'"k":"e","n":"c"') - 2])
    assert all(group_open(group_of(partial, w)) for w in partial if w.node in "abc")


def test_linked_writes_are_a_chain_within_a_window_of_each_other():
    # a, then b 1 s after a's end, then c 0.9 s after b's: c starts two windows (of 1 s) after
    # a's end, yet is in a's chain through b; d is beyond every window.
    log = _log(("s", "a", 1, 1, 10.0), ("e", "a", 1, 1, 10.5), ("s", "b", 2, 1, 11.5),
               ("e", "b", 2, 1, 11.6), ("s", "c", 3, 1, 12.5), ("e", "c", 3, 1, 12.6),
               ("s", "d", 4, 1, 20.0), ("e", "d", 4, 1, 20.1), ("s", "e", 5, 1, 12.9))
    writes = {w.node: w for w in parse_log(log)}
    assert sorted(w.node for w in linked(list(writes.values()), writes["a"], 1.0)) == \
        ["b", "c", "e"]                          # e in flight: its start counts
    assert [w.node for w in linked(list(writes.values()), writes["d"], 1.0)] == []
    # A write whose lines are not in the log is placed by its walls.
    ghost = parse_log(_log(("s", "g", 9, 1, 9.0), ("e", "g", 9, 1, 9.2)))[0]
    assert sorted(w.node for w in linked(list(writes.values()), ghost, 1.0)) == \
        ["a", "b", "c", "e"]


def test_garbage_in_a_log_is_skipped_keeps_positions_and_texts_come_out_escaped():
    fake_site = "\x1b[2J\x1b[31mFAKE\x07 /etc/passwd:1"
    hostile = (b"\nnot json at all\n" + b"{" * 5000 + b"\n" + b"[1,2]\n"
               + b'\n{"k":"s","n":["x"],"p":1,"q":1,"w":1}\n'
               + b'\n{"k":"s","n":"evil","p":7,"q":1,"w":1e400,"site":"x"}\n'
               + b'\n{"k":"s","n":"evil","p":8,"q":1,"w":11.0,"r":"0","site":'
               + repr(fake_site).replace("'", '"').encode().replace(b"\\x1b", b"\\u001b")
               .replace(b"\\x07", b"\\u0007") + b"}\n")
    log = _log(("s", "a", 1, 1, 10.0)) + hostile + _log(("e", "a", 1, 1, 12.0))
    writes = parse_log(log)
    assert [(w.node, w.pid) for w in writes] == [("a", 1), ("evil", 8)]
    a, evil = writes
    assert a.done and (a.ts, a.te) == (1, 8)        # garbage lines count as positions
    assert evil.rank is None                         # "0" is not a rank
    assert "\x1b" not in evil.site and "\x07" not in evil.site and "\\x1b" in evil.site
    # A stray partial line glued to nothing: ours stay whole around it.
    assert parse_log(b'{"k":"s","n":"a"' + log)[0].node == "a"


def test_compaction_drops_a_stale_head_and_keeps_the_positions_of_the_rest():
    log = _log(("s", "a", 1, 1, 1.0), ("e", "a", 1, 1, 2.0), ("s", "b", 2, 1, 100.0),
               ("s", "c", 3, 1, 100.5), ("e", "b", 2, 1, 101.0))
    before = {w.node: (w.ts, w.te) for w in parse_log(log)}
    new = compacted(log, lambda key: key[0] == "a")
    assert new is not None and len(new) < len(log)
    after = {w.node: (w.ts, w.te) for w in parse_log(new)}
    assert after == {k: v for k, v in before.items() if k != "a"}
    assert compacted(new, lambda key: key[0] == "a") is None      # nothing stale left
    assert compacted(log, lambda key: True) == b""                  # all stale: delete


def test_a_writer_kind_travels_in_the_log_as_a_known_kind_or_other():
    """A safetensors/DCP/fsspec write's start line says its library ("wr"); torch.save's
    says nothing (no key: its line is as before). What a log says is bounded: a known kind
    as itself, anything else as "other"."""
    from ckptwatch import events
    from ckptwatch.jobkeys import remote_event
    who = dict(ident("a", 0, 0), pid=1)
    assert b'"wr"' not in start_line(who, 1, None, None, 10.0)
    log = start_line(who, 1, None, None, 10.0, "safetensors") + start_line(who, 2, None, None,
                                                                          10.0)
    for n, hostile in enumerate([5, "x" * 5000, "\x1b[2J", ["dcp"], {"a": 1}, True, "fsspec",
                                 "DCP"], start=3):
        line = start_line(who, n, None, None, 10.0)
        log += line.replace(b'"w":', b'"wr":' + json.dumps(hostile).encode() + b',"w":')
    log += end_line(who, 1, 11.0, 10, "ok", None) + end_line(who, 2, 11.0, 10, "ok", None)
    kinds = [w.writer_kind for w in parse_log(log)]
    assert kinds == ["safetensors", None] + ["other"] * 5 + ["fsspec", "other"]
    mine, other = parse_log(_log(("s", "b", 2, 1, 10.0), ("e", "b", 2, 1, 11.0)))[0], \
        parse_log(log)[0]
    event = remote_event(dict(ident("b", 1, 0), pid=2), 1, "/mnt/shared/x", 1.0, 2.0, mine,
                         other, 12.0)
    assert event["writer_kind"] == "safetensors" and event["writer"]["node"] == "a"
    assert events.validate(dict(event)) is not None       # the agent accepts it
    plain = remote_event(dict(ident("b", 1, 0), pid=2), 1, "/mnt/shared/x", 1.0, 2.0, mine,
                         parse_log(log)[1], 12.0)
    assert "writer_kind" not in plain


# ---- with a real store --------------------------------------------------------------------

@pytest.mark.torch
def test_two_nodes_learn_each_others_overlapping_write_and_name_the_hazards(job_store):
    a = Rank(job_store.port, "node-a", 0, 0)
    b = Rank(job_store.port, "node-b", 2, 0)
    c = Rank(job_store.port, "node-a", 1, 1)             # a local peer of a: not reported remote
    wait_for(lambda: a.active() and b.active() and c.active(), message="connected")
    path = os.path.join(SHARED, "last.pt")
    pa, pb, pc = a.begin(path), b.begin(path, writer="dcp"), c.begin(path)
    # The three starts are in the log before any end is sent: they overlap in the store's
    # order. (Sent within microseconds on three connections, a start and an end could reach
    # the server in either order: the ordering tolerance.)
    key = torch_key(log_key(run_prefix(a.ident), path_hash(path)))
    wait_for(lambda: job_store.check([key]) and job_store.get(key).count(b'"k":"s"') == 3,
             message="the three starts in the log")
    for rank, pending in ((a, pa), (b, pb), (c, pc)):
        rank.end(pending)
    wait_for(lambda: a.of_type("remote") and len(b.of_type("remote")) == 2,
             message="remote reports")
    wait_for(lambda: all(r.scope.counters["reads"] >= 2 for r in (a, b, c)),
             message="a watch read after the ends")
    assert a.remote_writers() == [("node-b", 2, True)]
    remote_a = a.of_type("remote")[0]
    assert remote_a["writer_kind"] == "dcp"        # b's library, across the store
    assert all("writer_kind" not in r for r in b.of_type("remote"))     # torch.save
    assert remote_a["seq"] == pa[1] and remote_a["path"] == path
    assert remote_a["start_mono"] <= remote_a["end_mono"]
    assert sorted(b.remote_writers()) == [("node-a", 0, True), ("node-a", 1, True)]
    # Every rank writes on node-a (local ranks 0 and 1): b, local rank 0 of node-b, alone on
    # its node, is the local_rank guard's pattern; nobody on node-a is.
    assert [h["kind"] for h in b.of_type("hazard")].count("local_rank_guard") == 1
    assert "local_rank_guard" not in [h["kind"] for h in a.of_type("hazard")]
    multi = [h for h in a.of_type("hazard") if h["kind"] == "shared_storage_multi_writer"]
    assert multi and multi[0]["ranks"] == [0, 1, 2]
    for rank in (a, b, c):
        assert rank.of_type("jobscope")[0]["state"] == "active"


@pytest.mark.torch
def test_every_rank_writing_is_not_the_local_rank_guard(job_store):
    """Both local ranks of node-b write the path too (no guard at all): local rank 0 of
    node-b must not be told about a LOCAL_RANK == 0 guard it does not have."""
    ranks = [Rank(job_store.port, f"node-{n}", r, r % 2) for n, r in
             (("a", 0), ("a", 1), ("b", 2), ("b", 3))]
    wait_for(lambda: all(r.active() for r in ranks), message="connected")
    path = os.path.join(SHARED, "every.pt")
    pending = [r.begin(path) for r in ranks]
    for r, p in zip(ranks, pending):
        r.end(p)
    wait_for(lambda: all(r.scope.counters["reads"] >= 2 for r in ranks), message="reads")
    wait_for(lambda: all(r.of_type("hazard") for r in ranks), message="hazards")
    kinds = {h["kind"] for r in ranks for h in r.of_type("hazard")}
    assert kinds == {"shared_storage_multi_writer"}


@pytest.mark.torch
def test_a_hazard_learnt_from_a_node_that_sees_the_path_shared_is_not_lost(job_store):
    """Only node-b sees the path as shared storage: node-a's rank still reports the hazard,
    naming node-b's reason (issue 17: it went out with shared null and was refused)."""
    a = Rank(job_store.port, "node-a", 0, 0, shared_paths="/nowhere")
    b = Rank(job_store.port, "node-b", 2, 0)
    wait_for(lambda: a.active() and b.active(), message="connected")
    path = os.path.join(SHARED, "half-shared.pt")
    pa, pb = a.begin(path), b.begin(path)
    a.end(pa)
    b.end(pb)
    hazard = wait_for(lambda: a.of_type("hazard"), message="node-a's hazard")[0]
    assert hazard["kind"] == "shared_storage_multi_writer"
    assert hazard["shared"] == "node-b: CKPTWATCH_SHARED_PATHS"


@pytest.mark.torch
def test_a_later_writer_is_found_by_the_earlier_ones_watch(job_store):
    a = Rank(job_store.port, "node-a", 0, 0)
    b = Rank(job_store.port, "node-b", 2, 0)
    wait_for(lambda: a.active() and b.active(), message="connected")
    path = os.path.join(SHARED, "later.pt")
    a.save(path)
    wait_for(lambda: a.scope.counters["reads"] >= 2, message="a's first watch read")
    assert a.of_type("remote") == []
    b.save(path)
    # a learns of b by re-reading its recent path (not at its own end, which was earlier).
    found = wait_for(lambda: a.of_type("remote"), timeout=10, message="a's watch")
    assert found[0]["overlap"] is False and found[0]["writer"]["rank"] == 2
    assert b.remote_writers() == [("node-a", 0, False)]


@pytest.mark.torch
def test_a_later_writer_of_a_path_naming_an_earlier_ones_rank_is_found_a_window_later(
        job_store):
    """y3 of tests/e2e/test_groundtruth.py: rank 3 writes y3.pt (its rank in the name: no
    watch), another node's rank writes it 0.3 s later. Rank 3 reads once more a window after
    its end and reports it: a redundant write its agent must hear of."""
    a = Rank(job_store.port, "node-b", 3, 1, window=1.0)
    b = Rank(job_store.port, "node-a", 0, 0, window=1.0)
    wait_for(lambda: a.active() and b.active(), message="connected")
    path = os.path.join(SHARED, "y3.pt")
    a.save(path)
    wait_for(lambda: a.scope.counters["reads"] == 1, message="a's end read")
    time.sleep(0.3)
    b.save(path)
    found = wait_for(lambda: a.of_type("remote"), timeout=10, message="a's late read")
    assert found[0]["writer"]["rank"] == 0 and found[0]["overlap"] is False
    assert a.scope.counters["reads"] >= 2


@pytest.mark.torch
def test_a_rank_private_path_costs_a_bounded_number_of_store_operations(job_store):
    """A DCP shard named after its rank: 2 APPENDs and 1 GET, no watch reads (one more GET
    only a window after its end)."""
    a = Rank(job_store.port, "node-a", 3, 1)
    wait_for(lambda: a.active(), message="connected")
    before = a.scope.stats()["store_ops"]
    a.save(os.path.join(SHARED, "step-10", "__3_0.distcp"))
    wait_for(lambda: a.scope.counters["reads"] == 1, message="the end's read")
    time.sleep(jobscope.POLL_FIRST * 3)
    assert a.scope.stats()["store_ops"] - before == 3
    assert a.scope.counters["reads"] == 1


def test_unreachable_store_never_blocks_a_save_and_disables_job_scope():
    port = free_port()                   # nobody listens
    a = Rank(port, "node-a", 2, 0, connect_budget=0.5)
    t0 = time.perf_counter()
    for i in range(1000):
        a.save(os.path.join(SHARED, "x.pt"))
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0                 # the save path never waits, store or not
    wait_for(lambda: a.scope.state == "disabled", timeout=10, message="disabled")
    states = a.of_type("jobscope")
    assert [s["state"] for s in states] == ["disabled"] and "unreachable" in states[0]["reason"]
    # local_rank_guard needs no store (on the write alone).
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


# ---- a hostile store: values of our keys written by someone else of the job ----------------

@pytest.mark.torch
def test_a_fake_record_is_bounded_and_escaped_and_cannot_name_this_node(job_store):
    """A process of the job appends a well-formed record of a writer that does not exist, with
    escape codes in its call site, and one claiming to be a writer of our own node."""
    a = Rank(job_store.port, "node-a", 0, 0)
    wait_for(lambda: a.active(), message="connected")
    path = os.path.join(SHARED, "faked.pt")
    key = log_key(run_prefix(a.ident), path_hash(path))
    ghost = dict(ident("ghost\x1b]0;pwned\x07", 9, 0), pid=4242)
    local = dict(ident("node-a", 5, 1), pid=os.getpid())
    evil = start_line(ghost, 1, None, None, time.time()) + end_line(
        ghost, 1, time.time(), 1, "ok\x1b[31m", None)
    evil = evil.replace(b'"site":null', b'"site":"\\u001b[2Jx.py:1"')
    evil += start_line(local, 1, None, None, time.time()) + end_line(
        local, 1, time.time(), 1, "ok", None)
    job_store.append(torch_key(key), evil)      # through the job's own client
    a.save(path)
    wait_for(lambda: a.scope.counters["reads"] >= 1, message="read")
    reports = wait_for(lambda: a.of_type("remote"), message="the fake writer reported")
    # What it can do: add a writer of this path (labelled as learnt through the store); what
    # it cannot: put raw control characters anywhere, or pose as a writer of our node.
    assert [e["writer"]["pid"] for e in reports] == [4242]
    text = repr(reports)
    assert "\x1b" not in str(reports) and "\x07" not in str(reports), text
    assert reports[0]["writer"]["node"].startswith("ghost\\x1b")


@pytest.mark.torch
def test_an_oversized_log_is_skipped_without_holding_it_in_memory(job_store):
    a = Rank(job_store.port, "node-a", 0, 0)
    wait_for(lambda: a.active(), message="connected")
    path = os.path.join(SHARED, "huge.pt")
    key = log_key(run_prefix(a.ident), path_hash(path))
    job_store.set(torch_key(key), b"\xff" * (4 << 20))
    a.save(path)
    wait_for(lambda: a.scope.counters["oversized"] >= 1, message="skipped")
    assert a.scope.state == "active" and a.of_type("remote") == []
    a.save(os.path.join(SHARED, "fine.pt"))             # the rest of job scope goes on
    wait_for(lambda: a.scope.counters["reads"] >= 2, message="the next path is read")
    assert a.scope.state == "active"


@pytest.mark.torch
def test_many_oversized_values_leave_job_scope_active_and_unstuck(job_store):
    # Issue 17 item 3: 64 x 4 MiB of garbage under our prefix (one value per path a rank
    # writes) left job scope stuck on f503c65, and one run had both ranks abort.
    a = Rank(job_store.port, "node-a", 0, 0)
    wait_for(lambda: a.active(), message="connected")
    paths = [os.path.join(SHARED, f"junk{i}.pt") for i in range(64)]
    junk = b"\xff" * (4 << 20)
    for path in paths:
        job_store.set(torch_key(log_key(run_prefix(a.ident), path_hash(path))), junk)
    for path in paths:
        a.save(path)
    wait_for(lambda: a.scope.counters["oversized"] >= 64, timeout=120,
             message=lambda: f"every junk log skipped: {a.scope.stats()}")
    assert a.scope.state == "active" and a.of_type("remote") == []
    a.save(os.path.join(SHARED, "fine.pt"))             # and the next path is still read
    reads = a.scope.counters["reads"]
    wait_for(lambda: a.scope.counters["reads"] > reads, message="the next path is read")


@pytest.mark.torch
def test_a_non_numeric_exit_count_disables_job_scope_in_one_line_at_once(job_store, capfd,
                                                                        caplog):
    # Issue 17 item 3: on f503c65 a non-numeric value under job scope's ticket counter
    # disabled job scope with a 2.3 KB C++ traceback in every rank's stderr. The counter a
    # rank now adds to is the exit count: the store refuses the ADD and closes the connection,
    # and the rank says so in one warning and exits at once (no exit wait, no traceback).
    from ckptwatch.jobkeys import exit_key
    a = Rank(job_store.port, "node-a", 0, 0, exit_wait=30.0)
    wait_for(lambda: a.active(), message="connected")
    job_store.set(torch_key(exit_key(run_prefix(a.ident))), b"many\x1b[31m")
    a.save(os.path.join(SHARED, "last.pt"))
    wait_for(lambda: a.idle(), message="the save's lines sent")
    t0 = time.monotonic()
    with caplog.at_level("WARNING", "ckptwatch"):
        a.scope.close()
    assert time.monotonic() - t0 < 20, "the exit wait ran to its bound"
    assert a.scope.state == jobscope.STATE_DISABLED
    # The rank's own stderr: nothing (the "[c10d] Error processing client message" line is
    # the store server's, which this test runs in its own process; in a job it is torchrun's).
    err = [line for line in capfd.readouterr().err.splitlines() if "[c10d]" not in line]
    assert err == [], err
    said = [r.getMessage() for r in caplog.records if r.name.startswith("ckptwatch")]
    assert len(said) == 1 and "job scope disabled" in said[0], said
    assert "\x1b" not in said[0]


def _reference_line(obj: dict) -> bytes:
    # The lines as job scope wrote them before they were formatted from cached parts.
    import json
    return b"\n" + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def test_start_and_end_lines_read_as_the_dicts_they_stand_for():
    import json
    import random
    rng = random.Random(22)

    def site_code():
        def user_save():
            pass
        return user_save.__code__

    code = site_code()
    idents = [dict(ident("node-a", 3, 1), pid=4242), {"node": 'n"\\\u00e9', "pid": 7},
              dict(ident("b", 0, 0), pid=1, rank=None)]
    for _ in range(300):
        who = rng.choice(idents)
        seq = rng.randrange(1, 1 << 40)
        wall = rng.uniform(0, 2e9)
        where = rng.choice([(None, None), (code, rng.randrange(1, 5000))])
        writer = rng.choice([None, "safetensors", "dcp"])
        got = start_line(who, seq, *where, wall, writer)
        assert got[:1] == b"\n" and got[-1:] == b"\n" and got.count(b"\n") == 2
        assert json.loads(got) == json.loads(_reference_line(
            {"k": "s", "n": who.get("node"), "p": who.get("pid"), "q": seq,
             "r": who.get("rank"), "l": who.get("local_rank"), "ws": who.get("world_size"),
             "lws": who.get("local_world_size"), "nr": who.get("node_rank"),
             "w": float(f"{wall:.6f}"),
             "site": f"{where[0].co_filename}:{where[1]}" if where[0] else None,
             "func": where[0].co_name if where[0] else None,
             **({} if writer is None else {"wr": writer})}))
        size = rng.choice([None, 0, 4096, 1 << 45])
        outcome = rng.choice(["ok", "RuntimeError", 'Odd"Error'])
        shared = rng.choice([None, "mount:nfs4", 'x"y'])
        got = end_line(who, seq, wall, size, outcome, shared)
        assert got[:1] == b"\n" and got[-1:] == b"\n" and got.count(b"\n") == 2
        assert json.loads(got) == json.loads(_reference_line(
            {"k": "e", "n": who.get("node"), "p": who.get("pid"), "q": seq,
             "w": float(f"{wall:.6f}"), "b": size, "o": outcome, "sh": shared}))
    with pytest.raises(ValueError):
        start_line(idents[0], 1, None, None, float("nan"))


ANNOUNCE_THEN_EXIT = """
import os, sys, time
from ckptwatch import jobscope
from ckptwatch.sharedfs import SharedPaths
ident = {"node": "node-a", "pid": os.getpid(), "rank": 0, "local_rank": 0, "world_size": 2,
         "local_world_size": 1, "node_rank": 0, "job": "job-1", "master": "127.0.0.1:1",
         "restart": 0}
scope = jobscope.JobScope("127.0.0.1", int(sys.argv[1]), ident,
                          shared=SharedPaths({"CKPTWATCH_SHARED_PATHS": "/tmp/x"})).start()
while scope.state != jobscope.STATE_ACTIVE:
    time.sleep(0.0005)
os._exit(0)        # as a rank that saves and leaves at once does: no atexit, no flush
"""


@pytest.mark.torch
def test_the_announcement_is_in_the_agents_socket_before_the_state_turns_active(sock):
    # The agent reads the store for a hung-up process's writes only if it has this process's
    # "jobscope active" announcement (monitor/agent/storereader.py). A rank that saves once
    # job scope is active and then leaves through os._exit must not take the announcement
    # with it: it is in the socket before the state turns active. (Found by the cross-node
    # ground-truth test: one agent never learnt of a writer that exited right after saving.)
    server = master_store(0)
    port = server.port
    with Receiver(sock) as rx:
        for attempt in range(3):
            out = subprocess.run([sys.executable, "-c", ANNOUNCE_THEN_EXIT, str(port)],
                                 env=subprocess_env(CKPTWATCH_SOCKET=sock), cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            wait_for(lambda: len(rx.of_type("jobscope")) > attempt, timeout=5,
                     message=f"the announcement of exit {attempt + 1}")
        states = rx.of_type("jobscope")
        assert [s["state"] for s in states] == ["active"] * 3
        assert all(s["store_port"] == port for s in states)
