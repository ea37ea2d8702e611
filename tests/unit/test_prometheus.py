"""exporters/metrics/: every metric from a fresh registry, a real HTTP server, promtool."""
from __future__ import annotations

import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import \
    text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from exporters.metrics.collector import build_registry
from exporters.metrics.components import (DetectorCollector, FsCollector, IngestCollector,
                                          JournalCollector)
from exporters.metrics.listen import parse_listen_address
from exporters.metrics.server import MetricsServer
from exporters.metrics.state import DURATION_BUCKETS, MetricsState
from ckptwatch.events import REJECT_REASONS
from monitor.detect.model import KIND_CONCURRENT, KIND_REDUNDANT, Collision, Write, Writer
from ckptwatch.version import __version__

PATH = "/data/run-7/checkpoints/last.pt"
BUCKET = "ckptwatch_write_duration_seconds_bucket"


def write(pid=100, rank=0, job="job-a", start=10.0, duration=0.5, nbytes=1000,
          outcome="ok", path=PATH, wall=1_700_000_000.0):
    writer = Writer(node="node-a", pid=pid, rank=rank, job=job)
    return Write(writer=writer, path=path, seq=1, start_wall=wall + start, start_mono=start,
                 end_wall=wall + start + duration, end_mono=start + duration, bytes=nbytes,
                 outcome=outcome, site="train.py:42", func="save")


def collision(kind=KIND_CONCURRENT, job="job-a", detected=1_700_000_100.0):
    writes = (write(pid=100, rank=0, job=job), write(pid=101, rank=1, job=job, start=10.2))
    return Collision(path=PATH, kind=kind, writes=writes, detected_wall=detected)


@pytest.fixture
def state():
    return MetricsState()


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_writes_bytes_and_duration_by_job_and_rank(state):
    state.write_finished(write(rank=0, duration=0.5, nbytes=1000))
    state.write_finished(write(rank=0, duration=2.0, nbytes=3000))
    state.write_finished(write(rank=None, job=None, duration=0.0005, nbytes=None))
    reg = build_registry(state)
    assert value(reg, "ckptwatch_writes_total", training_job="job-a", rank="0") == 2
    # Unknown rank and job are exported as empty label values, not dropped.
    assert value(reg, "ckptwatch_writes_total", training_job="", rank="") == 1
    assert value(reg, "ckptwatch_write_bytes_total", training_job="job-a") == 4000
    # A write with unknown size counts as a write but adds no bytes.
    assert value(reg, "ckptwatch_write_bytes_total", training_job="") is None
    assert value(reg, "ckptwatch_write_duration_seconds_count", training_job="job-a") == 2
    assert value(reg, "ckptwatch_write_duration_seconds_sum", training_job="job-a") == 2.5
    assert value(reg, BUCKET, training_job="job-a", le="0.5") == 1
    assert value(reg, BUCKET, training_job="job-a", le="1.0") == 1
    assert value(reg, BUCKET, training_job="job-a", le="2.5") == 2
    assert value(reg, BUCKET, training_job="job-a", le="+Inf") == 2
    assert value(reg, BUCKET, training_job="", le="0.001") == 1


def test_duration_buckets_span_a_millisecond_to_ten_minutes(state):
    assert DURATION_BUCKETS[0] == 0.001 and DURATION_BUCKETS[-1] == 600.0
    state.write_finished(write(duration=599.0))
    state.write_finished(write(duration=3600.0))
    reg = build_registry(state)
    assert value(reg, BUCKET, training_job="job-a", le="300.0") == 0
    assert value(reg, BUCKET, training_job="job-a", le="600.0") == 1
    assert value(reg, BUCKET, training_job="job-a", le="+Inf") == 2


def test_failed_writes_are_counted_as_writes_and_errors(state):
    state.write_finished(write(outcome="OSError"))
    state.write_finished(write())
    reg = build_registry(state)
    assert value(reg, "ckptwatch_writes_total", training_job="job-a", rank="0") == 2
    assert value(reg, "ckptwatch_write_errors_total", training_job="job-a") == 1


