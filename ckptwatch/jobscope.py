"""Job scope: the ranks of one torch.distributed job tell each other about their saves through
the job's own store, so writes of one path from different nodes are seen by every node's agent,
and every agent that sees them tells the same story.

Loaded into training processes: standard library only. Started by the hook's install() when
the environment describes a distributed job that spans nodes (MASTER_ADDR, MASTER_PORT, RANK
and WORLD_SIZE all set, and LOCAL_WORLD_SIZE, when set, smaller than WORLD_SIZE: a single-node
job has nothing to learn).

What runs where:
- The save path calls started() and ended(). Each builds one APPEND of one line to the path's
  write log (ckptwatch/jobkeys.py) and hands it to the kernel on our store connection without
  waiting (ckptwatch/storewire.py, StoreClient.push: a non-blocking send under a lock taken
  only if free); when that cannot be done at once, the line is queued for the thread, after
  any line queued before it. So a save's start is on its way to the store before its first
  byte, and a process that exits or dies right after its save has still announced it. The
  save path never reads from the store, never waits, never raises.
- One daemon thread owns everything else: the connection (torch's TCPStore wire protocol in
  pure Python, every operation with a deadline, every value bounded as it is read: no C++ call
  that could block past its timeout or abort the process at interpreter shutdown), the queued
  lines, the reads of the logs, the reports to the local agent (through the process's emitter,
  as "remote", "hazard" and "jobscope" events: ckptwatch/events.py), the clean-up.

Reads (each a GET of one path's log, the only reads job scope makes):
- at the end of each of our writes;
- while the group of overlapping writes that holds ours is open (a write in it has not ended):
  after FOLLOW_FIRST, doubling up to FOLLOW_MAX, until it closes (at most a window);
- on a path that does not name our rank or node, or that another rank wrote too (a path some
  other rank may write later: a redundant write we must hear of), after POLL_FIRST, doubling,
  until a window after the latest end of the chain of writes linked to ours (jobkeys.linked;
  at most until clean-up): about log2(window / POLL_FIRST) reads, not one per poll tick;
- on a path that names our rank or node, once more a window after our end (spread over
  READ_SPREAD, at most a quarter window): nobody else is expected to write it, but a rank that
  does within the window is a redundant write (the `model_{local_rank}.pt` bug on shared
  storage) our agent must hear of; a watch from there if that read finds one;
- at exit (below), and once 2 windows after our end, to delete (or compact) the log when every
  write in it is that old.
So a rank makes, per write: 2 APPENDs + 2 GETs + 2 for clean-up, plus at most
1 + ceil(log2(window / POLL_FIRST)) GETs when the path is one others may write, plus the
follow reads while an overlapping write is open. docs/performance.md has the measured figures.

At exit (atexit, before the emitter's own exit flush): the thread sends what is queued, adds 1
to the run's exit count, and -- when it wrote within the last window -- waits until every rank
of the job has done the same (WORLD_SIZE ranks: each has announced all it wrote), then reads
its paths' logs once more and waits for the groups of its writes to close. All of that within
exit_wait (CKPTWATCH_JOBSCOPE_EXIT_WAIT, default EXIT_WAIT) in all: a rank that crashed or
does not run job scope costs the others that wait, once; a store that stalls costs at most
that, and never the exit status.

A process that ends without atexit (os._exit, SIGKILL) reads nothing: its agent reads the store
for its recent writes instead, at the address named in our "jobscope" event
(monitor/agent/storereader.py); a completed exit says "settled" so the agent need not.

Failure: the store is reached within CONNECT_BUDGET (retried with backoff; ranks may start
before it), or job scope is disabled. An operation that fails or passes its deadline, a server
that does not speak the protocol we know, or a value over the read budget disables it too.
Disabling is logged once (a fixed text), counted (stats()) and reported to the agent as a
"jobscope" event; node-scope detection goes on.
"""
from __future__ import annotations

import atexit
import collections
import heapq
import logging
import os
import random
import sys
import threading
import time

