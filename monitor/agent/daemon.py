"""The agent's core loop: sources -> detector -> exporters.

`Agent.build(config)` constructs everything; `start()` starts every source (the ingest
socket, the filesystem source, the verifier) and the metrics server; `serve(stop)` is the
loop; `stop()` finalises and shuts down. Threads: the ingest server thread decodes events and
puts them on a queue; the filesystem source's thread delivers fs events; the HTTP server
serves scrapes; the loop's thread owns the detector, so the detector needs no locks. Every
Write, Collision and Finding goes to every exporter (exporters.fanout): metrics, journal, log.
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

from ckptwatch.events import JOB_SCOPE_TYPES
from exporters.fanout import Fanout
from exporters.health import health_check, liveness_check
from exporters.journal import Journal, JournalError, JournalExporter
from exporters.logline import LogExporter
from exporters.metrics.collector import build_registry
from exporters.metrics.components import (ChecksCollector, DetectorCollector, FsCollector,
                                          HttpCollector, IngestCollector, JobScopeCollector,
                                          JournalCollector, LoopCollector)
from exporters.metrics.exporter import MetricsExporter
from exporters.metrics.server import MetricsServer
from exporters.metrics.state import MetricsState
from monitor.agent import gcpolicy, logformat
from monitor.agent.config import Config
from monitor.agent.jobreports import JobScopeEvents
from monitor.agent.resume import resume
from monitor.agent.storereader import Handover, StoreReader
from monitor.agent.verdictbook import VerdictBook
from monitor.detect.detector import Detector
from monitor.detect.merge import SourceMerger
from monitor.detect.model import (FINDING_VERIFICATION, KIND_CONCURRENT, SOURCE_FS, Collision,
                                  Finding, Write)
from monitor.detect.sizes import SizeHistory
from monitor.fs.source import FILE_CHANGED, FILE_CLOSED, FileNotice, FsSource
from monitor.ingest.inbox import Inbox
from monitor.ingest.notices import notices_for
from monitor.ingest.server import HANGUP, RIGHTS, IngestError, IngestServer
from monitor.verify import crc
from monitor.verify.checks import Checks
from monitor.verify.integrity import CAUSES as CORRUPT_CAUSES
from monitor.verify.worker import RESULTS as VERIFY_RESULTS
from monitor.verify.worker import Verification

log = logging.getLogger("ckptwatch.agent")

TICK_SECONDS = 0.2          # detector.tick() cadence: settles collisions, expires old writes
MAX_BACKLOG = 2048         # events waiting before ingest stops reading: half a batch, ~6 MB
                           # (decoded events cost ~2.4-3 KB each; 8,192 held ~25 MB at the
                           # soak's peak) and a fraction of a second of work for a loaded
                           # loop, which a hook's events wait behind; the senders' sockets
                           # buffer the rest
FS_TURN_SECONDS = 0.05      # loop wait with a filesystem source (see Agent.serve)


def pid_alive(node: str, pid: int) -> bool:
    """Is a writer still running? The node name is not consulted: ingest checked every event's
    pid against the kernel's peer credentials and the agent stamps its own node name on every
    hook event (Agent.hook_batch), so each writer is a process of this node's pid namespace."""
    return psutil.pid_exists(pid)


def _install_signal_handlers(stop: threading.Event) -> dict:
    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous          # run() in a test thread: the caller sets `stop` itself
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    return previous


class StartError(Exception):
    """The agent cannot start (socket or port in use, journal or watch path unusable)."""


