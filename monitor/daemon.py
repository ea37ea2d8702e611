"""The agent's core loop: ingest -> detector -> exporters.

Threads: the ingest server thread decodes events and puts them on a queue; the HTTP server
serves scrapes; this (main) thread owns the detector, so the detector needs no locks. Every
Write and Collision the detector returns goes to every exporter: metrics, journal, log line.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time

import psutil

from exporters.journal import Journal, JournalError
from exporters.logline import collision_message
from exporters.prometheus import MetricsServer, MetricsState, build_registry
from monitor.verify import crc
from monitor import logformat
from monitor.config import Config
from monitor.detect.detector import Detector
from monitor.detect.merge import SourceMerger
from monitor.fs.source import FILE_CHANGED, FILE_CLOSED, FsSource
from monitor.ingest import IngestError, IngestServer
from monitor.detect.model import Collision, Write
from monitor.detect.sizes import SizeHistory
from monitor.verify.worker import Verification, Verifier, VerifySchedule

log = logging.getLogger("ckptwatch.agent")

TICK_SECONDS = 0.2          # detector.tick() cadence: settles collisions, expires old writes
BATCH = 4096                # events taken from the queue per turn
MAX_BACKLOG = 20_000        # events waiting before ingest stops reading (~40 MB, ~0.5 s of flood)
STALL_SECONDS = 30.0        # /healthz fails when the loop has not turned for this long
FS_TURN_SECONDS = 0.05      # loop wait with a filesystem source (see _loop)
FINDINGS = ("size_fluctuation", "torn_read")


def pid_alive(node: str, pid: int) -> bool:
    """Is a writer still running? The node name is not consulted: ingest checked every event's
    pid against the kernel's peer credentials, so each writer is a process of this node's pid
    namespace whatever node name it reports (CKPTWATCH_NODE may differ from the host name)."""
    return psutil.pid_exists(pid)


class Checks:
    """Verification of finished checkpoints, driven from the loop's thread (monitor.verify.worker).

    A path is verified once it has been quiet for `verify.quiet` seconds after its last write:
    after a collision that is when the last writer is done and the damage is final.
    """

    def __init__(self, config: Config, clock=time.monotonic):
        self.enabled = config.verify_enabled
        self.schedule = VerifySchedule(quiet=config.verify_quiet,
                                       max_paths=config.collision_max_paths)
        self.verifier = Verifier(deep_max_bytes=config.verify_deep_max_bytes,
                                 max_rate=config.verify_max_rate or None)
        self._clock = clock

    def start(self) -> None:
        if self.enabled:
            self.verifier.start()

    def stop(self) -> None:
        self.verifier.stop()

    def write_started(self, path: str) -> None:
        if self.enabled:
            self.schedule.write_started(path, self._clock())

    def write_finished(self, write: Write) -> None:
        if self.enabled and write.outcome == "ok":
            self.schedule.write_finished(write.path, write.writer.job_label, self._clock())

    def file_closed(self, path: str) -> None:
        """The watcher saw a write to `path` finish (any writer, attributed or not)."""
        if self.enabled:
            self.schedule.write_finished(path, "", self._clock())

    def collided(self, c: Collision) -> None:
        if self.enabled:
            self.schedule.collided(c.path, c.id, self._clock())

    def tick(self) -> list[Verification]:
        """Hand due paths to the worker; return the verifications it finished since."""
        if not self.enabled:
            return []
        for path, job, collision_id in self.schedule.due(self._clock()):
            self.verifier.submit(path, job, collision_id)
        return self.verifier.drain()


class Exporters:
    """Hands each detector output to every exporter; one failing exporter never stops another."""

    def __init__(self, state: MetricsState, journal: Journal, checks: Checks | None = None,
                 sizes: SizeHistory | None = None):
        self.state, self.journal, self.checks, self.sizes = state, journal, checks, sizes

    def publish(self, items) -> None:
        for item in items:
            if isinstance(item, Collision):
                self.state.collision(item)
                if self.checks is not None:
                    self.checks.collided(item)
                try:
                    log.warning("%s", collision_message(item))
                except Exception:
                    log.exception("cannot format collision on %r", item.path)
            elif isinstance(item, Write):
                self.state.write_finished(item)
                if self.checks is not None:
                    self.checks.write_finished(item)
                if self.sizes is not None:
                    finding = self.sizes.finished(item)
                    if finding is not None:
                        self.publish_finding(finding)
            if not self.journal.write(item):     # never raises; a lost line is counted
                self.state.journal_error()
            if isinstance(item, Collision):
                # The journal is buffered between ticks for throughput (one flush per tick
                # instead of one per write); a collision is rare and worth a flush of its own.
                self.journal.flush()

    def publish_finding(self, finding: dict) -> None:
        """A size fluctuation or torn read seen by the filesystem source."""
        self.state.finding(finding["type"], finding.get("job") or "")
        if not self.journal.write(finding):
            self.state.journal_error()
        who = ", ".join(f"{'rank%s' % w['rank'] if w.get('rank') is not None else 'pid'}"
                        f"({w['pid']})" for w in finding.get("writers", []))
        if finding["type"] == "size_fluctuation" and finding.get("rule"):
            log.warning("size fluctuation on %s: %s (%s then %s bytes) by %s", finding["path"],
                        finding["rule"], finding.get("size_before"), finding.get("size_after"),
                        who)
        elif finding["type"] == "size_fluctuation":
            log.warning("size fluctuation on %s: shrank from %s to %s bytes while written by "
                        "%s", finding["path"], finding.get("size_before"),
                        finding.get("size_after"), who)
        else:
            reader = finding.get("reader") or {}
            log.warning("torn read of %s: pid %s opened it for reading while %s wrote it",
                        finding["path"], reader.get("pid", "?"), who)

    def publish_verifications(self, verifications: list[Verification]) -> None:
        for v in verifications:
            self.state.verification(v.result, v.cause)
            if v.result in ("corrupt", "unverifiable"):
                # ok and gone are counted only: one journal line per save would double it.
                if not self.journal.write(v.to_record()):
                    self.state.journal_error()
            if v.result == "corrupt":
                by = f" (written by collision {v.collision_id})" if v.collision_id else ""
                log.warning("corrupt checkpoint %s: %s [%s]%s", v.path, v.reason, v.cause, by)
                self.journal.flush()


def health_check(ingest: IngestServer, heartbeat: list[float], fs: FsSource | None = None):
    """/healthz: unhealthy when a source's thread died or the core loop stopped turning."""
    def health() -> tuple[bool, str]:
        if not ingest.alive:
            return False, "ingest thread is not running"
        if fs is not None and not fs.alive:
            return False, "filesystem attribution thread is not running"
        if time.monotonic() - heartbeat[0] > STALL_SECONDS:
            return False, "agent loop stalled"
        return True, ""
    return health


