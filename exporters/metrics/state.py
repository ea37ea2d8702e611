"""The metric state of events: what the agent was told happened, counted once, as it is
published (MetricsExporter, the loop's hook_batch, the ingest thread's rejections).

Per-job series live here because their label values are bounded and expire (exporters.labels):
which job holds a place is decided when a value is counted, not when it is scraped. What a
component can say about itself at any time (connections, tracked paths, the journal's losses)
is not copied here: its collector reads it when scraped (exporters.metrics.components).
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from ckptwatch.events import REJECT_REASONS
from exporters.labels import OVERFLOW, LabelLimits, LabelValues, clean
from monitor.detect.model import SOURCE_FS, SOURCE_HOOK, SOURCE_JOB, Collision, Write

# Labels whose values come from input, capped by LabelLimits.
INPUT_LABELS = ("training_job", "rank")

# Checkpoint saves range from a tiny state dict on tmpfs (~1 ms) to a multi-GB model on network
# storage (minutes); the buckets cover 1 ms .. 10 min with roughly 2-3x steps.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# The verdict on the file a job's latest collision left, besides the verifier's own results
# (ok, corrupt, unverifiable, gone): not verified yet, or never (verification is off).
VERDICT_PENDING = "pending"
VERDICT_OFF = "off"
# Verdicts remembered by path, for a collision published after its file was verified (a
# job-scope collision settles after the verifier's quiet period): paths stay in memory, never
# in a label.
MAX_RECENT_VERDICTS = 1024


@dataclass(frozen=True)
class Histogram:
    """One label set's histogram: cumulative bucket counts (incl. +Inf), sum and count."""

    buckets: tuple[tuple[str, int], ...]
    sum: float
    count: int


@dataclass(frozen=True)
class MetricsSnapshot:
    """An immutable copy of MetricsState taken under its lock; what StateCollector reads."""

    # "job" below is the training_job label value (exporters.labels bounds them).
    writes: Mapping[tuple[str, str], int]              # (job, rank) -> finished writes
    write_errors: Mapping[str, int]                    # job -> writes whose outcome was not ok
    write_bytes: Mapping[str, int]                     # job -> bytes
    write_duration: Mapping[str, Histogram]            # job -> histogram
    active_writes: Mapping[str, int]                   # job -> writes in flight
    collisions: Mapping[tuple[str, str, str, str], int]  # (job, kind, scope, source) -> n
    last_collision: Mapping[tuple[str, str, str], float]  # (job, kind, scope) -> wall time
    # (job, kind, scope, verdict) -> 1: the verdict on the file the latest collision left
    last_collision_verdict: Mapping[tuple[str, str, str, str], int]
    last_corrupt: Mapping[tuple[str, str], float]     # (job, cause) -> wall time
    last_hazard: Mapping[tuple[str, str], float]      # (job, kind) -> wall time
    last_fluctuation: Mapping[str, float]             # job -> wall time
    events_received: int
    events_rejected: Mapping[str, int]                 # reason -> rejected inputs
    client_events_dropped: int
    fluctuations: Mapping[str, int]                    # job -> size fluctuations
    torn_reads: Mapping[str, int]                      # job -> torn reads
    verifications: Mapping[str, int]                   # result -> files verified
    corrupt: Mapping[str, int]                         # cause -> corrupt files
    label_values: Mapping[str, int]                    # label -> values held
    label_values_overflowed: Mapping[str, int]         # label -> n
    jobs_expired: int                                  # jobs idle past expiry
    hazards: Mapping[tuple[str, str], int]             # (job, kind) -> n
    job_scope: Mapping[tuple[str, str], int]           # (job, state) -> n


def _format_bound(bound: float) -> str:
    # Prometheus reads `le` as a float; repr keeps "0.001" and "600.0" exact and stable.
    return repr(float(bound))


class _CollisionFile:
    """The file a job's latest collision (of a kind and scope) left, and the verdict on it."""

    __slots__ = ("id", "path", "ended", "verdict")

    def __init__(self, collision_id: str, path: str, ended: float, verdict: str):
        self.id, self.path, self.ended, self.verdict = collision_id, path, ended, verdict