class Agent:
    """Everything the loop owns: sources, detector, fs/hook merging, checks, exporters.

    build() constructs it from a Config; start(), serve(stop), stop() run it (see run()).
    """

    def __init__(self, config: Config, state: MetricsState, inbox: "Inbox",
                 ingest: IngestServer, detector: Detector, checks: Checks, sizes: SizeHistory,
                 exporters: Fanout, server: MetricsServer, merger: SourceMerger | None = None,
                 fs: FsSource | None = None, heartbeat: list[float] | None = None,
                 fs_inbox: queue.SimpleQueue | None = None,
                 job_scope: JobScopeEvents | None = None,
                 started: threading.Event | None = None,
                 store_reader: StoreReader | None = None):
        self.config, self.state, self.inbox, self.ingest = config, state, inbox, ingest
        self.detector, self.checks, self.sizes = detector, checks, sizes
        self.exporters, self.server, self.merger, self.fs = exporters, server, merger, fs
        self.heartbeat = heartbeat if heartbeat is not None else [time.monotonic()]
        self.fs_inbox = fs_inbox if fs_inbox is not None else queue.SimpleQueue()
        self._stopping = False
        self.journal: Journal | None = None
        # What loads are told (monitor/agent/verdictbook.py); build() shares it with ingest
        # and the verifier.
        self.book = VerdictBook(config.collision_max_paths, store=False)
        self.job_scope = job_scope if job_scope is not None else JobScopeEvents()
        # Reads of a job's store for the writes of local processes gone without reading it.
        self.store_reader = store_reader
        self.handover = Handover(store_reader, config.collision_window)
        # Set once start() has started every source: /-/ready waits for it.
        self.started = started if started is not None else threading.Event()

    @classmethod
    def build(cls, config: Config) -> "Agent":
        """Construct every part; nothing listens or runs yet. Raises StartError when the
        journal cannot be opened."""
        state = MetricsState(limits=config.label_limits(), verify_results=VERIFY_RESULTS,
                             corrupt_causes=CORRUPT_CAUSES,
                             verify_enabled=config.verify_enabled)
        inbox = Inbox()
        book = VerdictBook(config.collision_max_paths, store=config.verify_store_verdict)
        fs_inbox: queue.SimpleQueue = queue.SimpleQueue()
        heartbeat = [time.monotonic()]
        ingest = IngestServer(config.socket, inbox.put, state.event_rejected,
                              backlog=inbox.backlog, max_backlog=MAX_BACKLOG,
                              processed=inbox.finished,
                              socket_mode=config.socket_mode, socket_group=config.socket_group,
                              hangups=True, on_query=book.answer)
        detector = Detector(window=config.collision_window, settle=config.collision_settle,
                            stale_after=config.collision_stale_after,
                            max_paths=config.collision_max_paths, pid_alive=pid_alive,
                            max_hold=config.collision_max_hold,
                            job_settle=config.collision_job_settle)
        sizes = SizeHistory(config.collision_window, config.size_tolerance,
                            config.collision_max_paths)
        merger = fs = None
        if config.watch_paths:
            # The merger waits for the hook's report of a save before taking the watcher's as
            # a write of its own; it must decide well within `settle`, before groups are final.
            merger = SourceMerger(delay=min(0.25, config.collision_settle / 2),
                                  window=config.collision_window,
                                  max_paths=config.collision_max_paths)
            fs = FsSource(config.watch_paths, config.watch_patterns, config.watch_mode,
                          config.watch_poll_interval, config.node, fs_inbox.put,
                          attribution=config.watch_attribution)
        try:
            journal = Journal(config.journal_path, config.journal_max_bytes,
                              config.journal_backups, buffered=True)
        except JournalError as exc:
            raise StartError(exc.strerror) from exc     # names the path and the reason
        checks = Checks(config.verify_enabled, config.verify_quiet, config.collision_max_paths,
                        config.verify_deep_max_bytes, config.verify_max_rate,
                        incomplete_after=config.verify_incomplete_after,
                        on_verdict=book.stamp)
        job_scope = JobScopeEvents()
        # Each component's metrics are read from it when scraped (exporters.metrics.
        # components); the state holds only what was published to it.
        registry = build_registry(state, IngestCollector(ingest), DetectorCollector(detector),
                                  JobScopeCollector(job_scope), ChecksCollector(checks),
                                  JournalCollector(journal), LoopCollector(inbox),
                                  *([FsCollector(fs)] if fs is not None else []))
        started = threading.Event()
        server = MetricsServer(config.listen_address, registry,
                               health=health_check(ingest, heartbeat, fs, inbox,
                                                   started=started),
                               healthy=liveness_check(ingest, heartbeat, fs),
                               web_config=config.web_config,
                               telemetry_path=config.telemetry_path)
        registry.register(HttpCollector(server))
        journal_exporter = JournalExporter(journal)
        # Before the first scrape: the alerts' gauges as they were before this start.
        resumed = resume(journal.path, state, journal_exporter)
        log.info("resumed from journal", extra={"fields": {
            "journal": journal.path, "read_bytes": resumed.bytes,
            "collisions": resumed.collisions, "verdicts": resumed.verdicts,
            "hazards": resumed.hazards, "size_fluctuations": resumed.fluctuations,
            "skipped": resumed.skipped, "seconds": round(resumed.seconds, 3)}})
        exporters = Fanout([MetricsExporter(state),
                            journal_exporter,
                            LogExporter()])
        store_reader = (StoreReader(config.node, config.collision_window)
                        if config.job_scope_store_reads else None)
        agent = cls(config, state, inbox, ingest, detector, checks, sizes, exporters,
                    server, merger, fs, heartbeat, fs_inbox, job_scope, started,
                    store_reader)
        agent.journal = journal
        agent.book = book
        return agent

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start every source and the metrics server; StartError if one cannot start (the
        caller then calls stop(), which stops what did start)."""
        config = self.config
        try:
            self.ingest.start()
        except IngestError as exc:
            raise StartError(str(exc)) from exc
        try:
            self.server.start()
        except OSError as exc:
            raise StartError(f"cannot serve metrics on {config.listen_address}: "
                             f"{exc.strerror or exc}") from exc
        for path in config.watch_paths:
            if not os.path.isdir(path):
                log.warning("--watch.path does not exist: nothing is watched there until "
                            "it is created", extra={"fields": {"path": path}})
        if self.fs is not None:
            try:
                self.fs.start()
            except (OSError, ValueError) as exc:
                raise StartError(f"cannot watch {', '.join(config.watch_paths)}: {exc}") \
                    from exc
        log.info("ckptwatch agent started", extra={"fields": {
            "socket": config.socket, "metrics": config.listen_address,
            "port": self.server.port, "journal": config.journal_path,
            "watch": config.watch_paths or "none",
            "attribution": self.fs.attribution if self.fs else "none",
            "verify": f"on (crc32: {crc.BACKEND})" if config.verify_enabled else "off",
            "pid": os.getpid()}})
        self.checks.start()
        if self.store_reader is not None:
            self.store_reader.start()
        self.started.set()

    def serve(self, stop: threading.Event) -> None:
        """The loop, until `stop` is set: take events in, hand them on, tick."""
        next_tick = time.monotonic()
        # With a filesystem source the loop turns more often: held fs events are due after
        # the merger's short delay, not after a whole tick.
        wait = TICK_SECONDS if self.fs is None else FS_TURN_SECONDS
        while not stop.is_set():
            batch = self.inbox.take(wait)
            if batch:
                self.hook_batch(batch)
                self.inbox.done()
            self.fs_turn()
            self.store_turn()
            now = time.monotonic()
            self.heartbeat[0] = now
            if now >= next_tick:
                next_tick = now + TICK_SECONDS
                self.tick()

    def stop(self) -> None:
        """Stop the sources, then finalise: what is still queued and every pending
        collision reach the exporters, the journal is flushed and closed, the socket
        removed. Safe after a failed or partial start()."""
        try:
            try:
                self.ingest.stop()           # removes the socket
            finally:
                try:
                    if self.fs is not None:
                        self.fs.stop()
                finally:
                    try:
                        self.checks.stop()
                    finally:
                        if self.store_reader is not None:
                            self.store_reader.stop()
        finally:
            try:
                # The verifier has stopped: nothing more is scheduled or size-compared.
                self._stopping = True
                self.drain()
                self.publish(self.detector.flush())
            finally:
                try:
                    self.exporters.close()
                finally:
                    self.server.stop()

    # ------------------------------------------------------------------ the loop's work

    def publish(self, items) -> None:
        """Detector outputs to the verification schedule, the size history, the exporters."""
        for item in items:
            if isinstance(item, Write):
                self.book.write_ended(item.path, (item.writer.node, item.writer.pid, item.seq))
                self.exporters.publish_write(item)
                if not self._stopping:
                    if item.outcome == "ok":
                        # A write of a job spanning nodes: its job-scope collision is final
                        # only after job_settle, and the verdict must name it (issue 16).
                        w = item.writer
                        spans = (w.master is not None and (w.world_size or 0) > 1 and (
                            w.local_world_size is None or w.local_world_size < w.world_size))
                        self.checks.write_finished(
                            item.path, w.job_label, w.run_key, item.source == SOURCE_FS,
                            hold=(self.config.collision_job_settle
                                  + self.config.collision_settle) if spans else 0.0)
                    finding = self.sizes.finished(item)
                    if finding is not None:
                        self.exporters.publish_finding(finding)
            elif isinstance(item, Collision):
                if item.kind == KIND_CONCURRENT:
                    self.book.collided(item.path, item.id, item.to_record()["writers"])
                if not self._stopping:
                    self.checks.collided(item.path, item.id)
                self.exporters.publish_collision(item)
                self.notify(item.to_record())
            elif isinstance(item, Finding):
                self.exporters.publish_finding(item)
                if item.to_record().get("type") == "hazard":
                    self.notify(item.to_record())

    def notify(self, record: dict) -> None:
        """Tell the local writers of a collision or hazard record, on their open connections
        that asked for it (the warn policy: monitor.ingest.notices, ingest.notify)."""
        try:
            for pid, writes, frame in notices_for(record, self.config.node):
                self.ingest.notify(pid, frame, writes)
        except Exception:
            log.exception("building notices failed")

    def hook_batch(self, batch: list[dict]) -> None:
        merger, fs = self.merger, self.fs
        node = self.config.node
        hangups = 0
        # Looked up once per batch, not per event (issue 22: this loop runs for every event;
        # _stopping only changes on this thread, in stop(), between batches).
        handover, book, checks, detector = self.handover, self.book, self.checks, self.detector
        observe = self.observe
        stopping = self._stopping
        for event in batch:
            # Everything on our socket comes from a process of this node (ingest checked its
            # pid against the kernel's credentials): the node is ours, whatever the sender
            # claims, so one process cannot pose as two writers (docs/decisions.md). What it
            # claimed is kept only to find its own lines in its job's store (storereader).
            claimed = event.get("node")
            event["node"] = node
            kind = event["type"]
            if kind == HANGUP:          # ingest's word, not a hook's event: not counted
                hangups += 1
                self.hung_up(event)
                continue
            if kind == "dropped":
                self.state.client_dropped(event["count"])
                continue
            if kind in JOB_SCOPE_TYPES:
                if kind == "jobscope":
                    handover.announced(event, claimed)
                self.job_scope_event(event)
                continue
            handover.wrote(event)
            # A short save's end is usually its only event (its start is not sent,
            # ckptwatch/emitter.py): it names the path and its writer's rights as a start does.
            rights = event.get(RIGHTS)
            uid = getattr(rights, "uid", None)
            path, pid, seq = event["path"], event["pid"], event["seq"]
            if kind == "start":
                book.write_started(path, (node, pid, seq), uid)
                if not stopping:
                    checks.write_started(path, rights)
            else:
                book.write_ended(path, (node, pid, seq), uid)
                if not stopping and not detector.is_open(node, pid, seq):
                    checks.writer_seen(path, rights)
            if fs is not None:
                fs.add_path(path)
            if merger is not None:
                merger.hook_event(event)
            observe(event)
        self.state.event_received(len(batch) - hangups)

    def hung_up(self, event: dict) -> None:
        """A hook's process ended its connection (monitor.ingest.server, "Hang-ups")."""
        try:
            self.detector.hung_up(event["node"], event["pid"], event["mono"], event["wall"])
        except Exception:
            log.exception("detector failed on a hang-up of pid %s", event.get("pid"))
        try:
            self.handover.hung_up(event["pid"], event["mono"], event["wall"])
        except Exception:
            log.exception("store hand-over failed on a hang-up of pid %s", event.get("pid"))

    def store_turn(self) -> None:
        """Take the remote writes the store reader learnt for gone processes: to the
        detector exactly as the processes' own reports would have gone."""
        reader = self.store_reader
        if reader is None:
            return
        while True:
            try:
                event = reader.results.get_nowait()
            except queue.Empty:
                return
            self.job_scope_event(event)

    def job_scope_event(self, event: dict) -> None:
        """remote / hazard / jobscope events (monitor.agent.jobreports)."""
        kind = event["type"]
        if kind == "remote":
            self.job_scope.remote_received += 1
            try:
                items = self.detector.observe_remote(event)
            except Exception:
                log.exception("detector failed on a remote write for %r", event.get("path"))
                return
            self.publish(items)
        elif kind == "hazard":
            if self.job_scope.not_this_bug(event, self.detector.local_writers(event["path"])):
                return
            finding = self.job_scope.hazard(event)
            if finding is not None:
                self.publish([finding])        # exported, and noticed to its writer (warn)
        elif event.get("settled") is not True:
            # (A "settled" event says the process read all it needed at exit, for the store
            # reader: not a change of state, neither counted nor logged as one.)
            self.state.job_scope(event.get("job") or "", event["state"])
            self.job_scope.state_reported(event)

    def observe(self, event: dict) -> None:
        try:
            items = self.detector.observe(event)
        except Exception:
            # A detector bug on one event must not stop the agent for every other one.
            log.exception("detector failed on a %s event for %r", event["type"],
                          event.get("path"))
            return
        if items:               # a start makes nothing final: most events have none
            self.publish(items)

    def fs_turn(self) -> None:
        """Take what the filesystem source delivered; pass on what the merger let through."""
        if self.merger is None:
            return
        checks = None if self._stopping else self.checks
        while True:
            try:
                batch = self.fs_inbox.get_nowait()
            except queue.Empty:
                break
            for item in batch:
                if isinstance(item, Finding):
                    self.exporters.publish_finding(item)
                elif isinstance(item, FileNotice):
                    if checks is None:
                        continue
                    if item.kind == FILE_CLOSED:
                        checks.file_closed(item.path)
                    elif item.kind == FILE_CHANGED:
                        checks.write_started(item.path, watched=True)
                else:                                   # a start or end event
                    if checks is not None:
                        if item["type"] == "start":
                            checks.write_started(item["path"], watched=True)
                        else:
                            # The start of a write can arrive after its close notice (the
                            # fanotify and inotify queues are separate) and after the hook's
                            # report of it: its own end, which always follows it, makes the
                            # path due again, or a start would hold it forever.
                            checks.file_closed(item["path"])
                    self.merger.fs_event(item)
        forward, seen = self.merger.due()
        for event in forward:
            self.observe(event)
        for path, key in seen:
            self.detector.mark_source(path, key, "fs")

    def tick(self) -> None:
        try:
            items = self.detector.tick()
        except Exception:
            # A detector bug must not end the loop for every other event (as observe()).
            log.exception("detector tick failed")
            items = []
        self.publish(items)
        for v in self.checks.tick():
            self.exporters.publish_finding(verification_finding(v))
        self.state.set_active_writes(self.detector.active_writes())
        self.exporters.flush()

    def drain(self) -> None:
        """Hand on every event still queued (at shutdown)."""
        while batch := self.inbox.take(0):
            self.hook_batch(batch)
            self.inbox.done()
        if self.merger is not None:
            self.merger.delay = 0          # shutting down: decide on every held fs event now
            self.fs_turn()