class Inbox:
    """Event batches from the ingest thread to the loop, with a count for back-pressure."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0

    def put(self, batch: list) -> None:
        with self._lock:
            self._pending += len(batch)
        self._queue.put(batch)

    def backlog(self) -> int:
        """Events waiting for the loop."""
        return self._pending

    def take(self, timeout: float) -> list[dict]:
        """Up to about BATCH events; waits up to `timeout` for the first batch."""
        try:
            batch = list(self._queue.get(timeout=timeout)) if timeout else \
                list(self._queue.get_nowait())
        except queue.Empty:
            return []
        while len(batch) < BATCH:
            try:
                batch.extend(self._queue.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._pending -= len(batch)
        return batch


def _install_signal_handlers(stop: threading.Event) -> dict:
    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous          # run() in a test thread: the caller sets `stop` itself
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    return previous


class Pipeline:
    """Everything the loop's thread owns: detector, fs/hook merging, checks, exporters."""

    def __init__(self, detector: Detector, outputs: "Exporters", state: MetricsState,
                 merger: SourceMerger | None = None, fs: FsSource | None = None):
        self.detector, self.outputs, self.state = detector, outputs, state
        self.merger, self.fs = merger, fs
        self.fs_inbox: queue.SimpleQueue = queue.SimpleQueue()

    def hook_batch(self, batch: list[dict]) -> None:
        self.state.event_received(len(batch))
        checks, merger, fs = self.outputs.checks, self.merger, self.fs
        for event in batch:
            kind = event["type"]
            if kind == "dropped":
                self.state.client_dropped(event["count"])
                continue
            if kind == "start":
                if checks is not None:
                    checks.write_started(event["path"])
                if fs is not None:
                    fs.add_path(event["path"])
            if merger is not None:
                merger.hook_event(event)
            self.observe(event)

    def observe(self, event: dict) -> None:
        try:
            items = self.detector.observe(event)
        except Exception:
            # A detector bug on one event must not stop the agent for every other one.
            log.exception("detector failed on a %s event for %r", event["type"],
                          event.get("path"))
            return
        self.outputs.publish(items)

    def fs_turn(self) -> None:
        """Take what the filesystem source delivered; pass on what the merger let through."""
        if self.merger is None:
            return
        while True:
            try:
                batch = self.fs_inbox.get_nowait()
            except queue.Empty:
                break
            for event in batch:
                kind = event["type"]
                if kind in ("start", "end"):
                    if kind == "start" and self.outputs.checks is not None:
                        self.outputs.checks.write_started(event["path"])
                    self.merger.fs_event(event)
                elif kind in FINDINGS:
                    self.outputs.publish_finding(event)
                elif kind == FILE_CLOSED and self.outputs.checks is not None:
                    self.outputs.checks.file_closed(event["path"])
                elif kind == FILE_CHANGED and self.outputs.checks is not None:
                    self.outputs.checks.write_started(event["path"])
                # fs_collision is not counted: the detector builds the collision from the
                # fs writes' intervals, once, whichever sources saw it.
        forward, seen = self.merger.due()
        for event in forward:
            self.observe(event)
        for path, key in seen:
            self.detector.mark_source(path, key, "fs")

    def tick(self, ingest: IngestServer) -> None:
        self.outputs.publish(self.detector.tick())
        if self.outputs.checks is not None:
            self.outputs.publish_verifications(self.outputs.checks.tick())
        self.state.set_active_writes(self.detector.active_writes())
        self.state.set_detector_stats(self.detector.tracked_paths,
                                      self.detector.evicted_paths_total)
        self.state.set_ingest_connections(ingest.connections)
        if self.fs is not None:
            self.state.set_fs_stats(self.fs.stats())
        self.outputs.journal.flush()

    def drain(self, inbox: "Inbox") -> None:
        while batch := inbox.take(0):
            self.hook_batch(batch)
        if self.merger is not None:
            self.merger.delay = 0          # shutting down: decide on every held fs event now
            self.fs_turn()