def test_collisions_by_kind_scope_and_last_timestamp(state):
    state.collision(collision(detected=1_700_000_100.0))
    state.collision(collision(detected=1_700_000_300.0))
    state.collision(collision(kind=KIND_REDUNDANT, detected=1_700_000_200.0))
    reg = build_registry(state)
    assert value(reg, "ckptwatch_collisions_total", training_job="job-a", kind="concurrent",
                 scope="node", source="hook") == 2
    assert value(reg, "ckptwatch_collisions_total", training_job="job-a", kind="redundant",
                 scope="node", source="hook") == 1
    # The latest, not the last reported (collisions become final out of order).
    assert value(reg, "ckptwatch_last_collision_timestamp_seconds",
                 training_job="job-a", kind="concurrent", scope="node") == 1_700_000_300.0
    # Per kind: the alerts on concurrent and redundant collisions each read their own.
    assert value(reg, "ckptwatch_last_collision_timestamp_seconds",
                 training_job="job-a", kind="redundant", scope="node") == 1_700_000_200.0


def verdicts(reg, job="job-a", kind="concurrent", scope="node"):
    """{result: 1} of ckptwatch_last_collision_verification for one job, kind and scope."""
    return {s.labels["result"]: s.value for f in reg.collect() for s in f.samples
            if s.name == "ckptwatch_last_collision_verification"
            and (s.labels["training_job"], s.labels["kind"], s.labels["scope"]) ==
            (job, kind, scope)}


def test_the_latest_collisions_file_verdict_follows_the_verifier(state):
    """What the collision alert says about the file (issue 20: it said "very probably
    corrupt" for a file the agent had verified whole)."""
    reg = build_registry(state)
    c = collision(detected=1_700_000_100.0)
    state.collision(c)
    assert verdicts(reg) == {"pending": 1}
    # Another path's verdict says nothing about this one.
    state.verification("corrupt", "torn", job="job-a", path="/other.pt",
                       wall=1_700_000_101.0)
    assert verdicts(reg) == {"pending": 1}
    state.verification("ok", job="job-a", path=PATH, wall=1_700_000_102.0)
    assert verdicts(reg) == {"ok": 1}
    # A later save of the same path, verified again, is not what the collision left...
    state.verification("corrupt", "torn", job="job-a", path=PATH, wall=1_700_000_200.0)
    assert verdicts(reg) == {"ok": 1}
    # ...unless the verifier names the collision.
    later = (write(pid=100, rank=0, start=290.0), write(pid=101, rank=1, start=290.2))
    state.collision(Collision(path=PATH, kind=KIND_CONCURRENT, writes=later,
                              detected_wall=1_700_000_300.0, id="c2"))
    assert verdicts(reg) == {"pending": 1}
    state.verification("corrupt", "torn", job="job-a", path="/renamed.pt", collision_id="c2",
                       wall=1_700_000_301.0)
    assert verdicts(reg) == {"corrupt": 1}
    # One series per (job, kind, scope): the redundant collision has its own.
    state.collision(Collision(path=PATH, kind=KIND_REDUNDANT, writes=later,
                              detected_wall=1_700_000_400.0))
    assert verdicts(reg, kind="redundant") == {"pending": 1}
    assert verdicts(reg) == {"corrupt": 1}


def test_a_verdict_that_came_before_its_collision_was_published_counts(state):
    """A job-scope collision settles (3 s) after the verifier's quiet period (2 s): the
    verdict on its file arrives first."""
    c = collision(detected=1_700_000_100.0)
    ended = max(w.end_wall for w in c.writes)
    state.verification("corrupt", "torn", job="job-a", path=PATH, wall=ended + 2)
    state.collision(c)
    assert verdicts(build_registry(state)) == {"corrupt": 1}
    # A verdict from before the collision's writes ended is not about what they left.
    other = MetricsState()
    other.verification("ok", job="job-a", path=PATH, wall=ended - 5)
    other.collision(c)
    assert verdicts(build_registry(other)) == {"pending": 1}


def test_verification_off_says_so(state):
    off = MetricsState(verify_enabled=False)
    off.collision(collision())
    assert verdicts(build_registry(off)) == {"off": 1}


