"""The agent reads a job's store itself for the writes of a local process that can no longer
read it (docs/decisions.md, "The agent reads the store for the dead").

Job scope (ckptwatch/jobscope.py) lives in the training process: its thread reads the path's
write log after each save and tells this agent about the other nodes' writes ("remote"
events). A process that ends without atexit right after a save (os._exit, SIGKILL, a crash)
announced its write in the log but reads nothing, so without this module its node's agent never
learns of the other nodes' writes of that path; and a write it had in flight when it died has
a start line and never an end line, so every other rank's reader waits on it as open.

What runs where:
- Handover, on the agent loop's thread (no I/O): remembers, per local process whose job scope
  told us where its store is (the "jobscope" event's store_host / store_port, validated by
  ckptwatch.events), its recent writes from its own start / end events. When that process
  hangs up and is gone (ingest's hang-up; /proc says it is exiting, a zombie or absent) without
  having said it settled (the "jobscope" event's settled: it read everything at exit), each of
  its writes that ended within CLEAN_AFTER windows -- as long as its own job scope could still
  have been reading for it, a chain going on -- or was in flight (lost at the hang-up) is
  handed to the reader as a Follow.
- StoreReader, one daemon thread: reads each Follow's log on the schedule the process's own job
  scope would have kept (at once, then every FOLLOW_FIRST doubling while the group holding the
  write is open, then POLL_FIRST doubling until a window after the latest end of its chain, at
  most CLEAN_AFTER windows after its own end), and puts "remote" events -- built by
  ckptwatch.jobkeys exactly as the process would have built them, so every agent holds the same
  writes, the same id and the same writer set -- on `results` for the loop to take. When the
  log holds the dead write's start and not its end, the reader appends the end line the
  process could not send (its end as the agent knows it: its end event, or "lost" at the
  hang-up), once: the other nodes' readers then see the write end where this agent ends it.

Bounds (the agent is root and every input here is a stranger's): at most MAX_PROCS processes
and MAX_WRITES_PER_PROC writes each remembered, MAX_FOLLOWS writes followed, MAX_STORES store
connections held (the least recently used one closed beyond), every connection made only with
TCPStore's handshake (ckptwatch.storewire), every operation under OP_TIMEOUT, every value read
bounded by the log's caps (ckptwatch.jobkeys.MAX_LOG_BYTES; READ_BUDGET thrown away at most),
keys only under our prefix, a store that fails left alone for STORE_BACKOFF (a write is
tried again after it, until its horizon). Name resolution of
a host name is the resolver's (its own timeouts); it runs on the reader's thread, never the
loop's. docs/security.md says what a hostile sender can make the agent do.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import operator
import queue
import threading
import time
from collections import OrderedDict

from ckptwatch.events import EventError, store_address_valid, validate
from ckptwatch.jobkeys import (LoggedWrite, MAX_LOG_BYTES, MAX_NODE, clean_text, end_line,
                               group_of, group_open, linked, log_key, parse_log, path_hash,
                               remote_event, run_prefix)
from ckptwatch.storewire import StoreClient, StoreError

log = logging.getLogger("ckptwatch.agent")

MAX_PROCS = 4096            # local processes whose store address is remembered
MAX_WRITES_PER_PROC = 64    # recent writes remembered per process (the oldest forgotten)
# Processes whose writes came before their "jobscope" event: the hook queues that event for its
# sender thread, so a save can reach the socket first (and the process can die right after).
# Their writes wait here for the announcement; most such processes never announce (no job
# scope), hence a cap of its own, so they cannot push announced processes out.
MAX_UNANNOUNCED = 1024
MAX_FOLLOWS = 4096          # writes followed at once; beyond, counted and not followed
MAX_STORES = 16             # store connections held at once
OP_TIMEOUT = 5.0            # one store operation (connect + handshake included), as job scope's
STORE_BACKOFF = 1.0         # a store that failed is not tried again for this long
READ_BUDGET = 1 << 20       # bytes of an oversized value read and thrown away at most
FOLLOW_FIRST, FOLLOW_MAX = 0.05, 1.0     # as job scope's (ckptwatch/jobscope.py)
POLL_FIRST = 0.25
CLEAN_AFTER = 2.0           # windows after the write's end: following stops

# A write Handover remembers: [start wall, start mono, path, end wall, end mono, outcome,
# bytes, node, ident]; the end's slots are None until its end comes; node is the node its
# process claimed (None until it announced), ident the values of _IDENT_FIELDS after "node".
_W_END_WALL, _W_END_MONO, _W_OUTCOME, _W_SIZE, _W_NODE = 3, 4, 5, 6, 7
_IDENT_FIELDS = ("node", "pid", "rank", "local_rank", "job", "master", "restart")
_ident_of = operator.itemgetter(*_IDENT_FIELDS[1:])

PF_EXITING = 0x4            # include/linux/sched.h: the task is in do_exit()


def process_gone(pid: int, proc: str = "/proc") -> bool:
    """Is process `pid` exiting, a zombie or gone? The kernel closes a process's sockets while
    it exits, so a hang-up of a dying process comes while it is still in /proc (exiting, then a
    zombie until reaped); a live process that merely closed a connection is neither."""
    try:
        with open(f"{proc}/{int(pid)}/stat", "rb") as f:
            stat = f.read(4096)
    except (OSError, ValueError):
        return True
    try:
        fields = stat[stat.rindex(b")") + 2:].split()
        state, flags = fields[0], int(fields[6])
    except (ValueError, IndexError):
        return True
    return state in (b"Z", b"X", b"x") or bool(flags & PF_EXITING)


class Follow:
    """One write of a gone process, followed in its path's log on the reader's thread."""

    __slots__ = ("store", "key", "ident", "seq", "path", "sw", "sm", "ew", "em", "outcome",
                 "size", "mine_key", "reported", "until", "stop_at", "step", "poll_at",
                 "next_read", "repaired")

    def __init__(self, store: tuple, ident: dict, seq: int, path: str, sw: float, sm: float,
                 ew: float, em: float, outcome: str, size, window: float):
        self.store, self.ident, self.seq, self.path = store, ident, seq, path
        self.key = log_key(run_prefix(ident), path_hash(path))
        self.sw, self.sm, self.ew, self.em = sw, sm, ew, em
        self.outcome, self.size = outcome, size
        self.mine_key = (clean_text(ident.get("node"), MAX_NODE), ident.get("pid"), seq)
        self.reported: set = set()
        self.until = em + window
        self.stop_at = em + CLEAN_AFTER * window
        self.step = FOLLOW_FIRST
        self.poll_at = POLL_FIRST
        self.next_read = 0.0
        self.repaired = False

    def mine(self) -> LoggedWrite:
        """The write as this agent knows it (no positions: judged on the walls)."""
        ident = self.ident
        w = LoggedWrite({"n": ident.get("node"), "p": ident.get("pid"), "q": self.seq,
                         "r": ident.get("rank"), "l": ident.get("local_rank"),
                         "w": self.sw}, None)
        w.ew = self.ew
        return w


class Handover:
    """The loop's side (see the module doc): which gone process's writes to follow."""

    def __init__(self, reader: "StoreReader | None", window: float,
                 gone=process_gone, clock=time.monotonic):
        self._reader = reader
        self._window = float(window)
        self._gone, self._clock = gone, clock
        # pid -> {"store": (host, port), "node": claimed node, "writes": OrderedDict}
        self._procs: OrderedDict[int, dict] = OrderedDict()
        # pid -> writes (as in _procs) of a process not announced yet (MAX_UNANNOUNCED)
        self._unannounced: OrderedDict[int, OrderedDict] = OrderedDict()
        self.handed_over = 0        # writes handed to the reader
        self.settled = 0            # processes that said they need nothing of us

    def announced(self, event: dict, claimed_node) -> None:
        """A "jobscope" event (validated): remember or forget where its sender's store is."""
        if self._reader is None:
            return
        pid = event["pid"]
        early = self._unannounced.pop(pid, None)
        if event.get("settled") is True:
            self.settled += 1
            self._procs.pop(pid, None)
            return
        host, port = event.get("store_host"), event.get("store_port")
        if event["state"] != "active" or not store_address_valid(host, port) \
                or type(claimed_node) is not str:
            self._procs.pop(pid, None)
            return
        proc = self._procs.get(pid)
        if proc is None:
            proc = self._procs[pid] = {"writes": early if early is not None else OrderedDict()}
            for w in proc["writes"].values():
                w[_W_NODE] = claimed_node
            while len(self._procs) > MAX_PROCS:
                self._procs.popitem(last=False)
        self._procs.move_to_end(pid)
        proc["store"], proc["node"] = (host, port), claimed_node

    def wrote(self, event: dict) -> None:
        """A validated start or end event of a local process (its node already ours)."""
        if self._reader is None:
            return
        kind = event.get("type")
        if kind != "start" and kind != "end":
            return
        pid = event["pid"]
        proc = self._procs.get(pid)
        if proc is None:
            # Not announced (yet): kept for its "jobscope" event (MAX_UNANNOUNCED).
            writes = self._unannounced.get(pid)
            if writes is None:
                writes = self._unannounced[pid] = OrderedDict()
                while len(self._unannounced) > MAX_UNANNOUNCED:
                    self._unannounced.popitem(last=False)
            node = None
        else:
            writes, node = proc["writes"], proc["node"]
        seq = event["seq"]
        w = writes.get(seq)
        if w is None:
            # One list per write (_W_* slots), not two dicts: this runs for every start and
            # end the agent takes, and building the dicts cost 1.7-3 us per event (issue 22,
            # py-spy: 7 % of the agent under path reuse). The ident dict a Follow needs is
            # built at the hand-over, for the few writes handed over.
            try:
                ident = _ident_of(event)        # one C call when every field is there
            except KeyError:
                ident = tuple(map(event.get, _IDENT_FIELDS[1:]))
            if kind == "start":
                sw, sm = event["wall"], event["mono"]
            else:
                sw, sm = event["start_wall"], event["start_mono"]
            w = writes[seq] = [sw, sm, event["path"], None, None, None, None, node, ident]
            while len(writes) > MAX_WRITES_PER_PROC:
                writes.popitem(last=False)
        if kind == "end":
            w[_W_END_WALL] = event["wall"]
            w[_W_END_MONO] = event["mono"]
            w[_W_OUTCOME] = event["outcome"]
            w[_W_SIZE] = event.get("bytes")

    def hung_up(self, pid: int, mono: float, wall: float) -> int:
        """The process's connection was closed by its side: if it is gone, hand its recent
        writes to the reader. Returns how many were handed over."""
        self._unannounced.pop(pid, None)    # never announced: nothing to read for it
        proc = self._procs.get(pid)
        if proc is None or not self._gone(pid):
            return 0
        del self._procs[pid]
        handed = 0
        for seq, w in proc["writes"].items():
            sw, sm, path, ew, em, outcome, size, node, ident = w
            if em is None:              # in flight when it died: lost at the hang-up
                ew, em, outcome, size = max(wall, sw), max(mono, sm), "lost", None
            if mono > em + CLEAN_AFTER * self._window:
                # Its own job scope would no longer read for it. (Within a window of its end it
                # would; up to clean-up, if a chain went on: one read here tells which.)
                continue
            follow = Follow(proc["store"], dict(zip(_IDENT_FIELDS, (node, *ident))), seq, path,
                            sw, sm, ew, em, outcome, size, self._window)
            if self._reader.submit(follow):
                handed += 1
        self.handed_over += handed
        if handed:
            log.info("process gone without reading its job's store: the agent reads it",
                     extra={"fields": {"pid": pid, "writes": handed}})
        return handed