from ckptwatch import emitter as _emitter_mod
from ckptwatch import jobhazards
from ckptwatch.events import SCHEMA_VERSION, encode, store_address_valid
from ckptwatch.jobkeys import (LoggedWrite, compacted, end_line, exit_key, group_of,
                               group_open, linked, log_key, parse_log, path_hash,
                               remote_event, run_prefix, start_line, MAX_LOG_BYTES,
                               MAX_SHARED, MAX_NODE, clean_text)
from ckptwatch.sharedfs import SharedPaths, names_rank_or_node
from ckptwatch.storewire import StoreClient, StoreError, append_frame

log = logging.getLogger("ckptwatch.jobscope")

ENABLE_ENV = "CKPTWATCH_JOBSCOPE"            # "0" turns job scope off
STORE_PORT_ENV = "CKPTWATCH_STORE_PORT"      # our client's port (default MASTER_PORT); tests
STORE_HOST_ENV = "CKPTWATCH_STORE_HOST"      # our client's host (default MASTER_ADDR)
WINDOW_ENV = "CKPTWATCH_JOBSCOPE_WINDOW"     # seconds; the collision window (default 60)
CONNECT_BUDGET_ENV = "CKPTWATCH_JOBSCOPE_CONNECT_TIMEOUT"
EXIT_WAIT_ENV = "CKPTWATCH_JOBSCOPE_EXIT_WAIT"
REQUIRED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

WINDOW = 60.0
CONNECT_BUDGET = 60.0       # seconds of retrying before job scope is disabled
CONNECT_TIMEOUT = 2.0       # one connection attempt (TCP, validate, ping)
OP_TIMEOUT = 5.0            # one store operation; longer = a slow store: disabled
EXIT_WAIT = 10.0            # at exit, at most this long for the other ranks and open groups
BACKOFF_MIN, BACKOFF_MAX = 0.1, 2.0
MAX_QUEUE = 4096            # notes (and queued lines) waiting for the thread
MAX_OWN = 4096              # own writes followed at once; beyond, announced but not followed
POLL_FIRST = 0.25           # first re-read of a path others may write, then doubling
FOLLOW_FIRST, FOLLOW_MAX = 0.05, 1.0     # re-reads while a group holding ours is open
CLEAN_AFTER = 2.0           # windows after our end before the log may be deleted
READ_SPREAD = 2.0           # seconds: the end's read of a path no other rank is expected to
                            # write, and its read a window later, are spread over this (a
                            # thousand ranks end a checkpoint together: their reads must not
                            # reach the store as one burst); below the agent's job_settle
                            # (3 s), which keeps a job's redundant chain open for that read;
                            # at most a quarter of the window, so the end's read still comes
                            # early in the window it looks into
COMPACT_BYTES = 16384       # a log longer than this sheds its stale head when cleaned
READ_BUDGET = 8 << 20       # bytes one read may pull and throw away (an oversized value)
EXIT_COUNT_LIMIT = 32       # bytes of the exit count's value we read

STATE_CONNECTING, STATE_ACTIVE, STATE_DISABLED = "connecting", "active", "disabled"


def _env_float(environ, name: str, default: float) -> float:
    try:
        value = float(environ[name])
    except (KeyError, ValueError):
        return default
    return value if value > 0 else default


class _Own:
    """One of our writes, followed until its log is cleaned up."""

    __slots__ = ("seq", "path", "key", "ident", "site", "func", "sw", "sm", "ew", "em",
                 "shared", "done",
                 "reported", "watched", "next_read", "poll_at", "follow", "until",
                 "clean_at", "ranks", "nodes", "shared_seen", "judged_guard", "looked_late")

    def __init__(self, pending, key: str):
        ident, self.seq, self.path, code, line, self.sw, self.sm = pending
        self.ident, self.key = ident, key
        self.site = f"{code.co_filename}:{line}" if code is not None else None
        self.func = code.co_name if code is not None else None
        self.ew = self.em = self.shared = None
        self.done = False
        self.reported: set = set()     # (node, pid, seq) of other writes reported
        self.watched = not names_rank_or_node(self.path, ident.get("rank"), ident.get("node"))
        self.next_read = None
        self.poll_at = POLL_FIRST       # next watch read, seconds after our end
        self.follow = FOLLOW_FIRST
        self.until = 0.0                # mono: watching ends
        self.clean_at = 0.0
        self.ranks: set = set()
        self.nodes: set = set()
        self.shared_seen = None         # why some writer of the path sees it shared
        self.judged_guard = False
        self.looked_late = False        # the unwatched write's read a window after its end