def test_a_corrupt_checkpoint_has_its_job_and_time(state):
    """CkptwatchCorruptCheckpoint had no training_job (issue 20)."""
    reg = build_registry(state)
    state.verification("corrupt", "torn", job="job-a", path=PATH, wall=1_700_000_100.0)
    state.verification("corrupt", "torn", job="job-a", path=PATH, wall=1_700_000_050.0)
    state.verification("corrupt", "truncated", job="", path="/x.pt", wall=1_700_000_200.0)
    state.verification("ok", job="job-b", path="/y.pt", wall=1_700_000_300.0)
    name = "ckptwatch_last_corrupt_checkpoint_timestamp_seconds"
    assert value(reg, name, training_job="job-a", reason="torn") == 1_700_000_100.0
    assert value(reg, name, training_job="", reason="truncated") == 1_700_000_200.0
    assert value(reg, name, training_job="job-b", reason="torn") is None


def test_collision_between_two_jobs_uses_the_collision_job_label(state):
    writes = (write(pid=1, job="job-a"), write(pid=2, job="job-b", start=10.1))
    c = Collision(path=PATH, kind=KIND_CONCURRENT, writes=writes, detected_wall=5.0)
    state.collision(c)
    reg = build_registry(state)
    assert value(reg, "ckptwatch_collisions_total", training_job=c.job_label, kind="concurrent",
                 scope="node", source="hook") == 1


def test_ingest_counters_rejects_prepopulated(state):
    # The ingest server's own counters, read when scraped (an IngestServer's attributes).
    ingest = SimpleNamespace(connections=0, refused={"pid_limit": 0, "uid_limit": 0},
                             evicted={"make_room": 0})
    reg = build_registry(state, IngestCollector(ingest))
    for reason in REJECT_REASONS:
        assert value(reg, "ckptwatch_events_rejected_total", reason=reason) == 0
    assert value(reg, "ckptwatch_events_received_total") == 0
    assert value(reg, "ckptwatch_client_events_dropped_total") == 0
    state.event_received()
    state.event_received(4)
    state.event_rejected("pid_mismatch")
    state.event_rejected("malformed", 3)
    state.client_dropped(7)
    ingest.connections = 3
    assert value(reg, "ckptwatch_events_received_total") == 5
    assert value(reg, "ckptwatch_events_rejected_total", reason="pid_mismatch") == 1
    assert value(reg, "ckptwatch_events_rejected_total", reason="malformed") == 3
    assert value(reg, "ckptwatch_client_events_dropped_total") == 7
    assert value(reg, "ckptwatch_ingest_connections") == 3
    ingest.refused, ingest.evicted = {"pid_limit": 5, "uid_limit": 0}, {"make_room": 2}
    assert value(reg, "ckptwatch_ingest_connections_refused_total", reason="pid_limit") == 5
    assert value(reg, "ckptwatch_ingest_connections_refused_total", reason="uid_limit") == 0
    assert value(reg, "ckptwatch_ingest_connections_evicted_total", reason="make_room") == 2


def test_gauges_reflect_current_state_only(state):
    detector = SimpleNamespace(tracked_paths=0, evicted_paths_total=0, refused_starts={},
                               remote_rejected={})
    journal = SimpleNamespace(errors=0, records_lost=0)
    reg = build_registry(state, DetectorCollector(detector), JournalCollector(journal))
    state.set_active_writes({"job-a": 3, "job-b": 1})
    assert value(reg, "ckptwatch_active_writes", training_job="job-a") == 3
    state.set_active_writes({"job-b": 2})
    # Built fresh on every scrape: a job with no writes in flight disappears.
    assert value(reg, "ckptwatch_active_writes", training_job="job-a") is None
    assert value(reg, "ckptwatch_active_writes", training_job="job-b") == 2
    detector.tracked_paths, detector.evicted_paths_total = 12, 4
    journal.errors, journal.records_lost = 3, 40
    assert value(reg, "ckptwatch_tracked_paths") == 12
    assert value(reg, "ckptwatch_tracked_paths_evicted_total") == 4
    assert value(reg, "ckptwatch_journal_errors_total") == 3
    assert value(reg, "ckptwatch_journal_records_lost_total") == 40


