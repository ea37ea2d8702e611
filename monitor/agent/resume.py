"""What the agent restores from its journal at start, so that a restart changes no alert.

The alerts key on gauges of the latest event's wall time, by series (deploy/prometheus/
ckptwatch-rules.yml): ckptwatch_last_collision_timestamp_seconds{training_job,kind,scope},
ckptwatch_last_collision_verification{...,result} (the verdict on the file the latest
collision left), ckptwatch_last_corrupt_checkpoint_timestamp_seconds{training_job,reason},
ckptwatch_last_hazard_timestamp_seconds{training_job,kind} and
ckptwatch_last_size_fluctuation_timestamp_seconds{training_job}. A restarted agent that started
them empty made a firing alert resolve (its series gone) and, for counters, fire again. So at
start the agent reads the newest part of its journal and sets each gauge as it was; counters
are not restored (they count since this start: docs/metrics.md). The journal exporter learns
which files' latest verdict was bad and which a collision wrote (exporters.journal.
JournalExporter.remember), so the verdicts it journals after a restart are the same as without
one.

Bounded, whatever the journal holds: at most RESUME_MAX_BYTES of the newest journal files are
read (exporters.journal.read_tail: regular files only, lines of at most 4 MiB, only lines of
the record types below parsed), and every value is checked before use; a record that does not
check out is skipped and counted. Wall times after now (+ a clock-step allowance) are not
restored: an alert must not be held up by a journal line from the future.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from exporters.journal import JOURNALED_RESULTS, JournalExporter, ReadStats, read_tail
from exporters.metrics.state import MetricsState

log = logging.getLogger("ckptwatch.agent")

# The newest bytes read: 64 MiB is the default size of one journal file (about 200,000
# writes, hours to weeks of saves on a node), ~1 s of reading on a loaded node; the alert
# windows are 15 minutes to an hour.
RESUME_MAX_BYTES = 64 << 20
FUTURE_ALLOWANCE = 300.0            # seconds a journaled time may be ahead of now
MAX_TEXT = 4096

_PREFIXES = tuple(b'{"type":"%s"' % kind for kind in
                  (b"collision", b"verification", b"hazard", b"size_fluctuation"))


@dataclass
class ResumeStats:
    """What resume() read and restored."""

    bytes: int = 0
    records: int = 0
    collisions: int = 0
    verdicts: int = 0
    hazards: int = 0
    fluctuations: int = 0
    skipped: int = 0            # records that did not check out, lines unreadable
    seconds: float = 0.0


def _text(value) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_TEXT else None


def _wall(value, now: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    if not math.isfinite(value) or not 1.0 <= value <= now + FUTURE_ALLOWANCE:
        return None
    return value


def _collision(record: dict, state: MetricsState, exporter, now: float) -> bool:
    path, kind = _text(record.get("path")), _text(record.get("kind"))
    scope, cid = _text(record.get("scope", "node")), _text(record.get("id", ""))
    job = record.get("job")
    job = "" if job is None else _text(job)
    writers = record.get("writers")
    if None in (path, kind, scope, cid, job) or not isinstance(writers, list) or not writers:
        return False
    ends = []
    for w in writers:
        if not isinstance(w, dict):
            return False
        end = _wall(w.get("end_wall"), now) if w.get("end_wall") is not None else \
            _wall(w.get("start_wall"), now)
        if end is None:
            return False
        ends.append(end)
    ended = max(ends)
    when = _wall(record.get("detected_wall"), now) or ended
    state.resume_collision(job, kind, scope, when, cid, path, ended)
    if exporter is not None:
        exporter.remember(path, collided=True)
    return True


def _verdict(record: dict, state: MetricsState, exporter, now: float) -> bool:
    path, result = _text(record.get("path")), _text(record.get("result"))
    cause = record.get("cause") or ""
    job = record.get("job") or ""
    cid = record.get("collision_id") or ""
    wall = _wall(record.get("wall"), now)
    if None in (path, result, wall) or not all(_text(v) is not None for v in (cause, job, cid)):
        return False
    state.resume_verification(result, cause, job, path, cid, wall)
    if exporter is not None:
        exporter.remember(path, bad=result in JOURNALED_RESULTS, verdict=True)
    return True


def _finding(record: dict, state: MetricsState, now: float) -> bool:
    kind = record["type"]
    job = record.get("job") or ""
    # "ts": when the agent journaled it, by its own clock (the live gauge takes the agent's
    # clock at publication too: exporters.metrics.exporter).
    wall = _wall(record.get("ts"), now)
    hazard = _text(record.get("hazard")) if kind == "hazard" else None
    if _text(job) is None or wall is None or (kind == "hazard" and hazard is None):
        return False
    state.resume_finding(kind, job, wall, hazard)
    return True


def resume(journal_path: str, state: MetricsState, exporter: JournalExporter | None = None,
           max_bytes: int = RESUME_MAX_BYTES,
           wall_clock: Callable[[], float] = time.time) -> ResumeStats:
    """Restore the alerts' gauges (and the journal exporter's memory) from the newest
    max_bytes of the journal at journal_path. Never raises for what the journal holds; an
    unreadable journal (not a regular file, permissions) is logged and restores nothing."""
    stats = ResumeStats()
    started = time.monotonic()
    now = wall_clock()
    read = ReadStats()
    try:
        for record in read_tail(journal_path, max_bytes, _PREFIXES, read):
            kind = record["type"]
            try:
                if kind == "collision":
                    ok = _collision(record, state, exporter, now)
                    stats.collisions += ok
                elif kind == "verification":
                    ok = _verdict(record, state, exporter, now)
                    stats.verdicts += ok
                else:
                    ok = _finding(record, state, now)
                    if kind == "hazard":
                        stats.hazards += ok
                    else:
                        stats.fluctuations += ok
            except (TypeError, ValueError, KeyError, AttributeError):
                ok = False
            stats.skipped += not ok
    except OSError as exc:
        log.warning("cannot resume from journal %s: %s", journal_path, exc.strerror or exc)
    stats.bytes, stats.records = read.bytes, read.records
    stats.skipped += read.malformed
    stats.seconds = time.monotonic() - started
    return stats
