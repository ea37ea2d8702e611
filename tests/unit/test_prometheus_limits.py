"""Hostile label values: exporters/metrics/ under 20,000 distinct training_job and rank
values (issue 8, defect 4), job expiry with an injected clock, and gzip over real HTTP."""
from __future__ import annotations

import gzip
import tracemalloc
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from exporters.labels import OVERFLOW, LabelLimits
from exporters.metrics.collector import build_registry
from exporters.metrics.state import MetricsState
from labelflood import FLOOD, collision, flood, write


def scrape(port: int, encoding: str | None = None) -> tuple[dict, bytes]:
    headers = {"Accept-Encoding": encoding} if encoding else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(resp.headers.items()), resp.read()


def samples(body: str) -> list:
    return [s for f in text_string_to_metric_families(body) for s in f.samples]


def test_distinct_jobs_and_ranks_past_the_caps_keep_metrics_small(serve_metrics):
    state = MetricsState()
    flood(state)
    _, raw = scrape(serve_metrics(state=state).port)
    # 200,000 values made 312 MB (and 33 s per scrape) before label values were capped;
    # uncapped, these 20,000 make 19 MB.
    assert len(raw) < 1_000_000, f"/metrics is {len(raw):,} bytes"
    ours = [s for s in samples(raw.decode()) if s.name.startswith("ckptwatch_")]
    assert len(ours) < 5_000, f"{len(ours):,} ckptwatch samples"
    jobs = {s.labels["training_job"] for s in ours if "training_job" in s.labels}
    assert "__overflow__" in jobs and len(jobs) < 1_000
    assert not any("job" in s.labels for s in ours)
    overflowed = {s.labels["label"]: s.value for s in ours
                  if s.name == "ckptwatch_label_values_overflowed_total"}
    # Every update whose value did not fit is counted, not only the first: the writes of
    # all jobs past the cap, then every collision and finding (all of new jobs).
    limits = LabelLimits()
    held_jobs_in_writes = limits.max_jobs - 1              # "wide" holds one place
    assert overflowed["training_job"] == (FLOOD // 2 - held_jobs_in_writes) + 3 * (FLOOD // 10)
    assert overflowed["rank"] >= FLOOD // 2 - limits.max_ranks


def test_memory_of_the_state_is_bounded_under_the_flood():
    state = MetricsState()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        flood(state)
        state.snapshot()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Uncapped, the state holds every value: 18 MiB for these 20,000 (194 MiB for 200,000);
    # capped, it grows by under 0.5 MiB whatever the count.
    assert after - before < 4 * 1024 * 1024, f"state grew by {(after - before) >> 20} MiB"


def test_a_long_label_value_is_cut_and_stays_distinct():
    state = MetricsState()
    long_a, long_b = "a" * 5000 + "-1", "a" * 5000 + "-2"
    state.write_finished(write(long_a, 0))
    state.write_finished(write(long_b, 0))
    jobs = {s.labels["training_job"] for f in build_registry(state).collect()
            for s in f.samples if s.name == "ckptwatch_writes_total"}
    assert len(jobs) == 2
    assert all(len(j) <= 128 for j in jobs)


def test_a_value_json_can_carry_but_utf8_cannot_does_not_break_the_scrape(serve_metrics):
    state = MetricsState()
    state.write_finished(write("bad-\ud800-id", 0))      # a lone surrogate, valid in JSON
    headers, raw = scrape(serve_metrics(state=state).port)
    jobs = {s.labels.get("training_job") for s in samples(raw.decode())
            if s.name == "ckptwatch_writes_total"}
    assert jobs == {"bad-\\ud800-id"}


def value(state, name, **labels):
    return build_registry(state).get_sample_value(name, labels)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_idle_jobs_expire_and_free_their_place():
    clock = Clock()
    state = MetricsState(limits=LabelLimits(max_jobs=2, job_idle_expiry=3600), clock=clock)
    state.write_finished(write("old", 0))
    clock.now += 3000
    state.write_finished(write("recent", 0))
    state.collision(collision("recent"))
    # Both places are taken: a third job is exported as the overflow value, and counted.
    state.write_finished(write("third", 0))
    assert value(state, "ckptwatch_writes_total", training_job=OVERFLOW, rank=OVERFLOW) == 1
    assert value(state, "ckptwatch_label_values_overflowed_total", label="training_job") == 1

    clock.now += 601                    # "old" idle for 3601 s, "recent" for 601 s
    assert value(state, "ckptwatch_writes_total", training_job="old", rank="0") is None
    assert value(state, "ckptwatch_write_duration_seconds_count", training_job="old") is None
    assert value(state, "ckptwatch_writes_total", training_job="recent", rank="0") == 1
    assert value(state, "ckptwatch_collisions_total", training_job="recent",
                 kind="concurrent", scope="node", source="hook") == 1
    assert value(state, "ckptwatch_training_jobs_expired_total") == 1
    # The freed place goes to the next new job.
    state.write_finished(write("fourth", 3))
    assert value(state, "ckptwatch_writes_total", training_job="fourth", rank="3") == 1
    assert value(state, "ckptwatch_label_values", label="training_job") == 2


def test_a_job_with_writes_in_flight_does_not_expire():
    clock = Clock()
    state = MetricsState(limits=LabelLimits(job_idle_expiry=60), clock=clock)
    state.write_finished(write("long-save", 0))
    for _ in range(5):
        clock.now += 30
        state.set_active_writes({"long-save": 1})
    assert value(state, "ckptwatch_writes_total", training_job="long-save", rank="0") == 1
    state.set_active_writes({})
    clock.now += 61
    assert value(state, "ckptwatch_writes_total", training_job="long-save", rank="0") is None
    assert value(state, "ckptwatch_active_writes", training_job="long-save") is None


def test_zero_expiry_keeps_jobs():
    clock = Clock()
    state = MetricsState(limits=LabelLimits(job_idle_expiry=0), clock=clock)
    state.write_finished(write("kept", 0))
    clock.now += 10 * 365 * 86400
    assert value(state, "ckptwatch_writes_total", training_job="kept", rank="0") == 1


def test_ranks_are_capped_per_job_and_rank_pair():
    state = MetricsState(limits=LabelLimits(max_ranks=4))
    for rank in range(10):
        state.write_finished(write("big", rank))
    assert value(state, "ckptwatch_writes_total", training_job="big", rank="3") == 1
    assert value(state, "ckptwatch_writes_total", training_job="big", rank=OVERFLOW) == 6
    assert value(state, "ckptwatch_label_values_overflowed_total", label="rank") == 6
    # Per-job totals still count every write.
    assert value(state, "ckptwatch_write_duration_seconds_count", training_job="big") == 10


def test_overflow_counters_exist_at_zero():
    state = MetricsState()
    for label in ("training_job", "rank"):
        assert value(state, "ckptwatch_label_values_overflowed_total", label=label) == 0


def test_metrics_are_gzipped_when_the_scraper_asks(serve_metrics):
    state = MetricsState()
    for i in range(50):
        state.write_finished(write(f"job-{i}", i))
    port = serve_metrics(state=state).port
    plain_headers, plain = scrape(port)
    assert "Content-Encoding" not in plain_headers
    headers, raw = scrape(port, "gzip")
    assert headers["Content-Encoding"] == "gzip"
    body = gzip.decompress(raw)
    assert len(raw) < len(body) / 4
    names = {s.name for s in samples(body.decode())}
    assert "ckptwatch_writes_total" in names
    # q=0 refuses gzip.
    headers, raw = scrape(port, "gzip;q=0, identity")
    assert "Content-Encoding" not in headers and raw.startswith(b"#")