def test_build_info_and_process_metrics(state):
    reg = build_registry(state)
    assert value(reg, "ckptwatch_build_info", version=__version__) == 1
    assert value(reg, "process_resident_memory_bytes") > 0
    # Deliberately not registered (see build_registry).
    assert value(reg, "python_info", implementation="CPython") is None


def test_snapshot_is_immutable_and_detached(state):
    state.write_finished(write())
    snap = state.snapshot()
    state.write_finished(write())
    assert snap.writes[("job-a", "0")] == 1
    with pytest.raises(TypeError):
        snap.writes[("job-a", "0")] = 5  # type: ignore[index]


def test_concurrent_updates_are_not_lost(state):
    def work():
        for _ in range(2000):
            state.event_received()
            state.write_finished(write())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reg = build_registry(state)
    assert value(reg, "ckptwatch_events_received_total") == 8000
    assert value(reg, "ckptwatch_writes_total", training_job="job-a", rank="0") == 8000
    assert value(reg, "ckptwatch_write_duration_seconds_count", training_job="job-a") == 8000


def test_registries_are_independent():
    a, b = MetricsState(), MetricsState()
    a.event_received(2)
    assert value(build_registry(a), "ckptwatch_events_received_total") == 2
    assert value(build_registry(b), "ckptwatch_events_received_total") == 0
    assert isinstance(build_registry(b), CollectorRegistry)


def test_no_label_value_holds_a_path(state):
    paths = [f"/data/job/ckpt-{i}.pt" for i in range(3)]
    for i, p in enumerate(paths):
        state.write_finished(write(path=p, rank=i))
        state.collision(Collision(path=p, kind=KIND_CONCURRENT,
                                  writes=(write(path=p), write(path=p, pid=2, start=10.1))))
    for family in build_registry(state).collect():
        for sample in family.samples:
            for label, text in sample.labels.items():
                assert "/" not in text, (sample.name, label, text)
                assert all(p not in text for p in paths)


# --- listen addresses ---------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    (":19400", ("", 19400)),
    ("127.0.0.1:19400", ("127.0.0.1", 19400)),
    ("[::1]:19400", ("::1", 19400)),
    ("localhost:0", ("localhost", 0)),
    ("0.0.0.0:65535", ("0.0.0.0", 65535)),
])
def test_parse_listen_address(text, expected):
    assert parse_listen_address(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("19400", "missing port"),
    ("host:", "not a number"),
    ("host:http", "not a number"),
    (":70000", "out of range"),
    ("::1:19400", "brackets"),
    ("[::1:19400", "missing ']'"),
    ("[::1]19400", "':port'"),
    ("[nothost]:1", "not an IPv6"),
    (":-1", "not a number"),
])
def test_parse_listen_address_errors_are_clear(text, fragment):
    with pytest.raises(ValueError, match=None) as err:
        parse_listen_address(text)
    assert fragment in str(err.value)


def test_server_rejects_bad_address_before_start():
    with pytest.raises(ValueError):
        MetricsServer("nope", CollectorRegistry())


# --- real HTTP server ---------------------------------------------------------------------

def get(url, accept=None):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type"), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type"), exc.read().decode()


@pytest.fixture
def fed_state(state):
    state.event_received(10)
    state.event_rejected("truncated")
    state.write_finished(write(rank=0))
    state.write_finished(write(rank=1, pid=101))
    state.set_active_writes({"job-a": 1})
    state.collision(collision())
    return state


@pytest.fixture
def server(fed_state, no_thread_leak):
    health = {"ok": True, "reason": ""}
    srv = MetricsServer("127.0.0.1:0", build_registry(fed_state),
                        health=lambda: (health["ok"], health["reason"]))
    srv.start()
    srv.health_state = health
    yield srv
    srv.stop()


def test_server_scrape_matches_state(server):
    status, ctype, body = get(f"http://127.0.0.1:{server.port}/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    key = ("ckptwatch_collisions_total",
           (("kind", "concurrent"), ("scope", "node"), ("source", "hook"),
            ("training_job", "job-a")))
    assert samples[key] == 1
    assert samples[("ckptwatch_writes_total", (("rank", "1"), ("training_job", "job-a")))] == 1
    assert samples[("ckptwatch_events_rejected_total", (("reason", "truncated"),))] == 1
    assert PATH not in body


