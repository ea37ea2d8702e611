"""StateCollector: the families of MetricsState (counted events and per-job series), and the
registry the agent serves.

prometheus_client's custom-collector pattern: every scrape takes one immutable snapshot of
the state and builds fresh families from it, so nothing stale survives and one scrape is
internally consistent across these families.
"""
from __future__ import annotations

from typing import Mapping

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ckptwatch.version import __version__
from exporters.metrics.state import MetricsState


def family(kind, name: str, doc: str, labels: list[str], values: Mapping, unit: str = ""):
    """A labelled family from {label value or tuple of values: number}, sorted for stable
    output. Single-label keys are plain strings."""
    metric = kind(name, doc, labels=labels, unit=unit)
    for key, n in sorted(values.items()):
        metric.add_metric(list(key) if isinstance(key, tuple) else [key], n)
    return metric


class StateCollector:
    """Fresh metric families from one MetricsState snapshot per scrape, and the build info."""

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

        yield family(CounterMetricFamily, "ckptwatch_writes",
                     "Finished torch.save writes (any outcome); rank is "
                     "empty when unknown.",
                     ["training_job", "rank"], s.writes)

        yield family(CounterMetricFamily, "ckptwatch_write_errors",
                     "Finished torch.save writes whose save raised.",
                     ["training_job"], s.write_errors)

        yield family(CounterMetricFamily, "ckptwatch_write_bytes",
                     "Bytes on disk after finished torch.save writes.",
                     ["training_job"], s.write_bytes, unit="bytes")

        duration = HistogramMetricFamily("ckptwatch_write_duration_seconds",
                                         "Duration of finished torch.save writes.",
                                         labels=["training_job"], unit="seconds")
        for job, h in sorted(s.write_duration.items()):
            duration.add_metric([job], list(h.buckets), sum_value=h.sum)
        yield duration

        yield family(GaugeMetricFamily, "ckptwatch_active_writes",
                     "torch.save writes in flight right now.",
                     ["training_job"], s.active_writes)

        yield family(CounterMetricFamily, "ckptwatch_collisions",
                     "Write collisions: kind is concurrent (overlapping "
                     "writes, corruption) or redundant (same job run, one "
                     "after another); source is hook when the hook saw "
                     "it (the filesystem may have too), fs when only the "
                     "filesystem watcher did.",
                     ["training_job", "kind", "scope", "source"], s.collisions)

        yield family(CounterMetricFamily, "ckptwatch_hazards",
                     "Saves that will collide sooner or later, reported before they do: "
                     "kind local_rank_guard (local rank 0 of a node other than the first "
                     "writes a shared path that names neither its rank nor its node) or "
                     "shared_storage_multi_writer (several ranks write one path on shared "
                     "storage).",
                     ["training_job", "kind"], s.hazards)

        yield family(CounterMetricFamily, "ckptwatch_job_scope_reports",
                     "Job-scope state reports from instrumented processes: active (the "
                     "process reached its job's store; cross-node collisions are seen) or "
                     "disabled (store unreachable or failing; node scope only).",
                     ["training_job", "state"], s.job_scope)

        yield family(GaugeMetricFamily, "ckptwatch_last_collision_timestamp_seconds",
                     "Unix time of the latest collision of a job, by kind and scope.",
                     ["training_job", "kind", "scope"], s.last_collision, unit="seconds")

        yield family(GaugeMetricFamily, "ckptwatch_last_collision_verification",
                     "What the agent found in the file the latest collision of a job (by kind "
                     "and scope) left; the value is always 1. result: pending (not verified "
                     "yet), ok, corrupt, unverifiable, gone (renamed or deleted before it was "
                     "read) or off (verification disabled).",
                     ["training_job", "kind", "scope", "result"], s.last_collision_verdict)

        yield family(GaugeMetricFamily, "ckptwatch_last_corrupt_checkpoint_timestamp_seconds",
                     "Unix time the agent last found a finished checkpoint of a job corrupt, "
                     "by reason (as ckptwatch_corrupt_checkpoints_total).",
                     ["training_job", "reason"], s.last_corrupt, unit="seconds")

        yield family(GaugeMetricFamily, "ckptwatch_last_hazard_timestamp_seconds",
                     "Unix time of the latest hazard reported for a job, by kind (as "
                     "ckptwatch_hazards_total); restored from the journal at start.",
                     ["training_job", "kind"], s.last_hazard, unit="seconds")

        yield family(GaugeMetricFamily, "ckptwatch_last_size_fluctuation_timestamp_seconds",
                     "Unix time of the latest size fluctuation of a job's checkpoint (as "
                     "ckptwatch_size_fluctuations_total); restored from the journal at start.",
                     ["training_job"], s.last_fluctuation, unit="seconds")

        yield CounterMetricFamily("ckptwatch_events_received",
                                  "Valid events received from instrumented processes.",
                                  value=s.events_received)

        yield family(CounterMetricFamily, "ckptwatch_events_rejected",
                     "Inputs rejected by the agent's ingest, by reason.",
                     ["reason"], s.events_rejected)

        yield CounterMetricFamily("ckptwatch_client_events_dropped",
                                  "Events instrumented processes dropped because their send "
                                  "queue was full (as reported by them).",
                                  value=s.client_events_dropped)

        yield family(CounterMetricFamily, "ckptwatch_size_fluctuations",
                     "Checkpoints that shrank while two or more processes had "
                     "them open for writing (filesystem watcher), or whose finished "
                     "writes by different processes left different sizes.",
                     ["training_job"], s.fluctuations)

        yield family(CounterMetricFamily, "ckptwatch_torn_reads",
                     "Checkpoints opened for reading while another process was "
                     "writing them (filesystem watcher).",
                     ["training_job"], s.torn_reads)

        yield family(CounterMetricFamily, "ckptwatch_checkpoint_verifications",
                     "Finished checkpoints verified, by result (ok, corrupt, "
                     "unverifiable, gone: renamed or deleted first).",
                     ["result"], s.verifications)

        yield family(CounterMetricFamily, "ckptwatch_corrupt_checkpoints",
                     "Finished checkpoints that failed verification, by "
                     "reason (empty, truncated, torn, crc_mismatch, "
                     "inconsistent, out_of_bounds; checkpoint sets: missing_shard, mixed).",
                     ["reason"], s.corrupt)

        yield family(GaugeMetricFamily, "ckptwatch_label_values",
                     "Distinct values held for a label whose values come from input "
                     "(training_job; rank counts (training_job, rank) pairs).",
                     ["label"], s.label_values)
        yield family(CounterMetricFamily, "ckptwatch_label_values_overflowed",
                     "Updates exported under the label value __overflow__ because the "
                     "label's cap (--metrics.max-jobs, --metrics.max-ranks) was reached.",
                     ["label"], s.label_values_overflowed)
        yield CounterMetricFamily("ckptwatch_training_jobs_expired",
                                  "Training jobs whose series were dropped after "
                                  "--metrics.job-idle-expiry without an update.",
                                  value=s.jobs_expired)


def build_registry(state: MetricsState, *collectors) -> CollectorRegistry:
    """A fresh registry holding the state's collector, the given component collectors
    (exporters.metrics.components) and the process collector.

    process_* (RSS, CPU, open fds) is kept: the agent claims bounded memory and one fd per
    connected process, and SREs need to see that. The platform and GC collectors are left out:
    python_info and gc_* say nothing about the agent's job and only add series.
    """
    registry = CollectorRegistry(auto_describe=True)
    StateCollector(state, registry=registry)
    for collector in collectors:
        registry.register(collector)
    ProcessCollector(registry=registry)
    return registry
