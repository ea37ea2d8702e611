"""Job scope: the ranks of one torch.distributed job tell each other about their saves through
the job's own store, so writes of one path from different nodes are seen by every node's agent.

Loaded into training processes: standard library, plus the process's own torch (imported here
only in the background thread, and only in a process that torch.save was patched in, i.e. that
has imported torch already). Started by the hook's install() when the environment describes a
distributed job that spans nodes (MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE all set, and
LOCAL_WORLD_SIZE, when set, smaller than WORLD_SIZE: a single-node job has nothing to learn).

What runs where:
- The save path calls started() and ended(): each appends a tuple to a bounded deque (dropped
  and counted when full) and, only if the thread is idle, sets an Event. It never touches the
  store, never waits, never raises.
- One daemon thread owns everything else: its OWN client connection to the job's store
  (torch.distributed.TCPStore(host, port, is_master=False, wait_for_workers=False) — never the
  job's store object, which the training thread owns), the announcements, the reads, the
  deletions, the reports to the local agent (through the process's emitter, as "remote",
  "hazard" and "jobscope" events: ckptwatch/events.py).
- Connection: a plain TCP probe first (a refused or silent port costs no C++ error spam and at
  most PROBE_TIMEOUT), then the TCPStore client. Retried with backoff for CONNECT_BUDGET
  seconds (ranks may start before the store is up); then job scope is disabled for the process.
  Any failing or timed-out store operation (a slow or gone store) disables it too. Disabling is
  logged once, counted (stats()) and reported to the agent as a "jobscope" event.

Keys (all under our prefix, never the job's): PREFIX = "ckptwatch/<run>" with run = a hash of
(job id, MASTER_ADDR:MASTER_PORT when the job id is "none" or unknown, restart count), so an
elastic restart is a new run and two static-rendezvous jobs never share keys.
  PREFIX/t                  ticket counter: store.add(1) gives a job-wide order of events
  PREFIX/<h>/<e>/n          slot counter of path hash h in epoch e (e = start wall // WINDOW)
  PREFIX/<h>/<e>/<i>        slot i: one write's JSON record (written at start, again at end)
A rank finds the others' writes of its path by reading the slot counter of the epochs around
its write (a compare_set that does not create the key) and then only those slots: O(writers of
that path), not O(keys). Deletion: each writer deletes its own slot DELETE_AFTER windows after
its write ended; the writer of slot 1 deletes the epoch's counter once the epoch is three
windows old; a reader deletes slots it finds more than two windows old (their writer exited).
So the store holds keys for the writes of the last ~2 windows, whatever the number of saves.

Overlap across nodes (design.md, "concurrent collision") is decided on store tickets, not on
wall clocks: every start and end announcement takes a ticket from PREFIX/t, and the store
serialises them, so A and B overlapped iff A.start_ticket < B.end_ticket and B.start_ticket <
A.end_ticket. A ticket is taken when the thread announces, a thread wake-up and one round trip
(~0.1-1 ms) after the save's real start or end: overlaps shorter than that may be judged
one-after-another (a redundant write instead of a concurrent one; either is reported). Without
both tickets (a start made before the connection), wall clocks decide as they are.
"""
from __future__ import annotations

import atexit
import collections
import datetime
import hashlib
import heapq
import importlib
import json
import logging
import os
import socket
import sys
import threading
import time

from ckptwatch import emitter as _emitter_mod
from ckptwatch.events import SCHEMA_VERSION
from ckptwatch.sharedfs import SharedPaths, names_rank_or_node

log = logging.getLogger("ckptwatch.jobscope")

ENABLE_ENV = "CKPTWATCH_JOBSCOPE"            # "0" turns job scope off
STORE_PORT_ENV = "CKPTWATCH_STORE_PORT"      # our client's port (default MASTER_PORT); tests
STORE_HOST_ENV = "CKPTWATCH_STORE_HOST"      # our client's host (default MASTER_ADDR)
WINDOW_ENV = "CKPTWATCH_JOBSCOPE_WINDOW"     # seconds; the collision window (default 60)
CONNECT_BUDGET_ENV = "CKPTWATCH_JOBSCOPE_CONNECT_TIMEOUT"
REQUIRED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