def test_server_speaks_openmetrics_when_asked(server):
    status, ctype, body = get(f"http://127.0.0.1:{server.port}/metrics",
                              accept="application/openmetrics-text; version=1.0.0")
    assert status == 200 and ctype.startswith("application/openmetrics-text")
    # Real Prometheus servers ask for OpenMetrics first; the body must parse as such.
    families = {f.name: f for f in openmetrics_families(body)}
    (sample,) = families["ckptwatch_collisions"].samples
    assert sample.name == "ckptwatch_collisions_total" and sample.value == 1
    assert families["ckptwatch_write_duration_seconds"].type == "histogram"


def test_healthz_ok_and_unhealthy(server):
    assert get(f"http://127.0.0.1:{server.port}/healthz")[::2] == (200, "ok\n")
    server.health_state.update(ok=False, reason="ingest socket is gone")
    status, _, body = get(f"http://127.0.0.1:{server.port}/healthz")
    assert status == 503 and "ingest socket is gone" in body


def test_healthz_that_raises_is_unhealthy_not_fatal(fed_state, no_thread_leak):
    def broken():
        raise RuntimeError("boom")

    srv = MetricsServer("127.0.0.1:0", build_registry(fed_state), health=broken)
    srv.start()
    try:
        status, _, body = get(f"http://127.0.0.1:{srv.port}/healthz")
        assert status == 503 and "boom" in body
        # The server keeps serving after a failing health check.
        assert get(f"http://127.0.0.1:{srv.port}/metrics")[0] == 200
    finally:
        srv.stop()


def test_unknown_path_is_404(server):
    # "/" is the index page (tests/unit/test_metrics_tls.py).
    assert get(f"http://127.0.0.1:{server.port}/nope")[0] == 404
    assert get(f"http://127.0.0.1:{server.port}/metrics/x")[0] == 404


def _request(port, method, path):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, headers={"Accept-Encoding": "gzip"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/metrics", "/", "/healthz", "/-/healthy", "/-/ready",
                                  "/nope"])
def test_head_answers_like_get_without_a_body(server, path):
    """f503c65 answered HEAD /metrics with 501 (http.server's default)."""
    got = _request(server.port, "GET", path)
    head = _request(server.port, "HEAD", path)
    assert head[0] == got[0] and head[2] == b""
    for name in ("Content-Type", "Content-Encoding"):
        assert head[1].get(name) == got[1].get(name), name
    if path != "/metrics":       # a scrape's body changes between two requests
        assert head[1]["Content-Length"] == got[1]["Content-Length"] == str(len(got[2]))


def test_healthy_and_ready_are_separate_checks(fed_state, no_thread_leak):
    """/-/healthy is liveness, /-/ready (and /healthz) readiness, as Prometheus has them: an
    agent behind its queue is alive but not ready."""
    ready = {"ok": True}
    srv = MetricsServer("127.0.0.1:0", build_registry(fed_state),
                        health=lambda: (ready["ok"], "agent loop behind"),
                        healthy=lambda: (True, ""))
    srv.start()
    try:
        base = f"http://127.0.0.1:{srv.port}"
        assert [get(base + p)[0] for p in ("/-/healthy", "/-/ready", "/healthz")] == \
            [200, 200, 200]
        ready["ok"] = False
        assert get(base + "/-/healthy")[::2] == (200, "ok\n")
        assert get(base + "/-/ready")[::2] == (503, "agent loop behind\n")
        assert get(base + "/healthz")[0] == 503
        index = get(base + "/")[2]
        assert 'href="/-/healthy"' in index and 'href="/-/ready"' in index
    finally:
        srv.stop()


def test_telemetry_path_cannot_hide_a_health_endpoint(fed_state):
    for path in ("/", "/healthz", "/-/healthy", "/-/ready"):
        with pytest.raises(ValueError):
            MetricsServer("127.0.0.1:0", build_registry(fed_state), telemetry_path=path)


