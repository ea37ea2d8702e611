"""One collector per agent component: each reads its component when scraped and builds fresh
families from what it reads (prometheus_client's process_collector.py reads /proc the same
way), so no value is copied into a snapshot every tick and each metric is written in one place.

Components are duck-typed (exporters import no agent module); each collector names the
attributes it reads. The agent builds one per component (monitor.agent.daemon.Agent.build).

Threads: a scrape runs on an HTTP handler thread while the loop thread (and the ingest thread,
for IngestServer) changes these components, which take no locks for it. So a collector reads
only what another thread may read without one under CPython's GIL: an int attribute, the len()
of a container, a dict copied with dict(...) (one C call that no other Python thread can run
in the middle of, for str keys), or a snapshot method the component provides for this
(FsSource.stats() copies under its watchers' locks; Checks.pending() and
Detector.refused_starts copy before they count). It never iterates a component's live
container in Python code, where the loop could change it between two items. Should a read
fail all the same, that component is left out of that one scrape (below).

A component that cannot be read is skipped, with one warning until it can be read again; it
never fails the whole scrape, so one broken part never hides the metrics of the others.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporters.metrics.collector import family

log = logging.getLogger(__name__)


class ComponentCollector:
    """The families of one component, read when scraped; subclasses define read()."""

    what = "component"          # named in the warning when it cannot be read

    def __init__(self, component, registry: CollectorRegistry | None = None):
        self.component = component
        self._failing = False
        if registry is not None:
            registry.register(self)

    def collect(self) -> list[Metric]:
        try:
            # Every family is built before any is returned: a read that fails half-way
            # leaves none of this component's families, never some of them.
            families = list(self.read(self.component))
        except Exception:
            if not self._failing:
                log.warning("cannot read the %s for metrics; its metrics are left out until "
                            "it can be read", self.what, exc_info=True)
            self._failing = True
            return []
        if self._failing:
            log.info("the %s can be read for metrics again", self.what)
            self._failing = False
        return families

    def read(self, component) -> Iterable[Metric]:
        raise NotImplementedError


class IngestCollector(ComponentCollector):
    """monitor.ingest.server.IngestServer: `connections`, `refused`, `evicted` (by reason,
    every reason present from the start)."""

    what = "ingest server"

    def read(self, ingest):
        connections, refused, evicted = ingest.connections, dict(ingest.refused), \
            dict(ingest.evicted)
        yield GaugeMetricFamily("ckptwatch_ingest_connections",
                                "Instrumented processes connected to the ingest socket.",
                                value=connections)
        yield family(CounterMetricFamily, "ckptwatch_ingest_connections_refused",
                     "New connections to the ingest socket refused because their process "
                     "(pid_limit) or user (uid_limit) already held its share.",
                     ["reason"], refused)
        yield family(CounterMetricFamily, "ckptwatch_ingest_connections_evicted",
                     "Open ingest connections the agent closed: make_room (the agent was "
                     "full; the oldest idle connection of the biggest holder) or "
                     "stalled_frame (a frame left unfinished too long).",
                     ["reason"], evicted)


class DetectorCollector(ComponentCollector):
    """monitor.detect.detector.Detector: `tracked_paths`, `evicted_paths_total`,
    `refused_starts` (a copy), `remote_rejected` (by reason)."""

    what = "detector"

    def read(self, detector):
        tracked, evicted = detector.tracked_paths, detector.evicted_paths_total
        refused, remote_rejected = detector.refused_starts, dict(detector.remote_rejected)
        yield GaugeMetricFamily("ckptwatch_tracked_paths",
                                "Paths the detector currently holds writes for.",
                                value=tracked)
        yield CounterMetricFamily("ckptwatch_tracked_paths_evicted",
                                  "Paths evicted from the detector because the path cap was "
                                  "reached (their collisions may be missed).",
                                  value=evicted)
        yield family(CounterMetricFamily, "ckptwatch_detector_starts_refused",
                     "Write starts the detector refused because their process "
                     "(writer_open_limit), path (path_open_limit) or the agent (open_limit) "
                     "already held its cap of writes in flight; their ends still count.",
                     ["reason"], refused)
        yield family(CounterMetricFamily, "ckptwatch_remote_writes_rejected",
                     "Remote write reports the detector did not take: unanchored (the "
                     "reporter has no write of that path here), path_full, held_full, "
                     "local_writer (the report names a process of this node).",
                     ["reason"], remote_rejected)


class JobScopeCollector(ComponentCollector):
    """monitor.agent.jobreports.JobScopeEvents: `remote_received`."""

    what = "job-scope reports"

    def read(self, job_scope):
        yield CounterMetricFamily("ckptwatch_remote_writes",
                                  "Writes of other nodes reported by local processes' job "
                                  "scope (each report of a write, before deduplication).",
                                  value=job_scope.remote_received)


class ChecksCollector(ComponentCollector):
    """monitor.verify.checks.Checks: `pending()`."""

    what = "verification checks"

    def read(self, checks):
        yield GaugeMetricFamily("ckptwatch_verifications_pending",
                                "Checkpoints and checkpoint sets waiting to be verified: "
                                "quiet and due, queued, or being read now.",
                                value=checks.pending())


class JournalCollector(ComponentCollector):
    """exporters.journal.Journal: `errors`, `records_lost`."""

    what = "journal"

    def read(self, journal):
        errors, lost = journal.errors, journal.records_lost
        yield CounterMetricFamily("ckptwatch_journal_errors",
                                  "Journal writes, opens and rotations that failed.",
                                  value=errors)
        yield CounterMetricFamily("ckptwatch_journal_records_lost",
                                  "Journal records lost to those failures (each one).",
                                  value=lost)


class LoopCollector(ComponentCollector):
    """The loop's queue, monitor.ingest.inbox.Inbox: `oldest_wait()`."""

    what = "loop's queue"

    def read(self, inbox):
        yield GaugeMetricFamily("ckptwatch_loop_lag_seconds",
                                "How long the oldest event queued for the agent loop has "
                                "waited (/healthz fails above 10 s).",
                                value=inbox.oldest_wait())


class HttpCollector(ComponentCollector):
    """exporters.metrics.server.MetricsServer: `drops()`."""

    what = "metrics server"

    def read(self, server):
        yield family(CounterMetricFamily, "ckptwatch_http_connections_dropped",
                     "Metrics-port connections closed early: timeout (idle or slow client), "
                     "client_gone (hung up mid-answer), evicted (idle, to free a thread), "
                     "refused (every thread busy answering).",
                     ["reason"], server.drops())


class FsCollector(ComponentCollector):
    """monitor.fs.source.FsSource: `stats()`."""

    what = "filesystem source"

    def read(self, fs):
        return list(_fs_families(fs.stats()))


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
    yield CounterMetricFamily("ckptwatch_attribution_denied",
                              "Processes whose open files or environment the kernel would not "
                              "let the agent read (another user's, without CAP_SYS_PTRACE): "
                              "their writes of watched files are not attributed.",
                              value=fs.get("attribution_denied", 0))