class StoreReader:
    """The reader's thread (see the module doc). start() / stop(); submit() and `results`
    are its two ends, both safe from any thread and neither waits."""

    def __init__(self, node: str, window: float, clock=time.monotonic, wall=time.time,
                 op_timeout: float = OP_TIMEOUT):
        self._node = node
        self._window = float(window)
        self._clock, self._wall = clock, wall
        self._op_timeout = op_timeout
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()    # "remote" events
        self._due: list = []
        self._order = itertools.count()
        # Follows submitted (the loop's count) and finished (the reader's): each is written
        # by one thread only, so their difference is what is followed now.
        self._submitted = 0
        self._finished = 0
        self._stores: OrderedDict[tuple, StoreClient] = OrderedDict()
        self._failed: dict[tuple, float] = {}        # store -> retry not before (mono)
        self._warned: OrderedDict[tuple, None] = OrderedDict()   # stores logged as failed
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counters = {"reads": 0, "errors": 0, "reported": 0, "ended": 0,
                         "refused": 0, "oversized": 0}

    def start(self) -> "StoreReader":
        self._thread = threading.Thread(target=self._run, name="ckptwatch-storereader",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for client in self._stores.values():
            client.close()
        self._stores.clear()

    @property
    def following(self) -> int:
        return self._submitted - self._finished

    def submit(self, follow: Follow) -> bool:
        if self.following >= MAX_FOLLOWS:
            self.counters["refused"] += 1
            return False
        self._submitted += 1
        self._inbox.put(follow)
        self._wake.set()
        return True

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            while True:
                try:
                    follow = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._schedule(follow, self._clock())
            now = self._clock()
            while self._due and self._due[0][0] <= now and not self._stopping:
                _, _, follow = heapq.heappop(self._due)
                try:
                    self._turn(follow)
                except Exception:
                    self.counters["errors"] += 1
                    log.exception("store reader failed on a write of %r", follow.path)
                    self._finished += 1
                now = self._clock()
            wait = 1.0 if not self._due else max(0.0, self._due[0][0] - now)
            self._wake.wait(min(wait, 1.0))
            self._wake.clear()

    def _schedule(self, follow: Follow, when: float) -> None:
        follow.next_read = when
        heapq.heappush(self._due, (when, next(self._order), follow))

    def _turn(self, follow: Follow) -> None:
        is_open = self._read(follow)
        now = self._clock()
        if is_open is None:
            # The store could not be read (a timeout under load, a restart): tried again once
            # its back-off has passed, until the write's horizon.
            retry = max(self._failed.get(follow.store, now), now + FOLLOW_FIRST)
            if retry >= follow.stop_at:
                self._finished += 1
            else:
                self._schedule(follow, retry)
            return
        nxt = self._next_read(follow, is_open, now)
        if nxt is None:
            self._finished += 1
            return
        self._schedule(follow, nxt)

    def _next_read(self, follow: Follow, is_open: bool, now: float):
        """As job scope's _next_read, for a path that is always watched."""
        if now >= follow.stop_at:
            return None
        if is_open:
            when = now + follow.step
            follow.step = min(follow.step * 2, FOLLOW_MAX)
            return min(when, follow.stop_at)
        if now >= follow.until:
            return None
        while follow.em + follow.poll_at <= now:
            follow.poll_at *= 2
        return min(follow.em + follow.poll_at, follow.until)

    def _client(self, store: tuple) -> StoreClient | None:
        client = self._stores.get(store)
        if client is not None and client.connected:
            self._stores.move_to_end(store)
            return client
        if self._clock() < self._failed.get(store, 0.0):
            return None
        client = StoreClient(store[0], store[1], op_timeout=self._op_timeout,
                             clock=self._clock)
        try:
            client.connect(self._op_timeout)
        except StoreError as exc:
            self._failure(store, exc)
            return None
        self._stores[store] = client
        while len(self._stores) > MAX_STORES:
            _, oldest = self._stores.popitem(last=False)
            oldest.close()
        return client

    def _failure(self, store: tuple, exc: StoreError) -> None:
        self.counters["errors"] += 1
        client = self._stores.pop(store, None)
        if client is not None:
            client.close()
        if store not in self._warned:       # once per store: a dead one is retried often
            self._warned[store] = None
            if len(self._warned) > 4 * MAX_STORES:
                self._warned.popitem(last=False)
            log.warning("store reader: job store unusable (retried every %.0fs while a write "
                        "needs it)", STORE_BACKOFF, extra={"fields": {
                            "store": f"{store[0][:253]}:{store[1]}", "reason": exc.reason}})
        self._failed[store] = self._clock() + STORE_BACKOFF
        if len(self._failed) > 4 * MAX_STORES:
            now = self._clock()
            self._failed = {k: v for k, v in self._failed.items() if v > now}

    def _read(self, follow: Follow):
        """Read the write's log and report what is new; True while the group holding the
        write is open, None when the store could not be read."""
        client = self._client(follow.store)
        if client is None:
            return None
        try:
            value = client.get(follow.key, MAX_LOG_BYTES, READ_BUDGET)
            self.counters["reads"] += 1
            if value is None:
                self.counters["oversized"] += 1     # not ours to read: someone filled it
                follow.until = follow.stop_at = 0.0
                return False
            writes = parse_log(value)
            logged = next((w for w in writes if w.key == follow.mine_key), None)
            if logged is not None and logged.te is None and not follow.repaired:
                # Its end line never reached the log (the process died before it could
                # send it): end it where this agent ends it, for every other reader.
                follow.repaired = True
                client.append(follow.key, end_line(follow.ident, follow.seq, follow.ew,
                                                   follow.size, follow.outcome, None))
                self.counters["ended"] += 1
        except StoreError as exc:
            self._failure(follow.store, exc)
            return None
        if logged is None or logged.te is None:
            mine = follow.mine()
            others = [w for w in writes if w.key != follow.mine_key]
            is_open = False
        else:
            mine = logged
            others = [w for w in writes if w is not logged]
            is_open = group_open(group_of(writes, logged))
        self._learn(follow, mine, linked(others, mine, self._window))
        return is_open

    def _learn(self, follow: Follow, mine: LoggedWrite, others: list) -> None:
        node = follow.mine_key[0]
        for w in others:
            # As job scope: a window after the chain's latest end, or after now while a write
            # of it is in flight.
            follow.until = max(follow.until, self._window + (
                follow.sm + (w.ew - follow.sw) if w.te is not None else self._clock()))
            if w.te is None or w.node == node or w.key in follow.reported:
                continue
            follow.reported.add(w.key)
            event = remote_event(follow.ident, follow.seq, follow.path, follow.sm,
                                 follow.em, mine, w, self._wall())
            event["node"] = self._node       # the agent's name for the reporter's node
            try:
                validate(event)
            except EventError:
                self.counters["errors"] += 1
                continue
            self.counters["reported"] += 1
            self.results.put(event)
