"""Prometheus exporter: agent state -> metric families, served on /metrics and /healthz.

The agent loop updates a MetricsState (thread-safe counters and gauges). On every scrape the
collector takes one immutable snapshot of it and builds fresh metric families, so nothing stale
survives and one scrape is internally consistent (prometheus/client_python's custom-collector
pattern).

Metric names and labels are part of the stable contract (design.md, issue 2). No label ever
holds a file path: paths are unbounded and would explode the series count; they live in the
journal and in `ckptwatch report` instead.

The training job's id is the label `training_job`, never `job`: Prometheus owns `job` (the
scrape job's name), and exporting it would need `honor_labels: true`, which the Prometheus
Operator may override. Label values that come from input (training_job, rank) are capped in
number and length (exporters.labels, issue 8), so no input can grow /metrics or the agent.
"""
from __future__ import annotations

import bisect
import errno
import http.server
import ipaddress
import gzip
import html
import logging
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import choose_encoder

from ckptwatch.events import REJECT_REASONS
from exporters.labels import OVERFLOW, LabelLimits, LabelValues, clean
from monitor.detect.detector import REFUSE_REASONS as START_REFUSE_REASONS
from monitor.ingest.server import EVICT_REASONS, REFUSE_REASONS
from monitor.verify.integrity import CAUSES as CORRUPT_CAUSES
from monitor.detect.model import (FINDING_HAZARD, FINDING_VERIFICATION, SOURCE_FS,
                                  SOURCE_HOOK, Collision, Finding, Write)
from monitor.verify.worker import RESULTS as VERIFY_RESULTS
from ckptwatch.version import __version__
from exporters.webconfig import BasicAuth, WebConfig

log = logging.getLogger(__name__)

# Labels whose values come from input, capped by LabelLimits.
INPUT_LABELS = ("training_job", "rank")

# Checkpoint saves range from a tiny state dict on tmpfs (~1 ms) to a multi-GB model on network
# storage (minutes); the buckets cover 1 ms .. 10 min with roughly 2-3x steps.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Histogram:
    """One label set's histogram: cumulative bucket counts (incl. +Inf), sum and count."""

    buckets: tuple[tuple[str, int], ...]
    sum: float
    count: int


@dataclass(frozen=True)
class MetricsSnapshot:
    """An immutable copy of MetricsState taken under its lock; what the collector reads."""

    # "job" below is the training_job label value (exporters.labels bounds them).
    writes: Mapping[tuple[str, str], int]              # (job, rank) -> finished writes
    write_errors: Mapping[str, int]                    # job -> writes whose outcome was not ok
    write_bytes: Mapping[str, int]                     # job -> bytes
    write_duration: Mapping[str, Histogram]            # job -> histogram
    active_writes: Mapping[str, int]                   # job -> writes in flight
    collisions: Mapping[tuple[str, str, str, str], int]  # (job, kind, scope, source) -> n
    last_collision: Mapping[tuple[str, str, str], float]  # (job, kind, scope) -> wall time
    events_received: int
    events_rejected: Mapping[str, int]                 # reason -> rejected inputs
    client_events_dropped: int
    tracked_paths: int
    tracked_paths_evicted: int
    journal_errors: int
    ingest_connections: int
    journal_records_lost: int = 0
    ingest_refused: Mapping[str, int] = field(default_factory=dict)   # reason -> connections
    ingest_evicted: Mapping[str, int] = field(default_factory=dict)   # reason -> connections
    http_dropped: Mapping[str, int] = field(default_factory=dict)     # reason -> connections
    fluctuations: Mapping[str, int] = field(default_factory=dict)   # job -> size fluctuations
    torn_reads: Mapping[str, int] = field(default_factory=dict)     # job -> torn reads
    fs: Mapping = field(default_factory=dict)                      # FsSource.stats(), or {}
    verifications: Mapping[str, int] = field(default_factory=dict)  # result -> files verified
    corrupt: Mapping[str, int] = field(default_factory=dict)        # cause -> corrupt files
    label_values: Mapping[str, int] = field(default_factory=dict)   # label -> values held
    label_values_overflowed: Mapping[str, int] = field(default_factory=dict)  # label -> n
    jobs_expired: int = 0                                           # jobs idle past expiry
    starts_refused: Mapping[str, int] = field(default_factory=dict)  # reason -> starts refused
    loop_lag: float = 0.0                  # seconds the oldest queued event has waited
    hazards: Mapping[tuple[str, str], int] = field(default_factory=dict)     # (job, kind) -> n
    job_scope: Mapping[tuple[str, str], int] = field(default_factory=dict)   # (job, state) -> n
    remote_writes: int = 0                                          # remote writes received
    remote_rejected: Mapping[str, int] = field(default_factory=dict)  # reason -> remote writes
    verifications_pending: int = 0         # paths and sets still to be verified


def _format_bound(bound: float) -> str:
    # Prometheus reads `le` as a float; repr keeps "0.001" and "600.0" exact and stable.
    return repr(float(bound))