def verification_finding(v: Verification) -> Finding:
    """A verifier's verdict as the Finding the exporters take (monitor.verify may not import
    the detect model, so the agent converts)."""
    return Finding(kind=FINDING_VERIFICATION, path=v.path, job=v.job, wall=v.wall,
                   details={"result": v.result, "format": v.format, "reason": v.reason,
                            "cause": v.cause, "deep": v.deep, "bytes": v.bytes,
                            "seconds": v.seconds, "collision_id": v.collision_id,
                            "pickle": v.pickle, "refused_globals": v.refused_globals})


def run(config: Config, stop: threading.Event | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT (or `stop` is set). Returns the exit code:
    0 after a clean stop, 1 when the agent cannot start (socket or port in use, ...)."""
    logformat.configure(config.log_level, config.log_format)
    stop = stop or threading.Event()
    try:
        agent = Agent.build(config)
    except StartError as exc:
        log.error("%s", exc)
        return 1
    previous = _install_signal_handlers(stop)
    try:
        try:
            agent.start()
        except StartError as exc:
            log.error("%s", exc)
            return 1
        agent.serve(stop)
        log.info("stopping")
        return 0
    finally:
        try:
            agent.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """`ckptwatch agent` and `python agent.py`: parse flags (exit 2 on invalid configuration,
    every error listed) and run."""
    from monitor.agent import config

    try:
        cfg = config.load(argv)
        problems = config.path_problems(cfg)
        if problems:
            raise config.ConfigError(problems)
    except config.ConfigError as exc:
        # One line per problem, the last pointing at the help: nothing else to read past.
        for index, line in enumerate(exc.errors):
            last = index == len(exc.errors) - 1
            print(f"ckptwatch agent: {line}" + (" (see ckptwatch agent --help)" if last
                                                else ""), file=sys.stderr)
        return 2
    except SystemExit as exc:   # --help
        return exc.code if isinstance(exc.code, int) else 0
    gcpolicy.configure()        # this process is the agent: its collector settings
    return run(cfg)