class _JobSeries:
    """Every per-job series of one training_job label value, so expiring a job is one delete."""

    __slots__ = ("writes", "errors", "bytes", "duration_counts", "duration_sum", "collisions",
                 "last_collision", "collision_file", "last_corrupt", "fluctuations",
                 "last_fluctuation", "torn_reads", "hazards", "last_hazard", "job_scope")

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
        # (kind, scope) -> the file its latest collision left: the alerts' text says whether
        # the agent found it whole, corrupt or has not verified it yet.
        self.collision_file: dict[tuple[str, str], _CollisionFile] = {}
        self.last_corrupt: dict[str, float] = {}         # cause -> wall time of the latest
        self.fluctuations = 0
        self.last_fluctuation: float | None = None       # wall time of the latest
        self.torn_reads = 0
        self.hazards: dict[str, int] = {}                 # hazard kind -> n
        self.last_hazard: dict[str, float] = {}           # hazard kind -> wall time, latest
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

    verify_results and corrupt_causes are the label values of verification findings, exported
    at 0 before the first; they are monitor.verify's vocabulary, handed in by the agent that
    builds this (exporters import no monitor module but monitor.detect.model). verify_enabled
    False: collisions' files are never verified (their verdict is "off", not "pending").
    """

    def __init__(self, duration_buckets: tuple[float, ...] = DURATION_BUCKETS,
                 limits: LabelLimits = LabelLimits(),
                 clock: Callable[[], float] = time.monotonic,
                 verify_results: Iterable[str] = (), corrupt_causes: Iterable[str] = (),
                 verify_enabled: bool = True):
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
        # Bounded label sets, present from the start (see _rejected above).
        self._verifications: dict[str, int] = {r: 0 for r in verify_results}
        self._corrupt: dict[str, int] = {c: 0 for c in corrupt_causes}
        self._first_verdict = VERDICT_PENDING if verify_enabled else VERDICT_OFF
        self._recent_verdicts: OrderedDict[str, tuple[str, float]] = OrderedDict()

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
            ended = max((w.end_wall or w.start_wall) for w in c.writes)
            self._latest_collision(series, c.kind, c.scope, c.detected_wall or ended, c.id,
                                   c.path, ended)

    def resume_collision(self, job: str, kind: str, scope: str, when: float,
                         collision_id: str, path: str, ended: float) -> None:
        """A collision read back from the journal at start: the gauges (latest collision,
        the file it left) as they were, no counter (counters count since this start)."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock(), count=False))
            self._latest_collision(series, kind, scope, when, collision_id, path, ended)

    def _latest_collision(self, series: _JobSeries, kind: str, scope: str, when: float,
                          collision_id: str, path: str, ended: float) -> None:
        latest = series.last_collision.get((kind, scope), 0.0)
        series.last_collision[(kind, scope)] = max(when, latest)
        if when >= latest:
            verdict = self._first_verdict
            recent = self._recent_verdicts.get(path)
            if recent is not None and recent[1] >= ended:
                verdict = recent[0]           # verified after its writes, before now
            series.collision_file[(kind, scope)] = _CollisionFile(
                collision_id, path, ended, verdict)

    def set_active_writes(self, by_job: dict[str, int]) -> None:
        """Replace the in-flight write counts; jobs absent from by_job drop out of the gauge.
        A job with writes in flight is in use, so it does not expire.

        The one value the loop still hands over every tick instead of a collector reading it
        at scrape time: holding a job's label place is a use of that job, and it must happen
        while the write is in flight, scraped or not, or a long save's job could expire (and
        its counters reset) in the middle of it."""
        with self._lock:
            now = self._clock()
            active: dict[str, int] = {}
            for job, n in by_job.items():
                # Not counted as overflow: this runs every loop turn and would count the same
                # jobs again and again; their writes count once they finish.
                value = self._job_label(job, now, count=False)
                active[value] = active.get(value, 0) + int(n)
            self._active = active

    def finding(self, kind: str, job: str, wall: float | None = None) -> None:
        """A filesystem finding: kind "size_fluctuation" or "torn_read", at wall (now if
        None)."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock()))
            if kind == "size_fluctuation":
                series.fluctuations += 1
                self._latest_fluctuation(series, wall)
            else:
                series.torn_reads += 1

    def hazard(self, job: str, kind: str, wall: float | None = None) -> None:
        """A hazard (ckptwatch.events.HAZARD_KINDS: a bounded label set) for a job."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock()))
            series.hazards[kind] = series.hazards.get(kind, 0) + 1
            self._latest_hazard(series, kind, wall)

    def resume_finding(self, kind: str, job: str, wall: float,
                       hazard: str | None = None) -> None:
        """A size fluctuation or hazard (kind "hazard", its kind in `hazard`) read back from
        the journal at start: its latest-time gauge, no counter."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock(), count=False))
            if kind == "hazard":
                self._latest_hazard(series, hazard, wall)
            elif kind == "size_fluctuation":
                self._latest_fluctuation(series, wall)

    @staticmethod
    def _latest_hazard(series: _JobSeries, kind: str, wall: float | None) -> None:
        when = time.time() if wall is None else wall
        series.last_hazard[kind] = max(when, series.last_hazard.get(kind, 0.0))

    @staticmethod
    def _latest_fluctuation(series: _JobSeries, wall: float | None) -> None:
        when = time.time() if wall is None else wall
        series.last_fluctuation = max(when, series.last_fluctuation or 0.0)

    def job_scope(self, job: str, state: str) -> None:
        """A process reported its job-scope state (ckptwatch.events.JOBSCOPE_STATES)."""
        with self._lock:
            series = self._series(self._job_label(job, self._clock()))
            series.job_scope[state] = series.job_scope.get(state, 0) + 1

    def verification(self, result: str, cause: str = "", job: str = "",
                     path: str | None = None, collision_id: str = "",
                     wall: float | None = None) -> None:
        """One finished checkpoint verified: result ok|corrupt|unverifiable|gone|incomplete;
        cause is the bounded corruption category (monitor.verify.integrity.CAUSES) for corrupt
        files. job (its last writer's), path, collision_id (the collision that wrote it, if
        the verifier knew) and wall (when) tie the verdict to a collision: it becomes the
        verdict of a latest collision that wrote that file and has none yet."""
        with self._lock:
            self._verifications[result] = self._verifications.get(result, 0) + 1
            if cause and result == "corrupt":     # an incomplete set's cause is no corruption
                self._corrupt[cause] = self._corrupt.get(cause, 0) + 1
            self._verdict(result, cause, job, path, collision_id,
                          time.time() if wall is None else wall)

    def resume_verification(self, result: str, cause: str, job: str, path: str,
                            collision_id: str, wall: float) -> None:
        """A verdict read back from the journal at start: the gauges it set (latest corrupt
        checkpoint, the verdict on a collision's file), no counter."""
        with self._lock:
            self._verdict(result, cause, job, path, collision_id, wall, count=False)

    def _verdict(self, result: str, cause: str, job: str, path: str | None,
                 collision_id: str, when: float, count: bool = True) -> None:
        if result == "corrupt" and cause:
            series = self._series(self._job_label(job, self._clock(), count=count))
            series.last_corrupt[cause] = max(when, series.last_corrupt.get(cause, 0.0))
        if path is None:
            return
        self._recent_verdicts.pop(path, None)
        self._recent_verdicts[path] = (result, when)
        if len(self._recent_verdicts) > MAX_RECENT_VERDICTS:
            self._recent_verdicts.popitem(last=False)
        # The first verdict after a collision is what it left; a later one is of a later
        # save of the same path (unless the verifier names this collision).
        for series in self._jobs.values():
            for entry in series.collision_file.values():
                if (collision_id and entry.id == collision_id) or (
                        entry.path == path and entry.verdict == VERDICT_PENDING
                        and when >= entry.ended):
                    entry.verdict = result

    # -- reading ---------------------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        """One consistent copy; O(held series), which the label limits bound."""
        with self._lock:
            self._expire(self._clock())
            writes, errors, nbytes, histograms = {}, {}, {}, {}
            collisions, last_collision, fluctuations, torn_reads = {}, {}, {}, {}
            hazards, job_scope, verdicts, last_corrupt = {}, {}, {}, {}
            last_hazard, last_fluctuation = {}, {}
            for job, series in self._jobs.items():
                for kind, n in series.hazards.items():
                    hazards[(job, kind)] = n
                for kind, when in series.last_hazard.items():
                    last_hazard[(job, kind)] = when
                if series.last_fluctuation is not None:
                    last_fluctuation[job] = series.last_fluctuation
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
                for (kind, scope), entry in series.collision_file.items():
                    verdicts[(job, kind, scope, entry.verdict)] = 1
                for cause, when in series.last_corrupt.items():
                    last_corrupt[(job, cause)] = when
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
                last_collision_verdict=MappingProxyType(verdicts),
                last_corrupt=MappingProxyType(last_corrupt),
                last_hazard=MappingProxyType(last_hazard),
                last_fluctuation=MappingProxyType(last_fluctuation),
                events_received=self._received,
                events_rejected=MappingProxyType(dict(self._rejected)),
                client_events_dropped=self._dropped,
                fluctuations=MappingProxyType(fluctuations),
                torn_reads=MappingProxyType(torn_reads),
                verifications=MappingProxyType(dict(self._verifications)),
                corrupt=MappingProxyType(dict(self._corrupt)),
                label_values=MappingProxyType({"training_job": len(self._job_values),
                                               "rank": len(self._rank_values)}),
                label_values_overflowed=MappingProxyType(dict(self._overflowed)),
                jobs_expired=self._jobs_expired,
                hazards=MappingProxyType(hazards),
                job_scope=MappingProxyType(job_scope),
            )

    def _histogram(self, series: _JobSeries) -> Histogram:
        cumulative, running = [], 0
        for bound, n in zip(self._bounds, series.duration_counts):
            running += n
            cumulative.append((_format_bound(bound), running))
        running += series.duration_counts[-1]
        cumulative.append(("+Inf", running))
        return Histogram(tuple(cumulative), series.duration_sum, running)


def collision_source(c: Collision) -> str:
    """The `source` label of a collision, where its evidence came from: "hook" if this node's
    hook saw a write of it (exact identities and call sites; the watcher or job scope may have
    seen others too, see the journal's "sources"), else "job" if it was learnt through the
    job's store (another node's hook, reported by a local one), else "fs". One sample per
    collision, so sum without(source) counts collisions once."""
    if SOURCE_HOOK in c.sources:
        return SOURCE_HOOK
    return SOURCE_JOB if SOURCE_JOB in c.sources else SOURCE_FS