class _JobSeries:
    """Every per-job series of one training_job label value, so expiring a job is one delete."""

    __slots__ = ("writes", "errors", "bytes", "duration_counts", "duration_sum", "collisions",
                 "last_collision", "fluctuations", "torn_reads", "hazards", "job_scope")

    def __init__(self):
        self.writes: dict[str, int] = {}                 # rank label value -> finished writes
        self.errors = 0
        self.bytes: int | None = None                    # None until a write reports bytes
        self.duration_counts: list[int] | None = None    # per bucket (non-cumulative), +Inf
        self.duration_sum = 0.0
        self.collisions: dict[tuple[str, str, str], int] = {}   # (kind, scope, source) -> n
        # (kind, scope) -> wall time of the latest: alerts compare it with time(), which no
        # scrape gap or Prometheus restart can make look new again (a counter's birth can).
        self.last_collision: dict[tuple[str, str], float] = {}
        self.fluctuations = 0
        self.torn_reads = 0
        self.hazards: dict[str, int] = {}                 # hazard kind -> n
        self.job_scope: dict[str, int] = {}               # job-scope state -> reports


class MetricsState:
    """Thread-safe metric state, updated by the agent loop and the ingest thread.

    One lock guards everything: updates are a few dict operations, far cheaper than a scrape,
    and a single lock makes snapshot() consistent across metrics.

    Label values that come from input (training_job, rank) are bounded by `limits`
    (exporters.labels): at most limits.max_jobs jobs and limits.max_ranks (job, rank) pairs at
    once, each cut to limits.max_value_length; what does not fit is exported as "__overflow__"
    and counted. A job unused for limits.job_idle_expiry seconds (by `clock`, monotonic) loses
    its series, which frees its place. So a scrape and the state cost O(limits), whatever the
    input.
    """

    def __init__(self, duration_buckets: tuple[float, ...] = DURATION_BUCKETS,
                 limits: LabelLimits = LabelLimits(),
                 clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._bounds = tuple(sorted(float(b) for b in duration_buckets))
        self._limits = limits
        self._clock = clock
        self._job_values = LabelValues(limits.max_jobs, limits.job_idle_expiry)
        # A job's ranks go with the job (one counter series dropping out of a running job
        # would look like a reset), never on their own: idle_expiry 0.
        self._rank_values = LabelValues(limits.max_ranks, 0)
        self._jobs: dict[str, _JobSeries] = {}
        self._active: dict[str, int] = {}
        # Present from the start at 0, as _rejected below.
        self._overflowed: dict[str, int] = {label: 0 for label in INPUT_LABELS}
        self._jobs_expired = 0
        self._received = 0
        # Every reason exists from the start at 0, so rate() and alerts work before the
        # first rejection (a counter that appears at 1 is invisible to increase()).
        self._rejected: dict[str, int] = {reason: 0 for reason in REJECT_REASONS}
        self._dropped = 0
        self._tracked_paths = 0
        self._evicted_total = 0
        self._journal_errors = 0
        self._journal_records_lost = 0
        self._ingest_connections = 0
        self._ingest_refused: dict[str, int] = {r: 0 for r in REFUSE_REASONS}
        self._ingest_evicted: dict[str, int] = {r: 0 for r in EVICT_REASONS}
        self._http_dropped: dict[str, int] = {r: 0 for r in HTTP_DROP_REASONS}
        # Bounded label sets, present from the start (see _rejected above).
        self._fs: dict = {}
        self._verifications: dict[str, int] = {r: 0 for r in VERIFY_RESULTS}
        self._corrupt: dict[str, int] = {c: 0 for c in CORRUPT_CAUSES}
        self._starts_refused: dict[str, int] = {r: 0 for r in START_REFUSE_REASONS}
        self._loop_lag = 0.0
        self._remote_writes = 0
        self._remote_rejected: dict[str, int] = {}
        self._verifications_pending = 0

    # -- bounded label values (call with the lock held) ------------------------------------

    def _job_label(self, job: str | None, now: float, count: bool = True) -> str:
        """The training_job label value for job: itself (cleaned) or OVERFLOW."""
        value = clean(job or "", self._limits.max_value_length)
        if self._job_values.admit(value, now):
            return value
        self._expire(now)                       # an idle job may free a place
        if self._job_values.admit(value, now):
            return value
        if count:
            self._overflowed["training_job"] += 1
        return OVERFLOW

    def _rank_label(self, job_value: str, rank: int | None, now: float) -> str:
        if rank is None:
            return ""
        if job_value == OVERFLOW:
            return OVERFLOW                     # ranks of jobs we do not hold are not held
        value = clean(str(rank), self._limits.max_value_length)
        if self._rank_values.admit((job_value, value), now):
            return value
        self._overflowed["rank"] += 1
        return OVERFLOW

    def _series(self, job_value: str) -> _JobSeries:
        series = self._jobs.get(job_value)
        if series is None:
            series = self._jobs[job_value] = _JobSeries()
        return series

    def _expire(self, now: float) -> None:
        """Drop the series (and rank places) of jobs unused for job_idle_expiry seconds."""
        for job in self._job_values.expire(now):
            series = self._jobs.pop(job, None)
            if series is not None:
                for rank in series.writes:
                    self._rank_values.discard((job, rank))
            self._active.pop(job, None)
            self._jobs_expired += 1

    # -- updates -------------------------------------------------------------------------

    def event_received(self, n: int = 1) -> None:
        with self._lock:
            self._received += n

    def event_rejected(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + n

    def client_dropped(self, n: int) -> None:
        """A sender reported n events it dropped because its queue was full."""
        with self._lock:
            self._dropped += n

    def write_finished(self, write: Write) -> None:
        """Count one finished write (any outcome) with its bytes and duration."""
        duration = write.duration
        with self._lock:
            now = self._clock()
            job = self._job_label(write.writer.job_label, now)
            rank = self._rank_label(job, write.writer.rank, now)
            series = self._series(job)
            series.writes[rank] = series.writes.get(rank, 0) + 1
            if write.outcome not in (None, "ok"):
                series.errors += 1
            if write.bytes is not None and write.bytes >= 0:
                series.bytes = (series.bytes or 0) + write.bytes
            if duration is not None:
                if series.duration_counts is None:
                    series.duration_counts = [0] * (len(self._bounds) + 1)
                series.duration_counts[bisect.bisect_left(self._bounds, duration)] += 1
                series.duration_sum += duration

    def collision(self, c: Collision) -> None:
        with self._lock:
            series = self._series(self._job_label(c.job_label, self._clock()))
            key = (c.kind, c.scope, collision_source(c))
            series.collisions[key] = series.collisions.get(key, 0) + 1
            when = c.detected_wall or max((w.end_wall or w.start_wall) for w in c.writes)
            series.last_collision[(c.kind, c.scope)] = max(
                when, series.last_collision.get((c.kind, c.scope), 0.0))

    def set_active_writes(self, by_job: dict[str, int]) -> None:
        """Replace the in-flight write counts; jobs absent from by_job drop out of the gauge.
        A job with writes in flight is in use, so it does not expire."""
        with self._lock:
            now = self._clock()
            active: dict[str, int] = {}
            for job, n in by_job.items():
                # Not counted as overflow: this runs every loop turn and would count the same
                # jobs again and again; their writes count once they finish.
                value = self._job_label(job, now, count=False)
                active[value] = active.get(value, 0) + int(n)
            self._active = active

    def set_detector_stats(self, tracked_paths: int, evicted_paths_total: int) -> None:
        with self._lock:
            self._tracked_paths = int(tracked_paths)
            self._evicted_total = int(evicted_paths_total)

    def set_journal_stats(self, errors: int, records_lost: int) -> None:
        """The journal's own totals (exporters.journal.Journal.errors / .records_lost)."""
        with self._lock:
            self._journal_errors = int(errors)
            self._journal_records_lost = int(records_lost)

    def finding(self, kind: str, job: str) -> None:
        """A filesystem finding: kind "size_fluctuation" or "torn_read"."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock()))
            if kind == "size_fluctuation":
                series.fluctuations += 1
            else:
                series.torn_reads += 1

    def hazard(self, job: str, kind: str) -> None:
        """A hazard (ckptwatch.events.HAZARD_KINDS: a bounded label set) for a job."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock()))
            series.hazards[kind] = series.hazards.get(kind, 0) + 1

    def job_scope(self, job: str, state: str) -> None:
        """A process reported its job-scope state (ckptwatch.events.JOBSCOPE_STATES)."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock()))
            series.job_scope[state] = series.job_scope.get(state, 0) + 1

    def set_remote_stats(self, received: int, rejected: Mapping[str, int]) -> None:
        """Remote writes (job scope) received, and those the detector did not take, by
        reason (monitor.detect.detector.REMOTE_REJECT_REASONS)."""
        with self._lock:
            self._remote_writes = int(received)
            self._remote_rejected = dict(rejected)

    def set_fs_stats(self, stats: dict) -> None:
        """The filesystem source's counters (monitor.fs.source.FsSource.stats())."""
        with self._lock:
            self._fs = dict(stats)

    def verification(self, result: str, cause: str = "") -> None:
        """One finished checkpoint verified: result ok|corrupt|unverifiable|gone; cause is
        the bounded corruption category (monitor.verify.integrity.CAUSES) for corrupt files."""
        with self._lock:
            self._verifications[result] = self._verifications.get(result, 0) + 1
            if cause:
                self._corrupt[cause] = self._corrupt.get(cause, 0) + 1

    def set_ingest_connections(self, n: int) -> None:
        with self._lock:
            self._ingest_connections = int(n)

    def set_ingest_limits(self, refused: Mapping[str, int], evicted: Mapping[str, int]) -> None:
        """The ingest server's totals by reason (IngestServer.refused / .evicted): new
        connections refused at a per-peer cap, open ones closed to make room or stalled."""
        with self._lock:
            self._ingest_refused = dict(refused)
            self._ingest_evicted = dict(evicted)

    def set_detector_limits(self, open_writes: int, refused: Mapping[str, int]) -> None:
        """The detector's starts refused at an open-write cap, by reason (Detector.
        refused_starts); open_writes is already exported per job as active writes."""
        with self._lock:
            self._starts_refused = dict(refused)

    def set_loop_lag(self, seconds: float) -> None:
        """How long the oldest event still queued for the agent loop has waited."""
        with self._lock:
            self._loop_lag = float(seconds)

    def set_verifications_pending(self, n: int) -> None:
        """Paths and checkpoint sets scheduled, queued or being verified now."""
        with self._lock:
            self._verifications_pending = int(n)

    def http_connection_dropped(self, reason: str) -> None:
        """A /metrics or /healthz connection closed early (HTTP_DROP_REASONS)."""
        with self._lock:
            self._http_dropped[reason] = self._http_dropped.get(reason, 0) + 1

    # -- reading ---------------------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        """One consistent copy; O(held series), which the label limits bound."""
        with self._lock:
            self._expire(self._clock())
            writes, errors, nbytes, histograms = {}, {}, {}, {}
            collisions, last_collision, fluctuations, torn_reads = {}, {}, {}, {}
            hazards, job_scope = {}, {}
            for job, series in self._jobs.items():
                for kind, n in series.hazards.items():
                    hazards[(job, kind)] = n
                for state, n in series.job_scope.items():
                    job_scope[(job, state)] = n
                for rank, n in series.writes.items():
                    writes[(job, rank)] = n
                if series.errors:
                    errors[job] = series.errors
                if series.bytes is not None:
                    nbytes[job] = series.bytes
                if series.duration_counts is not None:
                    histograms[job] = self._histogram(series)
                for (kind, scope, source), n in series.collisions.items():
                    collisions[(job, kind, scope, source)] = n
                for (kind, scope), when in series.last_collision.items():
                    last_collision[(job, kind, scope)] = when
                if series.fluctuations:
                    fluctuations[job] = series.fluctuations
                if series.torn_reads:
                    torn_reads[job] = series.torn_reads
            return MetricsSnapshot(
                writes=MappingProxyType(writes),
                write_errors=MappingProxyType(errors),
                write_bytes=MappingProxyType(nbytes),
                write_duration=MappingProxyType(histograms),
                active_writes=MappingProxyType(dict(self._active)),
                collisions=MappingProxyType(collisions),
                last_collision=MappingProxyType(last_collision),
                events_received=self._received,
                events_rejected=MappingProxyType(dict(self._rejected)),
                client_events_dropped=self._dropped,
                tracked_paths=self._tracked_paths,
                tracked_paths_evicted=self._evicted_total,
                journal_errors=self._journal_errors,
                journal_records_lost=self._journal_records_lost,
                ingest_refused=MappingProxyType(dict(self._ingest_refused)),
                ingest_evicted=MappingProxyType(dict(self._ingest_evicted)),
                http_dropped=MappingProxyType(dict(self._http_dropped)),
                ingest_connections=self._ingest_connections,
                fluctuations=MappingProxyType(fluctuations),
                torn_reads=MappingProxyType(torn_reads),
                fs=MappingProxyType(dict(self._fs)),
                verifications=MappingProxyType(dict(self._verifications)),
                corrupt=MappingProxyType(dict(self._corrupt)),
                label_values=MappingProxyType({"training_job": len(self._job_values),
                                               "rank": len(self._rank_values)}),
                label_values_overflowed=MappingProxyType(dict(self._overflowed)),
                jobs_expired=self._jobs_expired,
                starts_refused=MappingProxyType(dict(self._starts_refused)),
                loop_lag=self._loop_lag,
                hazards=MappingProxyType(hazards),
                job_scope=MappingProxyType(job_scope),
                remote_writes=self._remote_writes,
                remote_rejected=MappingProxyType(dict(self._remote_rejected)),
                verifications_pending=self._verifications_pending,
            )

    def _histogram(self, series: _JobSeries) -> Histogram:
        cumulative, running = [], 0
        for bound, n in zip(self._bounds, series.duration_counts):
            running += n
            cumulative.append((_format_bound(bound), running))
        running += series.duration_counts[-1]
        cumulative.append(("+Inf", running))
        return Histogram(tuple(cumulative), series.duration_sum, running)


class CkptwatchCollector:
    """Custom collector: fresh metric families from one MetricsState snapshot per scrape."""

    def __init__(self, state: MetricsState, registry: CollectorRegistry | None = None):
        self._state = state
        if registry is not None:
            registry.register(self)

    def collect(self):
        s = self._state.snapshot()

        build = GaugeMetricFamily("ckptwatch_build_info",
                                  "ckptwatch build information; the value is always 1.",
                                  labels=["version"])
        build.add_metric([__version__], 1)
        yield build

        yield _family(CounterMetricFamily, "ckptwatch_writes",
                      "Finished torch.save writes (any outcome); rank is "
                      "empty when unknown.",
                      ["training_job", "rank"], s.writes)

        yield _family(CounterMetricFamily, "ckptwatch_write_errors",
                      "Finished torch.save writes whose save raised.",
                      ["training_job"], s.write_errors)

        yield _family(CounterMetricFamily, "ckptwatch_write_bytes",
                      "Bytes on disk after finished torch.save writes.",
                      ["training_job"], s.write_bytes, unit="bytes")

        duration = HistogramMetricFamily("ckptwatch_write_duration_seconds",
                                         "Duration of finished torch.save writes.",
                                         labels=["training_job"], unit="seconds")
        for job, h in sorted(s.write_duration.items()):
            duration.add_metric([job], list(h.buckets), sum_value=h.sum)
        yield duration

        yield _family(GaugeMetricFamily, "ckptwatch_active_writes",
                      "torch.save writes in flight right now.",
                      ["training_job"], s.active_writes)

        yield _family(CounterMetricFamily, "ckptwatch_collisions",
                      "Write collisions: kind is concurrent (overlapping "
                      "writes, corruption) or redundant (same job run, one "
                      "after another); source is hook when the hook saw "
                      "it (the filesystem may have too), fs when only the "
                      "filesystem watcher did.",
                      ["training_job", "kind", "scope", "source"], s.collisions)

        yield _family(CounterMetricFamily, "ckptwatch_hazards",
                      "Saves that will collide sooner or later, reported before they do: "
                      "kind local_rank_guard (local rank 0 of a node other than the first "
                      "writes a shared path that names neither its rank nor its node) or "
                      "shared_storage_multi_writer (several ranks write one path on shared "
                      "storage).",
                      ["training_job", "kind"], s.hazards)

        yield _family(CounterMetricFamily, "ckptwatch_job_scope_reports",
                      "Job-scope state reports from instrumented processes: active (the "
                      "process reached its job's store; cross-node collisions are seen) or "
                      "disabled (store unreachable or failing; node scope only).",
                      ["training_job", "state"], s.job_scope)

        yield CounterMetricFamily("ckptwatch_remote_writes",
                                  "Writes of other nodes reported by local processes' job "
                                  "scope (each report of a write, before deduplication).",
                                  value=s.remote_writes)
        yield _family(CounterMetricFamily, "ckptwatch_remote_writes_rejected",
                      "Remote write reports the detector did not take: unanchored (the "
                      "reporter has no write of that path here), path_full, held_full.",
                      ["reason"], s.remote_rejected)

        yield _family(GaugeMetricFamily, "ckptwatch_last_collision_timestamp_seconds",
                      "Unix time of the latest collision of a job, by kind and scope.",
                      ["training_job", "kind", "scope"], s.last_collision, unit="seconds")

        yield CounterMetricFamily("ckptwatch_events_received",
                                  "Valid events received from instrumented processes.",
                                  value=s.events_received)

        yield _family(CounterMetricFamily, "ckptwatch_events_rejected",
                      "Inputs rejected by the agent's ingest, by reason.",
                      ["reason"], s.events_rejected)

        yield CounterMetricFamily("ckptwatch_client_events_dropped",
                                  "Events instrumented processes dropped because their send "
                                  "queue was full (as reported by them).",
                                  value=s.client_events_dropped)
        yield GaugeMetricFamily("ckptwatch_tracked_paths",
                                "Paths the detector currently holds writes for.",
                                value=s.tracked_paths)
        yield CounterMetricFamily("ckptwatch_tracked_paths_evicted",
                                  "Paths evicted from the detector because the path cap was "
                                  "reached (their collisions may be missed).",
                                  value=s.tracked_paths_evicted)
        yield CounterMetricFamily("ckptwatch_journal_errors",
                                  "Journal writes, opens and rotations that failed.",
                                  value=s.journal_errors)
        yield CounterMetricFamily("ckptwatch_journal_records_lost",
                                  "Journal records lost to those failures (each one).",
                                  value=s.journal_records_lost)
        yield GaugeMetricFamily("ckptwatch_ingest_connections",
                                "Instrumented processes connected to the ingest socket.",
                                value=s.ingest_connections)
        yield _family(CounterMetricFamily, "ckptwatch_ingest_connections_refused",
                      "New connections to the ingest socket refused because their process "
                      "(pid_limit) or user (uid_limit) already held its share.",
                      ["reason"], s.ingest_refused)
        yield _family(CounterMetricFamily, "ckptwatch_ingest_connections_evicted",
                      "Open ingest connections the agent closed: make_room (the agent was "
                      "full; the oldest idle connection of the biggest holder) or "
                      "stalled_frame (a frame left unfinished too long).",
                      ["reason"], s.ingest_evicted)
        yield _family(CounterMetricFamily, "ckptwatch_detector_starts_refused",
                      "Write starts the detector refused because their process "
                      "(writer_open_limit), path (path_open_limit) or the agent (open_limit) "
                      "already held its cap of writes in flight; their ends still count.",
                      ["reason"], s.starts_refused)
        yield GaugeMetricFamily("ckptwatch_loop_lag_seconds",
                                "How long the oldest event queued for the agent loop has "
                                "waited (/healthz fails above 10 s).",
                                value=s.loop_lag)
        yield _family(CounterMetricFamily, "ckptwatch_http_connections_dropped",
                      "Metrics-port connections closed early: timeout (idle or slow client), "
                      "client_gone (hung up mid-answer), evicted (idle, to free a thread), "
                      "refused (every thread busy answering).",
                      ["reason"], s.http_dropped)

        yield _family(CounterMetricFamily, "ckptwatch_size_fluctuations",
                      "Checkpoints that shrank while two or more processes had "
                      "them open for writing (filesystem watcher), or whose finished "
                      "writes by different processes left different sizes.",
                      ["training_job"], s.fluctuations)

        yield _family(CounterMetricFamily, "ckptwatch_torn_reads",
                      "Checkpoints opened for reading while another process was "
                      "writing them (filesystem watcher).",
                      ["training_job"], s.torn_reads)

        if s.fs:
            yield from _fs_families(s.fs)

        yield _family(CounterMetricFamily, "ckptwatch_checkpoint_verifications",
                      "Finished checkpoints verified, by result (ok, corrupt, "
                      "unverifiable, gone: renamed or deleted first).",
                      ["result"], s.verifications)

        yield GaugeMetricFamily("ckptwatch_verifications_pending",
                                "Checkpoints and checkpoint sets waiting to be verified: "
                                "quiet and due, queued, or being read now.",
                                value=s.verifications_pending)
        yield _family(CounterMetricFamily, "ckptwatch_corrupt_checkpoints",
                      "Finished checkpoints that failed verification, by "
                      "reason (empty, truncated, torn, crc_mismatch, "
                      "inconsistent, out_of_bounds; checkpoint sets: missing_shard, mixed).",
                      ["reason"], s.corrupt)

        yield _family(GaugeMetricFamily, "ckptwatch_label_values",
                      "Distinct values held for a label whose values come from input "
                      "(training_job; rank counts (training_job, rank) pairs).",
                      ["label"], s.label_values)
        yield _family(CounterMetricFamily, "ckptwatch_label_values_overflowed",
                      "Updates exported under the label value __overflow__ because the "
                      "label's cap (--metrics.max-jobs, --metrics.max-ranks) was reached.",
                      ["label"], s.label_values_overflowed)
        yield CounterMetricFamily("ckptwatch_training_jobs_expired",
                                  "Training jobs whose series were dropped after "
                                  "--metrics.job-idle-expiry without an update.",
                                  value=s.jobs_expired)


def _family(kind, name: str, doc: str, labels: list[str], values: Mapping, unit: str = ""):
    """A labelled family from {label value or tuple of values: number}, sorted for stable
    output. Single-label keys are plain strings."""
    family = kind(name, doc, labels=labels, unit=unit)
    for key, n in sorted(values.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], n)
    return family


def collision_source(c: Collision) -> str:
    """The `source` label of a collision: "hook" if the hook saw it (exact identities and
    call sites; the watcher may have seen it too, see the journal's "sources"), else "fs".
    One sample per collision, so sum without(source) counts collisions once."""
    return SOURCE_HOOK if SOURCE_HOOK in c.sources else SOURCE_FS


def _fs_families(fs: Mapping):
    fan = fs.get("fanotify") or {}
    yield CounterMetricFamily("ckptwatch_fs_events_lost",
                              "inotify and fanotify queue overflows (events lost; a rescan "
                              "follows).",
                              value=fs.get("events_lost", 0) + fan.get("overflows", 0))
    yield GaugeMetricFamily("ckptwatch_fs_inotify_unavailable",
                            "1 if inotify could not be imported on Linux (a broken install: "
                            "every watched root is polled)",
                            value=fs.get("inotify_unavailable", 0))
    yield CounterMetricFamily("ckptwatch_fs_watch_fallbacks",
                              "Watched roots that fell back from inotify to polling.",
                              value=fs.get("fallbacks", 0))
    up = GaugeMetricFamily("ckptwatch_fs_watch_up",
                           "1 if a configured directory is being watched, by mode "
                           "(inotify or polling).", labels=["root_dir", "mode"])
    for root, info in sorted(fs.get("roots", {}).items()):
        up.add_metric([root, str(info.get("mode") or "")],
                      1 if info.get("state") == "watching" else 0)
    yield up
    method = GaugeMetricFamily("ckptwatch_attribution_method",
                               "1 for how writers of watched files are named: fanotify (the "
                               "kernel names every writer) or proc (a /proc scan after each "
                               "event; misses writes shorter than the scan).",
                               labels=["method"])
    method.add_metric([str(fs.get("attribution_method") or "proc")], 1)
    yield method
    events = CounterMetricFamily("ckptwatch_fanotify_events",
                                 "fanotify events read, by whether they concern a watched "
                                 "checkpoint (a mount mark also reports the mount's other "
                                 "files).", labels=["relevant"])
    events.add_metric(["true"], fan.get("relevant", 0))
    events.add_metric(["false"], fan.get("unrelated", 0) + fan.get("unnamed", 0))
    yield events
    yield CounterMetricFamily("ckptwatch_attributions",
                              "Process scans made to attribute a file write.",
                              value=fs.get("attributions", 0))
    yield CounterMetricFamily("ckptwatch_attribution_seconds",
                              "Time spent attributing file writes to processes.",
                              value=fs.get("attribution_seconds", 0.0), unit="seconds")
    yield CounterMetricFamily("ckptwatch_attribution_errors",
                              "Process scans that failed.",
                              value=fs.get("attribution_errors", 0))


def build_registry(state: MetricsState) -> CollectorRegistry:
    """A fresh registry holding the ckptwatch collector and the process collector.

    process_* (RSS, CPU, open fds) is kept: the agent claims bounded memory and one fd per
    connected process, and SREs need to see that. The platform and GC collectors are left out:
    python_info and gc_* say nothing about the agent's job and only add series.
    """
    registry = CollectorRegistry(auto_describe=True)
    CkptwatchCollector(state, registry=registry)
    ProcessCollector(registry=registry)
    return registry


# --- HTTP server -------------------------------------------------------------------------

def parse_listen_address(text: str) -> tuple[str, int]:
    """Parse ":19400", "127.0.0.1:19400", "[::1]:19400", "host:0" into (host, port).

    host is "" for "all interfaces". Raises ValueError with a message naming the problem.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("listen address is empty; expected host:port, e.g. :19400")
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"listen address {text!r}: missing ']' after IPv6 address")
        host, rest = text[1:close], text[close + 1:]
        if not rest.startswith(":"):
            raise ValueError(f"listen address {text!r}: expected ':port' after ']'")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"listen address {text!r}: {host!r} is not an IPv6 address") \
                from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"listen address {text!r}: missing port; expected host:port, "
                             "e.g. :19400")
        if ":" in host:
            raise ValueError(f"listen address {text!r}: put IPv6 addresses in brackets, "
                             "e.g. [::1]:19400")
    if not port_text.isdigit():
        raise ValueError(f"listen address {text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"listen address {text!r}: port {port} is out of range 0-65535")
    return host, port


# tls_handshake: a connection that failed the TLS handshake (plain HTTP to a TLS port, a
# client certificate the CA did not sign, an old protocol version).
HTTP_DROP_REASONS = ("timeout", "client_gone", "evicted", "refused", "tls_handshake")


class _Server(http.server.ThreadingHTTPServer):
    """One thread per connection, at most max_handlers of them (set by MetricsServer).

    A thread costs ~8 MB of address space and a connection costs a client nothing, so idle
    connections must not be able to take every thread: when all are busy, the oldest
    connection that has not yet sent its request line is shut down to make room (its thread
    then ends at once); only if every thread is answering a request is the newcomer closed.
    The handler's socket timeout bounds how long any connection can hold a thread.
    """

    daemon_threads = True
    allow_reuse_address = True
    dual_stack = False
    max_handlers = 16
    on_dropped: Callable[[str], None] = staticmethod(lambda reason: None)
    ssl_context: ssl.SSLContext | None = None

    def get_request(self):
        request, address = super().get_request()
        if self.ssl_context is not None:
            # No handshake here: this is the accept loop, and one slow or silent client must
            # not stall it. The handler thread shakes hands under its socket timeout.
            request = self.ssl_context.wrap_socket(request, server_side=True,
                                                   do_handshake_on_connect=False)
        return request, address

    def __init__(self, *args, **kwargs):
        self._slots_lock = threading.Lock()
        self._handlers = 0
        self._waiting: dict = {}      # sockets without a request line yet, oldest first
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        evicted, refused = None, False
        with self._slots_lock:
            if self._handlers >= self.max_handlers:
                evicted = next(iter(self._waiting), None)
                if evicted is None:
                    refused = True
                else:
                    del self._waiting[evicted]
            if not refused:
                self._handlers += 1
                self._waiting[request] = None
        if evicted is not None:
            self.dropped("evicted")
            try:
                evicted.shutdown(socket.SHUT_RDWR)     # its blocked read returns, its thread ends
            except OSError:
                pass
        if refused:
            self.dropped("refused")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._slots_lock:
            self._handlers -= 1
            self._waiting.pop(request, None)

    def request_started(self, request) -> None:
        """The handler read a request line: this connection is no longer an idle one."""
        with self._slots_lock:
            self._waiting.pop(request, None)

    def dropped(self, reason: str) -> None:
        try:
            self.on_dropped(reason)
        except Exception:
            log.exception("counting a dropped metrics connection failed")

    def handle_error(self, request, client_address):
        # socketserver would print a traceback to stderr, outside the log format.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            self.dropped("timeout" if isinstance(exc, TimeoutError) else "client_gone")
            log.debug("metrics client %s: %s", client_address[0], exc)
        else:
            log.error("metrics request from %s failed", client_address[0], exc_info=True)

    def server_bind(self):
        if self.dual_stack:
            # ":port" means every interface, IPv6 and IPv4 (as node_exporter does).
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _bind_candidates(host: str, port: int) -> list[tuple[type, tuple[str, int]]]:
    """Server classes and bind addresses to try in order for a parsed listen address.

    "" means every interface: dual-stack IPv6 first (as node_exporter does), then IPv4 for
    kernels or containers where IPv6 is disabled.
    """
    if host == "":
        dual = type("_DualStackServer", (_Server,),
                    {"address_family": socket.AF_INET6, "dual_stack": True})
        return [(dual, ("::", port)), (_Server, ("0.0.0.0", port))]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve listen host {host!r}: {exc}") from None
    out = []
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET6:
            out.append((type("_Server6", (_Server,), {"address_family": family}),
                        (sockaddr[0], port)))
        elif family == socket.AF_INET:
            out.append((_Server, (sockaddr[0], port)))
    return out


def accepts_gzip(header: str | None) -> bool:
    """True if an Accept-Encoding header accepts gzip (not "gzip;q=0"; "*" counts)."""
    for item in (header or "").split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "*"):
            continue
        quality = params.strip().lower()
        if quality.startswith("q="):
            try:
                return float(quality[2:]) > 0
            except ValueError:
                return False
        return True
    return False


class _Handler(http.server.BaseHTTPRequestHandler):
    # Set per server in MetricsServer.start(). timeout: the socket timeout of every read and
    # write (StreamRequestHandler applies it), so an idle or slow client cannot hold a thread.
    registry: CollectorRegistry
    health: Callable[[], tuple[bool, str]]
    auth: BasicAuth = BasicAuth({})
    telemetry_path = "/metrics"
    timeout = 10.0

    def handle(self):
        if isinstance(self.request, ssl.SSLSocket):
            try:
                self.request.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                self.server.dropped("tls_handshake")
                log.debug("metrics client %s: TLS handshake failed: %s",
                          self.client_address[0], exc)
                self.close_connection = True
                return
        try:
            super().handle()
        except ConnectionError as exc:      # BrokenPipe, reset: the client hung up mid-answer
            self.server.dropped("client_gone")
            log.debug("metrics client %s went away: %s", self.client_address[0], exc)

    def parse_request(self):
        self.server.request_started(self.request)
        return super().parse_request()

    def log_error(self, format, *args):  # noqa: A002 (signature from http.server)
        # http.server reports a read or write that hit the socket timeout only through here.
        if format.startswith("Request timed out"):
            self.server.dropped("timeout")
        self.log_message(format, *args)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        route = urlsplit(self.path).path
        authorized = self.auth.check(self.headers.get("Authorization"))
        if route == "/healthz":
            # Open to probes (a kubelet cannot send basic auth), but without the reason
            # unless authorized: it may name paths.
            self._healthz(detail=authorized)
        elif not authorized:
            self._reply(401, b"Unauthorized\n", "text/plain; charset=utf-8",
                        {"WWW-Authenticate": 'Basic realm="ckptwatch", charset="UTF-8"'})
        elif route == self.telemetry_path:
            self._metrics()
        elif route == "/":
            self._index()
        else:
            self._reply(404, b"not found\n", "text/plain; charset=utf-8")

    def _index(self):
        # A landing page as node_exporter has: what this is and where the metrics are.
        path = html.escape(self.telemetry_path, quote=True)
        body = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
                f"<title>ckptwatch agent</title></head>\n<body>\n"
                f"<h1>ckptwatch agent</h1>\n"
                f"<p>Runtime write-collision monitor for torch.save checkpoints, version "
                f"{html.escape(__version__)}.</p>\n<ul>\n"
                f"<li><a href=\"{path}\">Metrics</a> ({path})</li>\n"
                f"<li><a href=\"/healthz\">Health</a> (/healthz)</li>\n"
                f"</ul>\n</body></html>\n").encode()
        self._reply(200, body, "text/html; charset=utf-8")

    def _metrics(self):
        encoder, content_type = choose_encoder(self.headers.get("Accept"))
        try:
            body = encoder(self.registry)
        except Exception as exc:  # a broken collector must not kill the server thread
            log.exception("metrics collection failed")
            self._reply(500, f"collection failed: {exc}\n".encode(), "text/plain")
            return
        # Prometheus always asks for gzip; the text format shrinks ~10x. prometheus_client's
        # own handlers do this too, but this server is http.server's, so we do it here.
        if accepts_gzip(self.headers.get("Accept-Encoding")):
            self._reply(200, gzip.compress(body, compresslevel=6), content_type,
                        {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        else:
            self._reply(200, body, content_type, {"Vary": "Accept-Encoding"})

    def _healthz(self, detail: bool = True):
        try:
            ok, reason = self.health()
        except Exception as exc:
            ok, reason = False, f"health check raised {type(exc).__name__}: {exc}"
        if ok:
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")
        elif not detail:
            self._reply(503, b"unhealthy\n", "text/plain; charset=utf-8")
        else:
            self._reply(503, (reason or "unhealthy").encode() + b"\n",
                        "text/plain; charset=utf-8")

    def _reply(self, code: int, body: bytes, content_type: str,
               headers: Mapping[str, str] = MappingProxyType({})):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for name, text in headers.items():
            self.send_header(name, text)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (signature from http.server)
        # Scrapes every 15 s would flood the agent log; keep them at debug level.
        log.debug("%s %s", self.address_string(), format % args)


class MetricsServer:
    """Serves the metrics (telemetry_path, default /metrics), /healthz and an index page at /
    from a daemon thread; over TLS and behind basic auth when web_config says so
    (exporters.webconfig; /healthz stays open to probes).

    address: ":19400", "127.0.0.1:19400", "[::1]:19400", "host:0" (0 = an ephemeral port;
    read .port after start()). A malformed address raises ValueError here, before start(), so
    the agent reports it with the other configuration errors. health() returns (ok, reason).
    """

    def __init__(self, address: str, registry: CollectorRegistry,
                 health: Callable[[], tuple[bool, str]] = lambda: (True, ""),
                 timeout: float = 10.0, max_handlers: int = 16,
                 on_dropped: Callable[[str], None] | None = None,
                 web_config: WebConfig | None = None, telemetry_path: str = "/metrics"):
        if timeout <= 0 or max_handlers < 1:
            raise ValueError(f"need timeout > 0 and max_handlers >= 1, got {timeout}, "
                             f"{max_handlers}")
        if not telemetry_path.startswith("/") or telemetry_path in ("/", "/healthz"):
            raise ValueError(f"telemetry path {telemetry_path!r}: must start with / and be "
                             "neither / nor /healthz")
        self.web_config = web_config or WebConfig()
        self.telemetry_path = telemetry_path
        self.timeout, self.max_handlers, self._on_dropped = timeout, max_handlers, on_dropped
        self.host, self._requested_port = parse_listen_address(address)
        self.address = address
        self._registry = registry
        self._health = health
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.port: int | None = None

    def start(self) -> None:
        """Bind and serve; a second call is a no-op. Raises OSError if the bind fails."""
        with self._lock:
            if self._server is not None:
                return
            handler = type("Handler", (_Handler,),
                           {"registry": self._registry, "health": staticmethod(self._health),
                            "timeout": self.timeout,
                            "auth": BasicAuth(self.web_config.users),
                            "telemetry_path": self.telemetry_path})
            tls = self.web_config.tls.context() if self.web_config.tls else None
            server, error = None, None
            for server_cls, bind in _bind_candidates(self.host, self._requested_port):
                try:
                    server = server_cls(bind, handler)
                    break
                except OSError as exc:
                    error = error or exc
                    if exc.errno == errno.EADDRINUSE:
                        break  # the port is taken: another family would only hide that
            if server is None:
                raise error or OSError(f"cannot listen on {self.address!r}")
            server.max_handlers = self.max_handlers
            server.ssl_context = tls
            if self._on_dropped is not None:
                server.on_dropped = self._on_dropped
            self.port = server.server_address[1]
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name=f"ckptwatch-metrics:{self.port}", daemon=True)
            thread.start()
            self._server, self._thread = server, thread
            log.info("serving metrics on %s (port %d, path %s, tls=%s, basic_auth=%s)",
                     self.address, self.port, self.telemetry_path, tls is not None,
                     bool(self.web_config.users))

    def stop(self) -> None:
        """Stop serving and join the thread; a second call is a no-op."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        thread.join()


class MetricsExporter:
    """The metrics as an exporter (exporters.fanout.Exporter): each value updates
    MetricsState; scrapes read it (CkptwatchCollector)."""

    def __init__(self, state: MetricsState):
        self.state = state

    def publish_write(self, write: Write) -> None:
        self.state.write_finished(write)

    def publish_collision(self, collision: Collision) -> None:
        self.state.collision(collision)

    def publish_finding(self, finding: Finding) -> None:
        if finding.kind == FINDING_VERIFICATION:
            self.state.verification(finding.get("result"), finding.get("cause") or "")
        elif finding.kind == FINDING_HAZARD:
            self.state.hazard(finding.job, finding.get("hazard"))
        else:
            self.state.finding(finding.kind, finding.job)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