WINDOW = 60.0
CONNECT_BUDGET = 60.0       # seconds of retrying before job scope is disabled
PROBE_TIMEOUT = 1.0
OP_TIMEOUT = 5.0            # one store operation; longer = a slow store: disabled
EXIT_TIMEOUT = 1.0          # at exit, wait this long at most for other ranks' ends
BACKOFF_MIN, BACKOFF_MAX = 0.1, 2.0
MAX_QUEUE = 4096
MAX_SLOTS_READ = 64         # slots read per path and epoch: the latest ones
MAX_WATCHED = 256           # own recent writes whose path is re-read for later writers
MAX_PENDING_DELETES = 100_000
DELETE_AFTER = 2.0          # windows after a write's end before its slot is deleted
POLL_FIRST, POLL_MAX, POLL_IN_FLIGHT = 0.2, 5.0, 0.2
EPS = 1e-6
_ABSENT = "\x00ckptwatch-absent"   # compare_set(key, X, X) returns X when key is absent
HAZARD_LOCAL_RANK_GUARD = "local_rank_guard"
HAZARD_SHARED_MULTI_WRITER = "shared_storage_multi_writer"

STATE_CONNECTING, STATE_ACTIVE, STATE_DISABLED = "connecting", "active", "disabled"


def _env_float(environ, name: str, default: float) -> float:
    try:
        value = float(environ[name])
    except (KeyError, ValueError):
        return default
    return value if value > 0 else default


