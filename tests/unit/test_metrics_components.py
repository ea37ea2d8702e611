"""exporters/metrics/components.py: each component's collector reads it when scraped, a
component that cannot be read is left out without failing the scrape, and what a scrape reads
may be read while the loop changes it."""
from __future__ import annotations

import logging
import socket
import threading
from types import SimpleNamespace

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from exporters.metrics.collector import build_registry
from exporters.metrics.components import (DetectorCollector, HttpCollector, IngestCollector,
                                          JournalCollector, LoopCollector)
from exporters.metrics.server import HTTP_DROP_REASONS, MetricsServer
from exporters.metrics.state import MetricsState
from helpers import wait_for
from monitor.verify.worker import VerifySchedule


class Unreadable:
    """A component whose every counter raises, as a half-torn-down one might."""

    def __getattr__(self, name):
        raise RuntimeError(f"{name} is gone")


def test_a_component_is_read_at_each_scrape_not_copied():
    registry = CollectorRegistry()
    ingest = SimpleNamespace(connections=2, refused={"pid_limit": 0}, evicted={})
    IngestCollector(ingest, registry=registry)
    assert registry.get_sample_value("ckptwatch_ingest_connections") == 2
    ingest.connections = 5                      # nothing hands the new value over
    ingest.refused["pid_limit"] = 7
    assert registry.get_sample_value("ckptwatch_ingest_connections") == 5
    assert registry.get_sample_value("ckptwatch_ingest_connections_refused_total",
                                     {"reason": "pid_limit"}) == 7


def test_an_unreadable_component_is_left_out_and_the_scrape_still_answers(caplog):
    journal = SimpleNamespace(errors=1, records_lost=3)
    registry = build_registry(MetricsState(), IngestCollector(Unreadable()),
                              JournalCollector(journal))
    with caplog.at_level(logging.WARNING, logger="exporters.metrics.components"):
        text = generate_latest(registry).decode()
        generate_latest(registry)
    assert "ckptwatch_journal_records_lost_total 3.0" in text
    assert "ckptwatch_build_info" in text
    assert "ckptwatch_ingest_connections" not in text
    # Said once, not at every scrape.
    warnings = [r for r in caplog.records if "ingest server" in r.getMessage()]
    assert len(warnings) == 1


def test_a_component_that_fails_half_way_leaves_none_of_its_families():
    class HalfBroken:
        tracked_paths, evicted_paths_total, remote_rejected = 4, 0, {}

        @property
        def refused_starts(self):
            raise RuntimeError("dictionary changed size during iteration")

    registry = CollectorRegistry()
    DetectorCollector(HalfBroken(), registry=registry)
    assert registry.get_sample_value("ckptwatch_tracked_paths") is None


def test_a_component_is_read_again_once_it_can_be():
    registry = CollectorRegistry()
    collector = LoopCollector(Unreadable(), registry=registry)
    assert registry.get_sample_value("ckptwatch_loop_lag_seconds") is None
    collector.component = SimpleNamespace(oldest_wait=lambda: 2.5)
    assert registry.get_sample_value("ckptwatch_loop_lag_seconds") == 2.5


def test_the_metrics_server_counts_the_connections_it_drops(no_thread_leak):
    seen = []
    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), timeout=0.3,
                           on_dropped=seen.append)
    registry = CollectorRegistry()
    HttpCollector(server, registry=registry)
    server.start()
    try:
        for reason in HTTP_DROP_REASONS:
            assert registry.get_sample_value("ckptwatch_http_connections_dropped_total",
                                             {"reason": reason}) == 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
            assert idle.recv(1) == b""          # closed by the server's timeout
        wait_for(lambda: registry.get_sample_value(
            "ckptwatch_http_connections_dropped_total", {"reason": "timeout"}) == 1,
            message="the timeout counted")
        assert seen == ["timeout"]              # and still handed to on_dropped
    finally:
        server.stop()


def test_verification_vocabularies_are_handed_in_not_imported():
    bare = build_registry(MetricsState())
    assert bare.get_sample_value("ckptwatch_checkpoint_verifications_total",
                                 {"result": "ok"}) is None
    given = build_registry(MetricsState(verify_results=("ok", "corrupt"),
                                        corrupt_causes=("torn",)))
    assert given.get_sample_value("ckptwatch_checkpoint_verifications_total",
                                  {"result": "corrupt"}) == 0
    assert given.get_sample_value("ckptwatch_corrupt_checkpoints_total",
                                  {"reason": "torn"}) == 0


def test_the_pending_count_can_be_read_while_the_loop_changes_the_schedule():
    # A scrape thread counts while the loop thread re-queues and drains paths. Counting the
    # live tables in Python raised "dictionary changed size during iteration" within a few
    # thousand of these turns (0.05-0.12 s); pending() copies them first.
    schedule = VerifySchedule(quiet=0.0, max_paths=4096)
    errors, stop = [], threading.Event()

    def scrape():
        while not stop.is_set():
            try:
                schedule.pending()
            except RuntimeError as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for i in range(100_000):
            schedule.write_finished(f"/c/{i % 3000}.pt", "j", float(i))
            if i % 1000 == 999:
                schedule.due(float(i))
            if errors:
                break
    finally:
        stop.set()
        thread.join()
    assert errors == []