def run(config: Config, stop: threading.Event | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT (or `stop` is set). Returns the exit code:
    0 after a clean stop, 1 when the agent cannot start (socket or port in use, ...)."""
    logformat.configure(config.log_level, config.log_format)
    stop = stop or threading.Event()
    state = MetricsState(limits=config.label_limits())
    inbox = Inbox()
    ingest = IngestServer(config.socket, None, state.event_rejected, on_events=inbox.put,
                          backlog=inbox.backlog, max_backlog=MAX_BACKLOG,
                          socket_mode=config.socket_mode, socket_group=config.socket_group)
    heartbeat = [time.monotonic()]
    detector = Detector(window=config.collision_window, settle=config.collision_settle,
                        stale_after=config.collision_stale_after,
                        max_paths=config.collision_max_paths, pid_alive=pid_alive)
    checks = Checks(config)
    fs = merger = None
    pipeline = Pipeline(detector, None, state)
    if config.watch_paths:
        # The merger waits for the hook's report of a save before taking the watcher's as a
        # write of its own; it must decide well within `settle`, before groups are final.
        merger = SourceMerger(delay=min(0.25, config.collision_settle / 2),
                              window=config.collision_window,
                              max_paths=config.collision_max_paths)
        fs = FsSource(config.watch_paths, config.watch_patterns, config.watch_mode,
                      config.watch_poll_interval, config.node, pipeline.fs_inbox.put,
                      attribution=config.watch_attribution)
        pipeline.merger, pipeline.fs = merger, fs
    server = MetricsServer(config.listen_address, build_registry(state),
                           health=health_check(ingest, heartbeat, fs))
    previous = _install_signal_handlers(stop)
    journal = None
    try:
        try:
            ingest.start()
        except IngestError as exc:
            log.error("%s", exc)
            return 1
        try:
            journal = Journal(config.journal_path, config.journal_max_bytes,
                              config.journal_backups, buffered=True)
        except JournalError as exc:
            log.error("%s", exc.strerror)       # names the path and the reason
            return 1
        pipeline.outputs = Exporters(state, journal, checks,
                                     SizeHistory(config.collision_window,
                                                 config.size_tolerance,
                                                 config.collision_max_paths))
        try:
            server.start()
        except OSError as exc:
            log.error("cannot serve metrics on %s: %s", config.listen_address,
                      exc.strerror or exc)
            return 1
        if fs is not None:
            try:
                fs.start()
            except (OSError, ValueError) as exc:
                log.error("cannot watch %s: %s", ", ".join(config.watch_paths), exc)
                return 1
        log.info("ckptwatch agent started: socket=%s metrics=%s (port %s) journal=%s "
                 "watch=%s attribution=%s verify=%s pid=%d", config.socket,
                 config.listen_address, server.port, config.journal_path,
                 ",".join(config.watch_paths) or "none", fs.attribution if fs else "none",
                 f"on (crc32: {crc.BACKEND})" if config.verify_enabled else "off", os.getpid())
        checks.start()
        _loop(stop, inbox, pipeline, ingest, heartbeat)
        log.info("stopping")
        return 0
    finally:
        ingest.stop()
        if fs is not None:
            fs.stop()
        checks.stop()
        if journal is not None:
            pipeline.outputs = Exporters(state, journal)
            pipeline.drain(inbox)
            pipeline.outputs.publish(detector.flush())
            journal.flush()
            journal.close()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _loop(stop, inbox: Inbox, pipeline: Pipeline, ingest: IngestServer, heartbeat) -> None:
    next_tick = time.monotonic()
    # With a filesystem source the loop turns more often: held fs events are due after the
    # merger's short delay, not after a whole tick.
    wait = TICK_SECONDS if pipeline.fs is None else FS_TURN_SECONDS
    while not stop.is_set():
        batch = inbox.take(wait)
        if batch:
            pipeline.hook_batch(batch)
        pipeline.fs_turn()
        now = time.monotonic()
        heartbeat[0] = now
        if now >= next_tick:
            next_tick = now + TICK_SECONDS
            pipeline.tick(ingest)


def main(argv: list[str] | None = None) -> int:
    """`ckptwatch agent` and `python agent.py`: parse flags (exit 2 on invalid configuration,
    every error listed) and run."""
    from monitor import config

    try:
        cfg = config.load(argv)
    except config.ConfigError as exc:
        for line in exc.errors:
            print(f"ckptwatch agent: {line}", file=sys.stderr)
        print("ckptwatch agent: invalid configuration (see --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:   # --help
        return exc.code if isinstance(exc.code, int) else 0
    return run(cfg)