def test_start_stop_idempotent_and_port_freed(fed_state, no_thread_leak):
    srv = MetricsServer("127.0.0.1:0", build_registry(fed_state))
    assert srv.port is None
    srv.start()
    port = srv.port
    srv.start()
    assert srv.port == port and port > 0
    srv.stop()
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_ipv6_loopback_and_all_interfaces(fed_state, no_thread_leak):
    srv = MetricsServer(":0", build_registry(fed_state))
    srv.start()
    try:
        assert get(f"http://127.0.0.1:{srv.port}/healthz")[0] == 200
        try:
            v6 = MetricsServer("[::1]:0", build_registry(fed_state))
            v6.start()
        except OSError:
            pytest.skip("IPv6 loopback unavailable")
        try:
            assert get(f"http://[::1]:{v6.port}/healthz")[0] == 200
        finally:
            v6.stop()
    finally:
        srv.stop()


def test_port_in_use_raises_oserror(server, fed_state):
    other = MetricsServer(f"127.0.0.1:{server.port}", build_registry(fed_state))
    with pytest.raises(OSError):
        other.start()
    other.stop()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_real_scrape_passes_promtool_check_metrics(server):
    _, _, body = get(f"http://127.0.0.1:{server.port}/metrics")
    result = subprocess.run(["promtool", "check", "metrics"], input=body, text=True,
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool prints lint findings even with exit code 0 on some versions.
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result


def test_collision_source_label_one_sample_per_collision(state):
    from monitor.detect.model import SOURCE_FS
    both = Collision(path=PATH, kind=KIND_CONCURRENT, sources=("fs", "hook"),
                     writes=(write(pid=1), write(pid=2, start=10.1)), detected_wall=5.0)
    fs_only = Collision(path=PATH, kind=KIND_CONCURRENT, sources=(SOURCE_FS,),
                        writes=(write(pid=3), write(pid=4, start=10.1)), detected_wall=6.0)
    # Learnt only through job scope (other nodes' writes, reported by a local hook's job
    # scope): source "job", not "fs" (issue 16: exported as fs with no watcher running).
    job_only = Collision(path=PATH, kind=KIND_CONCURRENT, sources=("job",), scope="job",
                         writes=(write(pid=5), write(pid=6, start=10.1)), detected_wall=7.0)
    state.collision(both)
    state.collision(fs_only)
    state.collision(job_only)
    reg = build_registry(state)
    assert value(reg, "ckptwatch_collisions_total", training_job="job-a", kind="concurrent",
                 scope="job", source="job") == 1
    assert not value(reg, "ckptwatch_collisions_total", training_job="job-a",
                     kind="concurrent", scope="job", source="fs")
    assert value(reg, "ckptwatch_collisions_total", training_job="job-a", kind="concurrent",
                 scope="node", source="hook") == 1
    assert value(reg, "ckptwatch_collisions_total", training_job="job-a", kind="concurrent",
                 scope="node", source="fs") == 1


def test_filesystem_findings_and_source_stats(state):
    state.finding("size_fluctuation", "job-a")
    state.finding("torn_read", "job-a")
    state.finding("torn_read", "job-a")
    stats = {"events_lost": 2, "fallbacks": 1, "attributions": 5,
             "attribution_seconds": 0.25, "attribution_errors": 0,
             "roots": {"/ckpt": {"mode": "polling", "state": "watching"},
                       "/gone": {"mode": "inotify", "state": "missing"}}}
    reg = build_registry(state, FsCollector(SimpleNamespace(stats=lambda: stats)))
    assert value(reg, "ckptwatch_size_fluctuations_total", training_job="job-a") == 1
    assert value(reg, "ckptwatch_torn_reads_total", training_job="job-a") == 2
    assert value(reg, "ckptwatch_fs_events_lost_total") == 2
    assert value(reg, "ckptwatch_fs_watch_fallbacks_total") == 1
    assert value(reg, "ckptwatch_fs_watch_up", root_dir="/ckpt", mode="polling") == 1
    assert value(reg, "ckptwatch_fs_watch_up", root_dir="/gone", mode="inotify") == 0
    assert value(reg, "ckptwatch_attribution_seconds_total") == 0.25