def run_prefix(ident: dict) -> str:
    """ckptwatch/<16 hex>: the store keys of one job run (ckptwatch.jobrun.job_run). Job scope
    starts only with MASTER_ADDR:MASTER_PORT set, so its run always has a name."""
    from ckptwatch.jobrun import job_run    # here: this function is all of jobscope it concerns
    run = job_run(ident.get("job"), ident.get("master"), ident.get("restart"))
    text = "\0".join(map(str, run)) if run is not None else ""
    return "ckptwatch/" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def path_hash(path: str) -> str:
    return hashlib.sha1(path.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def place_remote(own: dict, remote: dict) -> tuple[float, float, bool | None]:
    """A remote write's interval in this process's monotonic time base, and whether it
    overlapped our write by the store's ticket order (None: tickets unknown, walls decide).

    own: sw, sm (our start wall / mono), ew, em, ts, te; remote: sw, ew, ts, te. The walls are
    mapped through our own wall-mono offset, then moved the least needed to agree with the
    ticket order, so the agent's detector (which compares intervals) reaches the same verdict.
    """
    offset = own["sw"] - own["sm"]
    rs = remote["sw"] - offset
    re_ = max(remote["ew"] - offset, rs)
    o_start, o_end = own["sm"], own["em"]
    tickets = (own.get("ts"), own.get("te"), remote.get("ts"), remote.get("te"))
    if any(type(t) is not int for t in tickets):
        return rs, re_, None
    o_ts, o_te, r_ts, r_te = tickets
    overlap = r_ts < o_te and o_ts < r_te
    walls_overlap = rs < o_end and o_start < re_
    if overlap and not walls_overlap:
        if rs >= o_end:
            rs = o_end - EPS
        if re_ <= o_start:
            re_ = o_start + EPS
        re_ = max(re_, rs)
    elif not overlap and walls_overlap:
        if r_ts > o_te:                 # the store saw it start after ours ended
            rs = o_end + EPS
            re_ = max(re_, rs)
        else:                           # it ended before ours started
            re_ = o_start - EPS
            rs = min(rs, re_)
    return rs, re_, overlap


class _Own:
    """One of our writes: its slot, its tickets, and what was learnt about its path."""

    __slots__ = ("seq", "path", "h", "epoch", "slot", "key", "rec", "sm", "em", "done",
                 "reported", "read_upto", "in_flight", "ranks", "nodes", "shared",
                 "next_poll", "delay", "until", "in_flight_seen")

    def __init__(self, seq, path, h, epoch):
        self.seq, self.path, self.h, self.epoch = seq, path, h, epoch
        self.slot = self.key = None
        self.rec: dict = {}
        self.sm = self.em = None
        self.done = False
        self.reported: dict = {}        # remote key -> True once reported with its end
        self.read_upto: dict = {}       # epoch -> highest slot index read so far
        self.in_flight: set = set()     # slot keys of other writes seen in flight: read again
        self.ranks: set = set()         # ranks known to write the path (hazard)
        self.nodes: set = set()
        self.shared = None
        self.next_poll = self.delay = self.until = 0.0
        self.in_flight_seen = False


class JobScope:
    """See the module docstring. One per process; started by start_if_distributed()."""

    def __init__(self, host: str, port: int, ident: dict, *, window: float = WINDOW,
                 connect_budget: float = CONNECT_BUDGET, op_timeout: float = OP_TIMEOUT,
                 exit_timeout: float = EXIT_TIMEOUT, emit=None, shared: SharedPaths | None = None,
                 clock=time.monotonic, wall=time.time):
        self.host, self.port = host, int(port)
        self.ident = dict(ident)
        self.window = float(window)
        self.prefix = run_prefix(ident)
        self._connect_budget, self._op_timeout = connect_budget, op_timeout
        self._exit_timeout = exit_timeout
        self._emit_fn = emit
        self._shared = shared or SharedPaths()
        self._clock, self._wall = clock, wall
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._idle = True
        self._stopping = False
        self._exiting = False
        self._forked = False
        self._thread: threading.Thread | None = None
        self._store = None
        self.state = STATE_CONNECTING
        self.reason: str | None = None
        self._started_at = clock()
        self._next_connect = 0.0
        self._backoff = BACKOFF_MIN
        self._own: dict[int, _Own] = {}              # seq -> our write (until its slot goes)
        self._watch: list = []                       # heap (next_poll, seq)
        self._deletes: list = []                     # heap (due, order, seq or stale key)
        self._delete_order = 0
        self._hazards_sent: set = set()
        self._own_keys: set = set()                  # our live slot keys: never read back
        self.counters = {"announced": 0, "unannounced": 0, "dropped": 0, "remote_reported": 0,
                         "hazards": 0, "store_ops": 0, "store_bytes": 0, "errors": 0,
                         "deleted": 0}

    # ---- caller side (the save path): a deque append, never blocks, never raises ----------

    def started(self, pending) -> None:
        self._put(("s", pending))

    def ended(self, pending, wall: float, mono: float, outcome: str) -> None:
        self._put(("e", pending, wall, mono, outcome))

    def _put(self, item) -> None:
        try:
            if self._forked or self._stopping:
                return
            if len(self._queue) >= MAX_QUEUE:
                self.counters["dropped"] += 1
                return
            self._queue.append(item)
            if self._idle:
                self._wake.set()
        except Exception:
            self.counters["errors"] += 1

    # ---- control --------------------------------------------------------------------------

    def start(self) -> "JobScope":
        thread = threading.Thread(target=self._run, name="ckptwatch-jobscope", daemon=True)
        self._thread = thread
        thread.start()
        return self

    def stats(self) -> dict:
        return dict(self.counters, state=self.state, queued=len(self._queue),
                    own_slots=len(self._own))

    def close(self, timeout: float | None = None) -> None:
        """At exit: finish what is queued and, connected, wait up to exit_timeout for the
        ends of other ranks' writes of our paths that are still in flight, then stop."""
        thread = self._thread
        if thread is None or self._forked or self._stopping:
            return
        if self.state != STATE_ACTIVE:
            if self.state == STATE_CONNECTING:
                self._disable(f"never reached the store at {self.host}:{self.port}")
            self._stopping = True
            self._wake.set()
            return
        self._exiting = True
        self._wake.set()
        thread.join(self._exit_timeout + 0.5 if timeout is None else timeout)
        self._stopping = True
        self._wake.set()

    def after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) must not share our store connection or thread.
        self._forked = True
        self._store = None
        self._queue = collections.deque()

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        exit_deadline = None
        while not self._stopping:
            try:
                if self._store is None and self.state == STATE_CONNECTING:
                    self._try_connect()
                self._drain_queue()
                now = self._clock()
                if self._exiting:
                    if exit_deadline is None:
                        exit_deadline = now + self._exit_timeout
                        for own in self._own.values():
                            own.next_poll = now
                    pending = self._poll_due(now, exiting=True)
                    if not pending or now >= exit_deadline or self._store is None:
                        break
                    time.sleep(0.05)
                    continue
                self._poll_due(now)
                self._delete_due(now)
                self._sleep(now)
            except Exception:
                self.counters["errors"] += 1
                time.sleep(BACKOFF_MIN)

    def _sleep(self, now: float) -> None:
        due = now + 1.0
        if self._watch:
            due = min(due, self._watch[0][0])
        if self._deletes:
            due = min(due, self._deletes[0][0])
        if self.state == STATE_CONNECTING:
            due = min(due, self._next_connect)
        self._idle = True
        self._wake.clear()
        if not self._queue and not self._stopping and not self._exiting:
            self._wake.wait(max(0.0, due - now))
        self._idle = False

    # ---- connection -----------------------------------------------------------------------

    def _try_connect(self) -> None:
        now = self._clock()
        if now < self._next_connect:
            return
        if now - self._started_at > self._connect_budget:
            self._disable(f"store {self.host}:{self.port} unreachable for "
                          f"{self._connect_budget:.0f}s")
            return
        try:
            with socket.create_connection((self.host, self.port), timeout=PROBE_TIMEOUT):
                pass
        except OSError:
            self._next_connect = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return
        try:
            # The process's own torch, found (or, at worst, finished importing) by name in
            # this thread: ckptwatch never imports torch statically (pyproject contracts).
            dist = sys.modules.get("torch.distributed") or importlib.import_module(
                "torch.distributed")
            self._store = dist.TCPStore(self.host, self.port, None, False,
                                   datetime.timedelta(seconds=self._op_timeout),
                                   wait_for_workers=False)
        except Exception as exc:
            self._disable(f"cannot open a client of the store at {self.host}:{self.port}: "
                          f"{type(exc).__name__}")
            return
        self.state = STATE_ACTIVE
        self._send_state()

    def _disable(self, reason: str) -> None:
        if self.state == STATE_DISABLED:
            return
        self.state, self.reason, self._store = STATE_DISABLED, reason, None
        self._watch.clear()
        self._deletes.clear()
        log.warning("ckptwatch: job scope disabled in pid %d: %s (node-scope detection goes "
                    "on)", os.getpid(), reason)
        self._send_state()

    def _send_state(self) -> None:
        ident = self.ident
        self._emit({"v": SCHEMA_VERSION, "type": "jobscope", "node": ident["node"],
                    "pid": os.getpid(), "state": self.state, "reason": self.reason,
                    "rank": ident.get("rank"), "job": ident.get("job"),
                    "master": ident.get("master"), "restart": ident.get("restart"),
                    "wall": self._wall()})

    def _emit(self, event: dict) -> None:
        try:
            (self._emit_fn or _emitter_mod.get_emitter().emit)(event)
        except Exception:
            self.counters["errors"] += 1

    # ---- store operations (every one counted; any failure disables job scope) -------------

    def _op(self, name: str, *args):
        store = self._store
        if store is None:
            raise _Unavailable()
        self.counters["store_ops"] += 1
        self.counters["store_bytes"] += sum(len(a) for a in args if isinstance(a, (str, bytes)))
        try:
            result = getattr(store, name)(*args)
        except Exception as exc:
            self._disable(f"store operation {name} failed: {type(exc).__name__}")
            raise _Unavailable() from None
        if isinstance(result, bytes):
            self.counters["store_bytes"] += len(result)
        elif isinstance(result, list):
            self.counters["store_bytes"] += sum(len(r) for r in result if isinstance(r, bytes))
        return result

    def _peek(self, key: str) -> bytes | None:
        """The value of key, or None when absent, without waiting and without creating it."""
        value = self._op("compare_set", key, _ABSENT, _ABSENT)
        return None if value == _ABSENT.encode() else value

    # ---- queue items ----------------------------------------------------------------------

    def _drain_queue(self) -> None:
        queue = self._queue
        while queue:
            item = queue.popleft()
            try:
                if item[0] == "s":
                    self._announce_start(*item[1:])
                else:
                    self._announce_end(*item[1:])
            except _Unavailable:
                pass
            except Exception:
                self.counters["errors"] += 1

    def _announce_start(self, pending) -> None:
        ident, seq, path, code, line, wall, mono = pending
        own = _Own(seq, path, path_hash(path), int(wall // self.window))
        own.sm = mono
        own.rec = {"node": ident["node"], "pid": ident["pid"], "rank": ident.get("rank"),
                   "local_rank": ident.get("local_rank"), "world_size": ident.get("world_size"),
                   "local_world_size": ident.get("local_world_size"),
                   "node_rank": ident.get("node_rank"), "seq": seq, "path": path,
                   "site": f"{code.co_filename}:{line}" if code is not None else None,
                   "func": code.co_name if code is not None else None,
                   "shared": None, "sw": wall, "ew": None, "ts": None, "te": None,
                   "bytes": None, "outcome": None}
        if len(self._own) >= MAX_WATCHED * 16:
            self.counters["unannounced"] += 1
            return
        self._own[seq] = own
        if self._store is None:
            self.counters["unannounced"] += 1
            return
        own.rec["ts"] = self._op("add", f"{self.prefix}/t", 1)
        own.rec["shared"] = self._shared.shared(path)
        base = f"{self.prefix}/{own.h}/{own.epoch}"
        own.slot = self._op("add", f"{base}/n", 1)
        own.key = f"{base}/{own.slot}"
        self._op("set", own.key, json.dumps(own.rec, separators=(",", ":")))
        self._own_keys.add(own.key)
        self.counters["announced"] += 1

    def _announce_end(self, pending, wall, mono, outcome) -> None:
        seq, path = pending[1], pending[2]
        own = self._own.get(seq)
        if own is None:                       # its start was dropped: nothing to pair with
            self._announce_start(pending)
            own = self._own.get(seq)
            if own is None:
                return
            own.rec["ts"] = None              # taken late: it says nothing about the start
        rec = own.rec
        own.em, own.done = mono, True
        rec["ew"], rec["outcome"] = wall, outcome
        try:
            rec["bytes"] = os.stat(path).st_size
        except OSError:
            pass
        if rec["shared"] is None:
            rec["shared"] = self._shared.shared(path)
        self._check_local_rank_guard(own)
        if self._store is None or own.key is None:
            self._forget_later(own, wall)
            return
        rec["te"] = self._op("add", f"{self.prefix}/t", 1)
        self._op("set", own.key, json.dumps(rec, separators=(",", ":")))
        now = self._clock()
        own.until = now + self.window
        own.delay = POLL_FIRST
        self._read_path(own, now)
        self._schedule(own, now)
        self._forget_later(own, wall)

    def _forget_later(self, own: _Own, end_wall: float) -> None:
        if len(self._deletes) >= MAX_PENDING_DELETES:
            due, _, what = heapq.heappop(self._deletes)
            self._delete_one(due, what)
        self._push_delete(self._clock() + DELETE_AFTER * self.window, own.seq)

    def _push_delete(self, due: float, what) -> None:
        self._delete_order += 1
        heapq.heappush(self._deletes, (due, self._delete_order, what))

    # ---- hazards --------------------------------------------------------------------------

    def _check_local_rank_guard(self, own: _Own) -> None:
        """The `local_rank == 0` bug, from the first save: local rank 0 of a node other than
        the first writes a shared path named after neither its rank nor its node. Needs no
        store: every node's local rank 0 does the same, so they overwrite each other."""
        rec = own.rec
        rank, local_rank = rec.get("rank"), rec.get("local_rank")
        if (rec["shared"] and local_rank == 0 and rank not in (None, 0)
                and not names_rank_or_node(own.path, rank, rec["node"])):
            self._hazard(HAZARD_LOCAL_RANK_GUARD, own, [rank], [rec["node"]])

    def _hazard(self, kind: str, own: _Own, ranks: list, nodes: list) -> None:
        key = (kind, own.path)
        if key in self._hazards_sent or len(self._hazards_sent) >= 4096:
            return
        self._hazards_sent.add(key)
        rec, ident = own.rec, self.ident
        self.counters["hazards"] += 1
        self._emit({"v": SCHEMA_VERSION, "type": "hazard", "kind": kind, "node": rec["node"],
                    "pid": rec["pid"], "seq": own.seq, "path": own.path,
                    "rank": rec["rank"], "local_rank": rec["local_rank"],
                    "world_size": rec["world_size"], "node_rank": rec["node_rank"],
                    "job": ident.get("job"), "master": ident.get("master"),
                    "restart": ident.get("restart"), "site": rec["site"], "func": rec["func"],
                    "shared": rec["shared"], "ranks": sorted(set(ranks))[:64],
                    "nodes": sorted(set(nodes))[:64], "wall": self._wall()})

    # ---- reading other ranks' writes ------------------------------------------------------

    def _schedule(self, own: _Own, now: float) -> None:
        if now >= own.until or len(self._watch) >= MAX_WATCHED:
            return
        delay = POLL_IN_FLIGHT if own.in_flight_seen else own.delay
        own.next_poll = now + delay
        own.delay = min(own.delay * 2, POLL_MAX)
        heapq.heappush(self._watch, (own.next_poll, own.seq))

    def _poll_due(self, now: float, exiting: bool = False) -> bool:
        """Re-read the paths whose poll is due; True if some other write is still in flight."""
        if exiting:
            in_flight = False
            for own in list(self._own.values()):
                if own.done and own.key is not None and self._store is not None:
                    try:
                        self._read_path(own, now, force=True)
                    except _Unavailable:
                        return False
                    in_flight = in_flight or own.in_flight_seen
            return in_flight
        while self._watch and self._watch[0][0] <= now:
            _, seq = heapq.heappop(self._watch)
            own = self._own.get(seq)
            if own is None or own.next_poll > now:
                continue
            try:
                self._read_path(own, now)
            except _Unavailable:
                return False
            self._schedule(own, now)
        return False

    def _read_path(self, own: _Own, now: float, force: bool = False) -> None:
        """Read the slots of our path around our write's epoch that are new since the last
        read (or were in flight then), other than our own; report what is new."""
        base = f"{self.prefix}/{own.h}"
        keys = list(own.in_flight)
        for epoch in (own.epoch - 1, own.epoch, own.epoch + 1):
            raw = self._peek(f"{base}/{epoch}/n")
            count = int(raw) if raw is not None and raw.isdigit() else 0
            first = max(own.read_upto.get(epoch, 0) + 1, count - MAX_SLOTS_READ + 1, 1)
            own.read_upto[epoch] = max(count, own.read_upto.get(epoch, 0))
            for i in range(first, count + 1):
                key = f"{base}/{epoch}/{i}"
                if key not in self._own_keys:
                    keys.append(key)
        if not keys:
            return
        records = self._get_many(keys)
        own.in_flight_seen = False
        own.in_flight = set()
        ranks, nodes = own.ranks, own.nodes
        ranks.add(own.rec["rank"])
        nodes.add(own.rec["node"])
        shared = own.shared = own.shared or own.rec["shared"]
        wall_now = self._wall()
        for key, rec in records:
            if rec.get("path") != own.path:
                continue                                 # a hash collision, or garbage
            ew = rec.get("ew")
            if isinstance(ew, (int, float)) and wall_now - ew > DELETE_AFTER * self.window:
                self._delete_one(0.0, key)               # its writer is gone: clean up
                continue
            if not self._related(own, rec):
                continue
            ranks.add(rec.get("rank"))
            nodes.add(rec.get("node"))
            shared = shared or rec.get("shared")
            if ew is None:
                own.in_flight_seen = True
                own.in_flight.add(key)
                continue
            if rec.get("node") == own.rec["node"]:
                continue            # a local writer: the agent hears it from its own hook
            self._report_remote(own, rec)
        own.shared = shared
        known = {r for r in ranks if type(r) is int}
        if shared and len(known) >= 2:
            self._hazard(HAZARD_SHARED_MULTI_WRITER, own, list(known),
                         [n for n in nodes if isinstance(n, str)])

    def _related(self, own: _Own, rec: dict) -> bool:
        sw, ew = rec.get("sw"), rec.get("ew")
        if not isinstance(sw, (int, float)):
            return False
        end = ew if isinstance(ew, (int, float)) else sw
        mine_start, mine_end = own.rec["sw"], own.rec["ew"] or own.rec["sw"]
        return sw <= mine_end + self.window and end >= mine_start - self.window

    def _get_many(self, keys: list) -> list:
        """[(key, record)] of the keys that exist, each parsed and bounded."""
        if not keys:
            return []
        if self._op("check", keys):
            values = self._op("multi_get", keys)
        else:
            values = [self._peek(k) for k in keys]
        out = []
        for key, value in zip(keys, values):
            if value is None or len(value) > 16384:
                continue
            try:
                rec = json.loads(value)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                out.append((key, rec))
        return out

    def _report_remote(self, own: _Own, rec: dict) -> None:
        rkey = (rec.get("node"), rec.get("pid"), rec.get("seq"))
        if own.reported.get(rkey):
            return
        if not (isinstance(rec.get("ew"), (int, float)) and isinstance(rec.get("sw"), (int, float))
                and type(rec.get("pid")) is int and type(rec.get("seq")) is int
                and isinstance(rec.get("node"), str)):
            return
        mine = {"sw": own.rec["sw"], "sm": own.sm, "ew": own.rec["ew"], "em": own.em,
                "ts": own.rec["ts"], "te": own.rec["te"]}
        start_mono, end_mono, overlap = place_remote(mine, rec)
        own.reported[rkey] = True
        self.counters["remote_reported"] += 1
        ident = self.ident
        writer = {name: rec.get(name) for name in ("node", "pid", "rank", "local_rank",
                                                   "world_size", "local_world_size",
                                                   "node_rank")}
        writer.update(job=ident.get("job"), master=ident.get("master"),
                      restart=ident.get("restart"))
        self._emit({"v": SCHEMA_VERSION, "type": "remote", "node": own.rec["node"],
                    "pid": own.rec["pid"], "seq": own.seq, "path": own.path,
                    "wall": self._wall(), "writer": writer, "wseq": rec["seq"],
                    "start_wall": rec["sw"], "end_wall": rec["ew"], "start_mono": start_mono,
                    "end_mono": end_mono, "bytes": rec.get("bytes"),
                    "outcome": rec.get("outcome") if isinstance(rec.get("outcome"), str)
                    else "ok",
                    "site": rec.get("site"), "func": rec.get("func"), "overlap": overlap,
                    "shared": rec.get("shared")})

    # ---- deletion -------------------------------------------------------------------------

    def _delete_due(self, now: float) -> None:
        while self._deletes and self._deletes[0][0] <= now:
            due, _, what = heapq.heappop(self._deletes)
            self._delete_one(due, what)

    def _delete_one(self, due, what) -> None:
        """Delete our write `what` (a seq: its slot, and its epoch counter if we own it once
        the epoch is three windows old) or a stale key (a str)."""
        if isinstance(what, str):
            try:
                if self._op("delete_key", what):
                    self.counters["deleted"] += 1
            except _Unavailable:
                pass
            return
        own = self._own.get(what)
        if own is None:
            return
        if own.slot == 1 and self._wall() // self.window < own.epoch + 3:
            # The epoch's counter goes with slot 1, once no writer can still pick the epoch.
            self._push_delete(self._clock() + self.window, what)
            return
        self._own.pop(what, None)
        self._own_keys.discard(own.key)
        if own.key is None or self._store is None:
            return
        try:
            if self._op("delete_key", own.key):
                self.counters["deleted"] += 1
            if own.slot == 1 and self._op("delete_key", f"{self.prefix}/{own.h}/{own.epoch}/n"):
                self.counters["deleted"] += 1
        except _Unavailable:
            pass


class _Unavailable(Exception):
    """The store is not (or no longer) usable: job scope is off for this process."""


_instance: JobScope | None = None


def start_if_distributed(ident: dict, environ=None) -> JobScope | None:
    """Start job scope when the environment describes a distributed job and CKPTWATCH_JOBSCOPE
    is not "0"; the running instance if already started; None otherwise."""
    global _instance
    if _instance is not None:
        return _instance
    env = os.environ if environ is None else environ
    if env.get(ENABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if any(not env.get(name) for name in REQUIRED_ENV) or "torch" not in sys.modules:
        return None
    if env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
        return None         # every rank on this node: its agent already sees them all
    try:
        port = int(env.get(STORE_PORT_ENV) or env["MASTER_PORT"])
    except ValueError:
        return None
    host = env.get(STORE_HOST_ENV) or env["MASTER_ADDR"]
    _instance = JobScope(host, port, ident, window=_env_float(env, WINDOW_ENV, WINDOW),
                         connect_budget=_env_float(env, CONNECT_BUDGET_ENV, CONNECT_BUDGET))
    return _instance.start()


def instance() -> JobScope | None:
    return _instance


def _at_exit() -> None:
    scope = _instance
    if scope is not None:
        try:
            scope.close()
        except Exception:
            pass


def _after_fork_in_child() -> None:
    scope = _instance
    if scope is not None:
        scope.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# Registered after the emitter's (this module imports it): atexit runs ours first, so the
# reports made while closing are still flushed to the agent.
atexit.register(_at_exit)