class JobScope:
    """See the module docstring. One per process; started by start_if_distributed()."""

    def __init__(self, host: str, port: int, ident: dict, *, window: float = WINDOW,
                 connect_budget: float = CONNECT_BUDGET, op_timeout: float = OP_TIMEOUT,
                 exit_wait: float = EXIT_WAIT, emit=None, shared: SharedPaths | None = None,
                 clock=time.monotonic, wall=time.time):
        self.host, self.port = host, int(port)
        self.ident = dict(ident)
        self.window = float(window)
        self._spread = min(READ_SPREAD, self.window / 4)
        self.prefix = run_prefix(ident)
        self._connect_budget, self._op_timeout = connect_budget, op_timeout
        self._exit_wait = exit_wait
        self._emit_fn = emit
        self._shared = shared or SharedPaths()
        self._clock, self._wall = clock, wall
        self._client = StoreClient(host, port, op_timeout=op_timeout, clock=clock)
        self._frames: collections.deque = collections.deque()   # lines not yet sent, in order
        self._notes: collections.deque = collections.deque()    # what the thread must know
        self._keys: dict = {}                                   # path -> its log key
        self._wake = threading.Event()
        self._idle = True
        self._stopping = False
        self._exiting = False
        self._forked = False
        self._thread: threading.Thread | None = None
        self.state = STATE_CONNECTING
        self.reason: str | None = None
        self._started_at = clock()
        self._next_connect = 0.0
        self._backoff = BACKOFF_MIN
        self._last_connect_error = "no attempt yet"
        self._own: dict[int, _Own] = {}          # seq -> our write, until its log is cleaned
        self._due: list = []                     # heap (mono, order, seq)
        self._order = 0
        self._hazards = jobhazards.Reported()
        self.exit_waited = None                  # seconds the exit waited (stats)
        self.counters = {"announced": 0, "queued": 0, "dropped": 0, "remote_reported": 0,
                         "hazards": 0, "reads": 0, "oversized": 0, "unlogged": 0,
                         "errors": 0, "deleted": 0, "compacted": 0, "unfollowed": 0}

    # ---- caller side (the save path): never waits, never raises ---------------------------

    def started(self, pending, writer=None) -> None:
        """pending: the hook's (ident, seq, path, code, line, wall, mono); writer: the
        library that writes (ckptwatch/writers; None: torch.save)."""
        try:
            if self._forked or self._stopping:
                return
            if len(self._notes) >= MAX_QUEUE:
                self.counters["dropped"] += 1
                return
            ident, seq, path, code, line, wall, _ = pending
            if self.state != STATE_DISABLED:
                self._announce(append_frame(self._key(path),
                                            start_line(ident, seq, code, line, wall,
                                                       writer)))
            self._notes.append(("s", pending))
            if self._frames and self._idle:
                # Only a queued line needs the thread now; the start's note waits for the
                # end's wake-up (a thousand ranks starting a checkpoint together do not wake
                # a thousand threads for nothing).
                self._wake.set()
        except Exception:
            self.counters["errors"] += 1

    def ended(self, pending, wall: float, mono: float, outcome: str, size=None) -> None:
        try:
            if self._forked or self._stopping:
                return
            if len(self._notes) >= MAX_QUEUE:
                self.counters["dropped"] += 1
                return
            ident, seq, path = pending[0], pending[1], pending[2]
            shared = self._shared.shared(path)
            if self.state != STATE_DISABLED:
                self._announce(append_frame(self._key(path), end_line(
                    ident, seq, wall, size if type(size) is int else None, outcome, shared)))
            self._notes.append(("e", pending, wall, mono, outcome, shared))
            if self._idle:
                self._wake.set()
        except Exception:
            self.counters["errors"] += 1

    def _key(self, path: str) -> str:
        key = self._keys.get(path)
        if key is None:
            if len(self._keys) >= MAX_OWN:
                self._keys.clear()
            key = self._keys[path] = log_key(self.prefix, path_hash(path))
        return key

    def _announce(self, data: bytes) -> None:
        # Straight to the kernel when nothing is queued before it (order: a write's end never
        # overtakes its start), else after what is queued.
        if not self._frames and self._client.push(data):
            self.counters["announced"] += 1
            return
        if len(self._frames) >= MAX_QUEUE:
            self.counters["dropped"] += 1
            return
        self._frames.append(data)
        self.counters["queued"] += 1

    # ---- control --------------------------------------------------------------------------

    def start(self) -> "JobScope":
        thread = threading.Thread(target=self._run, name="ckptwatch-jobscope", daemon=True)
        self._thread = thread
        thread.start()
        return self

    def stats(self) -> dict:
        return dict(self.counters, state=self.state, queued_now=len(self._frames),
                    own=len(self._own), store_ops=self._client.ops,
                    store_bytes=self._client.bytes_out + self._client.bytes_in,
                    exit_waited=self.exit_waited)

    def close(self, timeout: float | None = None) -> None:
        """At exit: send what is queued, count ourselves out, and wait (bounded: exit_wait)
        for the other ranks' announcements and the ends of writes overlapping ours."""
        thread = self._thread
        if thread is None or self._forked or self._stopping:
            return
        if self.state == STATE_CONNECTING:
            self._disable(f"never reached the store at {self.host}:{self.port}")
        if self.state != STATE_ACTIVE:
            self._stopping = True
            self._wake.set()
            return
        self._exiting = True
        self._wake.set()
        thread.join(self._exit_wait + 1.0 if timeout is None else timeout)
        self._stopping = True
        self._wake.set()

    def after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) must not share our store connection or thread.
        self._forked = True
        self._client = StoreClient(self.host, self.port)
        self._frames = collections.deque()
        self._notes = collections.deque()

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                if self.state == STATE_CONNECTING:
                    self._try_connect()
                if self.state == STATE_ACTIVE:
                    self._send_queued(self._clock() + self._op_timeout)
                self._drain_notes()
                if self._exiting:
                    self._exit()
                    break
                self._reads_due(self._clock())
                self._sleep(self._clock())
            except StoreError as exc:
                self._disable(f"store operation failed: {exc.reason}")
            except Exception:
                self.counters["errors"] += 1
                time.sleep(BACKOFF_MIN)

    def _sleep(self, now: float) -> None:
        due = now + 1.0
        if self._due:
            due = min(due, self._due[0][0])
        if self.state == STATE_CONNECTING:
            due = min(due, self._next_connect)
        self._idle = True
        self._wake.clear()
        if not self._notes and not self._frames and not self._stopping \
                and not self._exiting:
            self._wake.wait(max(0.0, due - now))
        self._idle = False

    # ---- connection -----------------------------------------------------------------------

    def _try_connect(self) -> None:
        now = self._clock()
        if now < self._next_connect:
            return
        if now - self._started_at > self._connect_budget:
            self._disable(f"store {self.host}:{self.port} unreachable for "
                          f"{self._connect_budget:.0f}s ({self._last_connect_error})")
            return
        try:
            self._client.connect(min(CONNECT_TIMEOUT, self._op_timeout))
        except StoreError as exc:
            self._last_connect_error = exc.reason
            if exc.permanent:
                self._disable(f"store {self.host}:{self.port}: {exc.reason}")
                return
            self._next_connect = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return
        # The announcement goes out before the state turns active: a save made once we are
        # active may be followed at once by os._exit, and the agent must already know where
        # to read for this process's writes when it sees the connection hang up.
        self._send_state(state=STATE_ACTIVE)
        self.state = STATE_ACTIVE

    def _disable(self, reason: str) -> None:
        if self.state == STATE_DISABLED:
            return
        self.state, self.reason = STATE_DISABLED, reason
        self._client.close()
        self._frames.clear()
        self._due.clear()
        log.warning("ckptwatch: job scope disabled in pid %d: %s (node-scope detection goes "
                    "on)", os.getpid(), reason)
        self._send_state()

    def _send_state(self, settled: bool = False, state: str | None = None) -> None:
        ident = self.ident
        state = state or self.state
        event = {"v": SCHEMA_VERSION, "type": "jobscope", "node": ident["node"],
                 "pid": os.getpid(), "state": state, "reason": self.reason,
                 "rank": ident.get("rank"), "job": ident.get("job"),
                 "master": ident.get("master"), "restart": ident.get("restart"),
                 "wall": self._wall()}
        if state == STATE_ACTIVE and store_address_valid(self.host, self.port):
            # Where the agent reads for our writes should we die without reading them
            # (monitor/agent/storereader.py); an address it would refuse is not sent.
            event["store_host"], event["store_port"] = self.host, self.port
        if settled:
            event["settled"] = True
        self._emit(event)

    def _emit(self, event: dict) -> None:
        # Written to the agent's socket now, as a save's frame is (emitter.record), not left
        # in the sender's queue: a process that exits right after its save through os._exit
        # would take a queued announcement with it, and the agent, not knowing this process
        # used job scope, would not read the store for its writes when it hangs up.
        try:
            if self._emit_fn is not None:
                self._emit_fn(event)
            else:
                _emitter_mod.get_emitter().record(encode(event))
        except Exception:
            self.counters["errors"] += 1

    def _send_queued(self, deadline: float) -> None:
        frames = self._frames
        while frames:
            self._client.send(frames[0], deadline)
            frames.popleft()
            self.counters["announced"] += 1

    # ---- notes from the save path ---------------------------------------------------------

    def _drain_notes(self) -> None:
        notes = self._notes
        while notes:
            item = notes.popleft()
            try:
                if item[0] == "s":
                    self._note_start(item[1])
                else:
                    self._note_end(*item[1:])
            except StoreError:
                raise
            except Exception:
                self.counters["errors"] += 1

    def _note_start(self, pending) -> None:
        if len(self._own) >= MAX_OWN:
            self.counters["unfollowed"] += 1
            return
        self._own[pending[1]] = _Own(pending, self._key(pending[2]))

    def _note_end(self, pending, wall, mono, outcome, shared) -> None:
        own = self._own.get(pending[1])
        if own is None:
            return
        own.ew, own.em, own.done, own.shared = wall, mono, True, shared
        own.until = mono + self.window
        own.clean_at = mono + CLEAN_AFTER * self.window + 1.0 \
            + random.uniform(0.0, 0.25 * self.window)
        if self.state == STATE_ACTIVE:
            now = self._clock()
            self._schedule(own, now if own.watched else now + random.uniform(0.0, self._spread))
        else:
            # No store (yet, or any more): the one rule that needs none, on our write alone.
            self._judge_guard(own, self._logged_self(own), [])
            self._schedule(own, None)

    # ---- reads ----------------------------------------------------------------------------

    def _schedule(self, own: _Own, when) -> None:
        if when is None:
            when = own.clean_at if self.state == STATE_ACTIVE else None
        if when is None:
            self._own.pop(own.seq, None)
            return
        own.next_read = when
        self._order += 1
        heapq.heappush(self._due, (when, self._order, own.seq))

    def _reads_due(self, now: float) -> None:
        while self._due and self._due[0][0] <= now and self.state == STATE_ACTIVE:
            when, _, seq = heapq.heappop(self._due)
            own = self._own.get(seq)
            if own is None or own.next_read != when:
                continue
            if now >= own.clean_at:
                self._clean(own)
                continue
            self._schedule(own, self._next_read(own, self._read(own), now))

    def _next_read(self, own: _Own, group_is_open: bool, now: float):
        """When to read our write's log again: soon while its group is open, on the watch
        schedule while a later write could still be a redundant one, else at clean-up."""
        if group_is_open and now < own.until:
            when = now + own.follow
            own.follow = min(own.follow * 2, FOLLOW_MAX)
            return when
        if own.watched and own.em is not None and now < own.until:
            while own.em + own.poll_at <= now:
                own.poll_at *= 2
            return min(own.em + own.poll_at, own.until)
        if not own.watched and not own.looked_late and own.em is not None:
            # A path that names our rank or node: no one else is expected to write it, but
            # if someone does within a window after us, that is a redundant write our agent
            # must hear of (the agent keeps such a chain open a job settle past the window).
            # One more read then, spread like the end's, instead of a watch.
            own.looked_late = True
            return max(now, own.em + self.window) + random.uniform(0.0, self._spread)
        return own.clean_at

    def _logged_self(self, own: _Own) -> LoggedWrite:
        ident = own.ident
        mine = LoggedWrite({"n": ident.get("node"), "p": ident.get("pid"), "q": own.seq,
                            "r": ident.get("rank"), "l": ident.get("local_rank"),
                            "w": own.sw}, None)
        mine.ew = own.ew
        return mine

    def _read(self, own: _Own) -> bool:
        """Read our write's log, report what is new; True while the group holding our write
        is open (a write in it has not ended)."""
        value = self._client.get(own.key, MAX_LOG_BYTES, READ_BUDGET)
        self.counters["reads"] += 1
        if value is None:
            self.counters["oversized"] += 1      # not ours to read: someone filled it
            own.watched = False
            own.until = 0.0
            return False
        writes = parse_log(value)
        ident = own.ident
        mine_key = (clean_text(ident.get("node"), MAX_NODE), ident.get("pid"), own.seq)
        mine = next((w for w in writes if w.key == mine_key), None)
        if mine is None or mine.te is None:
            # Our lines are not in the log (dropped, or cleaned by a rank that took the log
            # for stale): judge on the walls.
            self.counters["unlogged"] += 1
            mine = self._logged_self(own)
            others = [w for w in writes if w.key != mine_key]
            group_is_open = False
        else:
            others = [w for w in writes if w is not mine]
            group_is_open = group_open(group_of(writes, mine))
        self._learn(own, mine, linked(others, mine, self.window))
        return group_is_open

    def _learn(self, own: _Own, mine: LoggedWrite, others: list) -> None:
        ident = own.ident
        if others:
            own.watched = True           # others write this path: later ones matter too
        own.ranks.add(ident.get("rank"))
        own.nodes.add(ident.get("node"))
        node = ident.get("node")
        for w in others:
            own.ranks.add(w.rank)
            own.nodes.add(w.node)
            if own.shared_seen is None and w.shared:
                own.shared_seen = clean_text(f"{w.node}: {w.shared}", MAX_SHARED)
            # A chain goes on while its writes keep coming within a window of each other:
            # watch until a window after the latest end heard of, or after now while one is
            # in flight (at most until clean-up, CLEAN_AFTER windows after our end).
            own.until = max(own.until, self.window + (
                own.sm + (w.ew - own.sw) if w.te is not None else self._clock()))
            if w.te is None or w.node == node or w.key in own.reported:
                continue                 # in flight, or local (its own hook tells the agent)
            own.reported.add(w.key)
            self.counters["remote_reported"] += 1
            self._emit(remote_event(ident, own.seq, own.path, own.sm, own.em, mine, w,
                                    self._wall()))
        if self._exiting or self._clock() >= own.em + POLL_FIRST or not own.watched:
            # Judged once the ranks saving at about the same time have announced theirs
            # (a watch read later than the end's), so "every rank writes" is told apart.
            self._judge_guard(own, mine, others)
        shared = own.shared or own.shared_seen
        writers = jobhazards.shared_multi_writer(shared, own.ranks)
        if writers is not None:
            self._hazard(jobhazards.HAZARD_SHARED_MULTI_WRITER, own, shared, writers,
                         [n for n in own.nodes if isinstance(n, str)])

    def _judge_guard(self, own: _Own, mine: LoggedWrite, others: list) -> None:
        if own.judged_guard:
            return
        own.judged_guard = True
        shared = own.shared or own.shared_seen
        if jobhazards.local_rank_guard(mine, own.path, shared, others):
            self._hazard(jobhazards.HAZARD_LOCAL_RANK_GUARD, own, shared,
                         [own.ident.get("rank")], [own.ident.get("node")])

    def _hazard(self, kind: str, own: _Own, shared: str, ranks: list, nodes: list) -> None:
        if not self._hazards.first(kind, own.path):
            return
        self.counters["hazards"] += 1
        self._emit(jobhazards.hazard_event(kind, own.ident, own.seq, own.path, own.site,
                                           own.func, shared, ranks, nodes, self._wall()))

    # ---- clean-up -------------------------------------------------------------------------

    def _clean(self, own: _Own) -> None:
        """Delete the log when every write in it is old (CLEAN_AFTER windows), or drop its
        stale head when it is long; then forget our write."""
        self._own.pop(own.seq, None)
        value = self._client.get(own.key, MAX_LOG_BYTES, READ_BUDGET)
        if not value:
            return
        old = self._wall() - CLEAN_AFTER * self.window
        # When each write was last heard of: its end, or its start while in flight.
        heard = {w.key: (w.ew if w.ew is not None else w.sw) for w in parse_log(value)}

        def stale(key) -> bool:
            # A line that is not a write's (garbage) is stale too: compaction keeps the
            # positions of what it keeps, so every reader still numbers them alike.
            try:
                return heard.get(key, -1.0) < old
            except TypeError:           # an unhashable field: not ours
                return True

        new = compacted(value, stale)
        if new == b"":
            # Racy by one round trip: an APPEND landing between our GET and DELETE is lost
            # (its writer then judges on the walls: "unlogged").
            if self._client.delete_key(own.key):
                self.counters["deleted"] += 1
        elif new is not None and len(value) > COMPACT_BYTES:
            self._client.compare_set(own.key, value, new, 64, READ_BUDGET)
            self.counters["compacted"] += 1

    # ---- exit -----------------------------------------------------------------------------

    def _everyone_out(self, deadline: float) -> bool:
        """Has every rank of the job (WORLD_SIZE) counted itself out? True too when the count
        is not ours to read (garbage: nothing to wait for) or the world size is unknown."""
        world = self.ident.get("world_size")
        if type(world) is not int:
            return True
        value = self._client.get(exit_key(self.prefix), EXIT_COUNT_LIMIT, READ_BUDGET, deadline)
        return value is None or not value.isdigit() or int(value) >= world

    def _exit(self) -> None:
        """Count ourselves out; if we wrote within the last window, wait (bounded) until every
        rank has, then read our paths once more and wait for our groups to close."""
        started = self._clock()
        deadline = started + self._exit_wait
        if self.state != STATE_ACTIVE:
            return
        self._send_queued(deadline)
        self._client.add(exit_key(self.prefix), 1, deadline)
        recent = [own for own in self._own.values()
                  if own.done and self._clock() <= own.until]
        if not recent:
            self._send_state(settled=True)      # nothing of ours a later write could join
            return
        # Read (and report) at once, then again while a group of ours is open or a rank has
        # not counted itself out: what is known reaches the agent while it still holds our
        # write, and what comes later is added as it comes.
        delay = FOLLOW_FIRST
        while True:
            still_open = False
            for own in recent:
                still_open = self._read(own) or still_open
            if self._clock() >= deadline:
                break
            if not still_open and self._everyone_out(deadline):
                # Every rank is out and our groups are closed: nothing more can join them.
                # The agent is told, so it does not read the store for us once we are gone.
                self._send_state(settled=True)
                break
            time.sleep(min(delay, max(0.0, deadline - self._clock())))
            delay = min(delay * 2, FOLLOW_MAX)
        self.exit_waited = self._clock() - started


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
                         connect_budget=_env_float(env, CONNECT_BUDGET_ENV, CONNECT_BUDGET),
                         exit_wait=_env_float(env, EXIT_WAIT_ENV, EXIT_WAIT))
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
