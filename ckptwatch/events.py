"""The event wire format between the in-process hook and the agent.

This file is the contract. It is loaded into training processes, so it imports only the
standard library. Every field is described below; the version field lets old agents reject
events they cannot understand instead of misreading them, and golden fixtures in
tests/fixtures/events/ keep old events decoding.

Transport: a Unix *stream* socket (one connection per process). A datagram socket would queue
only net.unix.max_dgram_qlen (default 10) messages, so eight ranks saving at once would lose
events; a stream socket applies back-pressure to the sender's background thread instead.

Framing: every event is one frame = 4-byte big-endian unsigned length + UTF-8 JSON object.
Frames larger than MAX_FRAME_BYTES are rejected (the connection cannot be resynchronised after
a bad length, so the agent closes it).

Event object (schema version 1). Fields marked (start, end) appear in both kinds.

  v            int   schema version, SCHEMA_VERSION
  type         str   "start" (a save began), "end" (a save finished, ok or not),
                     "dropped" (the sender dropped events because its queue was full),
                     "hello" (the first frame of a connection, see below)
  node         str   node name: CKPTWATCH_NODE, else the host name
  pid          int   the writing process's pid (checked against the socket's peer credentials)
  --- start / end only ---
  seq          int   per-process write number; pairs a start with its end
  rank         int|null        global rank (RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK, torch.distributed)
  local_rank   int|null        rank on this node (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK)
  world_size   int|null        WORLD_SIZE, SLURM_NTASKS, OMPI_COMM_WORLD_SIZE, torch.distributed
  local_world_size int|null    LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE
  node_rank    int|null        GROUP_RANK, SLURM_NODEID, OMPI_COMM_WORLD_NODE_RANK
  job          str|null        CKPTWATCH_JOB, else TORCHELASTIC_RUN_ID, else SLURM_JOB_ID
  master       str|null        "MASTER_ADDR:MASTER_PORT" when known; tells two jobs apart when
                               torchrun's static rendezvous sets TORCHELASTIC_RUN_ID=none for all
  restart      int|null        TORCHELASTIC_RESTART_COUNT (SLURM_RESTART_COUNT)
  path         str   absolute, normalised path being written
  site         str   "file:line" of the first caller frame outside torch and ckptwatch
  func         str   that frame's function name
  writer       str|null  (optional; added within version 1) the library that wrote:
                     "torch.save" (also when absent: hooks before this field reported
                     torch.save only, and the torch.save hook omits it), "safetensors", "dcp"
                     (torch.distributed.checkpoint), "fsspec". The agent keeps the value only
                     if it is one of WRITER_KINDS and reads any other string as "other"
                     (monitor.detect): a newer hook's writer is not a reason to lose its write.
  wall         float time.time() when this event happened (seconds since the epoch)
  mono         float time.monotonic() when this event happened (CLOCK_MONOTONIC is node-wide
                     on Linux, so the agent can order events of different processes exactly)
                     (the hook writes wall to the microsecond and mono to the nanosecond, a
                     start's and its end's copy of the start times as the same text)
  --- end only ---
  start_wall   float time.time() when the save began (the end event stands alone if its start
  start_mono   float  was dropped or refused, and an agent treats a lone end as start + end:
                      hooks of an earlier release sent no start for a save that ended within
                      their sending delay; this one sends every save's start before its first
                      byte, ckptwatch/emitter.py)
  bytes        int|null  file size after the save (null if it could not be read)
  outcome      str   "ok", or the exception's type name (e.g. "OSError") if the save raised
  --- dropped only ---
  count        int   events dropped since the last "dropped" event (>= 1)
  --- hello only (added within version 1; an agent that predates it rejects it, once per
      connection, as "incomplete") ---
  ack          bool|null  send "ack" frames on this connection (below)
  notices      bool|null  this process reads notices on this connection (the warn policy)

Job scope (ckptwatch/jobscope.py) adds three types, sent by the hook's job-scope thread about
the sending process (node and pid are the sender's, checked like any other event's pid).
Added within version 1: start/end/dropped are unchanged, and an agent that predates them
rejects only these (as "incomplete") and counts them.

  "remote": a write of the same path by a process of the same job run ON ANOTHER NODE, as
  learned from the job's store. It describes someone else: nothing in it can be checked by
  the agent, which labels what it concludes from it scope="job" and attributes it to the
  reporting process (node, pid).
  seq          int   the sender's own write (of `path`) this report is about
  path         str   absolute path, the same path the sender wrote
  wall         float when the sender learnt it
  writer       obj   the remote writer: node str (not the sender's node), pid int, and the
                     optional rank, local_rank, world_size, local_world_size, node_rank (int|null),
                     job, master (str|null), restart (int|null)
  wseq         int   the remote writer's own seq of that write
  start_wall, end_wall   float   the remote write's interval, the remote node's wall clock
  start_mono, end_mono   float   the same interval in the SENDER's CLOCK_MONOTONIC, placed so
                     that its overlap with the sender's write agrees with the store's order
  bytes        int|null; outcome str; site, func str|null   as in "end"
  overlap      bool|null  the store's verdict (null: walls decided)
  shared       str|null   why the remote node sees the path as shared storage
  writer_kind  str   (optional; absent: torch.save) the library the remote writer used, as
                     "writer" of "start" (named apart: "writer" here is who); job scope
                     sends a WRITER_KINDS name or "other", never what a log line said
                     (ckptwatch.jobkeys.writer_kind); the agent bounds it the same way

  "hazard": a save that will collide sooner or later, reported even though nothing collided.
  kind         str   "local_rank_guard" | "shared_storage_multi_writer"
  seq, path    the sender's own write
  rank, local_rank, world_size, node_rank, job, master, restart, site, func   as in "start"
  shared       str   why the path is shared ("CKPTWATCH_SHARED_PATHS", "mount:nfs4", ...)
  ranks        [int]  global ranks known to write the path (<= 64)
  nodes        [str]  their nodes (<= 64)
  wall         float

  "jobscope": the sender's job-scope state changed.
  state        str   "active" (connected to the job's store) | "disabled"
  reason       str|null   why disabled
  rank, job, master, restart   as in "start"; wall float
  store_host   str|null   (optional, added within version 1; with "active") the job's store
                     this process reads: an IP literal or a host name (letters, digits, "-",
                     "_", dots; at most MAX_STORE_HOST characters). The agent reads that store
                     itself for this process's recent writes once the process is gone without
                     having read them (monitor/agent/storereader.py); an agent that predates
                     the field ignores it
  store_port   int|null   with store_host: its TCP port, 1-65535
  settled      bool|null  (optional, added within version 1) true: this process has counted
                     itself out and read and reported everything its writes need (sent at the
                     end of its exit), so the agent need not read the store for it
  An event whose store_host or store_port is not of that form, or names one without the
  other, is rejected whole ("incomplete").

Optional fields may be absent; unknown extra fields are ignored (forward compatible within a
version). A writer is identified by (node, pid).

  notices      true  (start, optional) this process reads notices on its connection (the
                     warn policy); an agent sends none to a connection that never said so

Agent -> hook, on the same connection: acknowledgements and notices, the only bytes an agent
ever sends. Same framing, payload at most MAX_NOTICE_BYTES; decode_agent_frame() reads both.

Acknowledgement, sent to a connection whose hello asked for it, at most every few tens of ms:
  v            int   NOTICE_VERSION
  type         str   "ack"
  n            int   frames of this connection (every complete frame, the hello, rejected and
                     refused ones included) the agent has taken in: handed on to its loop,
                     not merely read off the socket. Cumulative; never decreases.
The hook keeps the frames it wrote until they are acknowledged and sends them again on its next
connection when the agent ends this one (ckptwatch/emitter.py).

Notices: Sent when the agent reports a collision, a redundant
write or a hazard involving a writer whose connection is still open and asked for notices; the
agent never waits for a slow reader (a notice that does not fit the socket buffer is dropped).
The hook must survive anything here: decode_notice() returns None for whatever is not a valid
notice, and a frame over the limit ends notice reading on that connection.

  v            int   NOTICE_VERSION (a notice of another version is ignored)
  type         str   "notice"
  kind         str   "concurrent" | "redundant" | "hazard" (others may come: shown as given)
  path         str   the checkpoint path concerned (at most MAX_NOTICE_TEXT characters)
  site         str|null  the recipient's own call site "file:line" for this path
  others       list  at most MAX_NOTICE_OTHERS writers, each {"rank": int|null,
                     "pid": int|null, "node": str|null, "site": str|null}
  id           str|null  the collision's id in the agent's journal

Queries (the resume guard, ckptwatch/resumeguard.py): a process about to load a checkpoint
asks, on a short connection of its own, what the agent knows about the file. Added within
version 1; an agent that predates it rejects the frame as "incomplete" and never answers (the
guard waits a few ms at most).
  v, type "query", node, pid   as in every event (pid checked like any other)
  path         str   absolute path of the file (or DCP directory) to be loaded
  alias        str|null  its real path (symbolic links resolved) when that differs
  qid          int   the query's id, repeated in the answer
The answer, the only frame sent on that connection: a FileVerdict (ckptwatch/verdicts.py:
every field, the identity it is about, and the bounds the guard checks) with
  type "verdict", qid int, v VERDICT version; at most ckptwatch.verdicts.MAX_BYTES.
The agent answers a query only with what the asking process's own user wrote; anything else
is answered "unknown" (docs/security.md).
"""
from __future__ import annotations

import ipaddress
import json
import re
import struct
from math import isfinite

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
HEADER = struct.Struct(">I")


NOTICE_VERSION = 1
MAX_NOTICE_BYTES = 4096
MAX_NOTICE_OTHERS = 16
MAX_NOTICE_TEXT = 1024

# Reasons an event is rejected; the agent exports them as ckptwatch_events_rejected_total{reason}.
REJECT_MALFORMED = "malformed"          # not UTF-8 JSON, or not a JSON object
REJECT_OVERSIZED = "oversized"          # frame length above MAX_FRAME_BYTES
REJECT_UNKNOWN_VERSION = "unknown_version"
REJECT_INCOMPLETE = "incomplete"        # required field missing or of the wrong type
REJECT_TRUNCATED = "truncated"          # connection closed in the middle of a frame
REJECT_PID_MISMATCH = "pid_mismatch"    # event pid is not the connected process's pid
REJECT_RATE_LIMITED = "rate_limited"    # job-scope events above a connection's rate
# The writer kinds (the start/end field "writer"), and what the agent calls any other value.
WRITER_TORCH_SAVE = "torch.save"
WRITER_SAFETENSORS = "safetensors"
WRITER_DCP = "dcp"
WRITER_FSSPEC = "fsspec"
WRITER_OTHER = "other"
WRITER_KINDS = (WRITER_TORCH_SAVE, WRITER_SAFETENSORS, WRITER_DCP, WRITER_FSSPEC)

REJECT_REASONS = (REJECT_MALFORMED, REJECT_OVERSIZED, REJECT_UNKNOWN_VERSION,
                  REJECT_INCOMPLETE, REJECT_TRUNCATED, REJECT_PID_MISMATCH,
                  REJECT_RATE_LIMITED)

# Job-scope event types (see the module docstring) and what they may say.
JOB_SCOPE_TYPES = frozenset({"remote", "hazard", "jobscope"})
HAZARD_KINDS = ("local_rank_guard", "shared_storage_multi_writer")
JOBSCOPE_STATES = ("active", "disabled")
MAX_LIST = 64                           # ranks / nodes listed in a hazard
MAX_TEXT = 4096                         # any string field of a job-scope event
MAX_STORE_HOST = 253                    # a DNS name's longest text form
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})"
                        r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?\Z")


class EventError(ValueError):
    """An input that is not a valid event; .reason is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.payloads: list[bytes] = []   # FrameReader: complete frames before the bad one


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def encode(event: dict) -> bytes:
    """One frame for one event. Raises ValueError if the event is too large to send."""
    return frame(_ENCODER.encode(event).encode("utf-8"))


def frame(payload: bytes) -> bytes:
    """The frame for one event's JSON payload. Raises ValueError if it is too large to send."""
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"event of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload)) + payload


def hello_frame(node: str, pid: int, notices: bool = False) -> bytes:
    """The frame that opens a hook's connection: asks for acknowledgements (and notices)."""
    hello = {"v": SCHEMA_VERSION, "type": "hello", "node": node, "pid": pid, "ack": True}
    if notices:
        hello["notices"] = True
    return encode(hello)


def ack_frame(count: int) -> bytes:
    """The agent's acknowledgement of the first `count` frames of a connection."""
    return frame(b'{"v":%d,"type":"ack","n":%d}' % (NOTICE_VERSION, count))


# For senders that splice an event's JSON text from pre-encoded parts (the hook's sender thread
# does, for every save): json_str is the very escaping encode() applies to strings (ASCII
# output, so the text encodes to the same bytes), json_members the members of a flat object
# without its braces, ready to splice between two others.
json_str = json.encoder.encode_basestring_ascii


def json_members(fields: dict) -> str:
    """'"a":1,"b":null' for {"a": 1, "b": None}: the object's text without its braces."""
    return _ENCODER.encode(fields)[1:-1]


# Allowed value types per field. Checked with `type(value) in allowed`, which is exact (a bool
# is not accepted where an int is expected: a boolean pid or rank is a bug, not a number) and is
# what keeps validation cheap at 50k events/s.
_INT = frozenset({int})
_NUM = frozenset({int, float})
_STR = frozenset({str})
_OPT_INT = frozenset({int, type(None)})
_OPT_STR = frozenset({str, type(None)})

# What names a writer, with each field's types: node and pid (required in every event)
# identify it, the others describe it (optional). WRITER_FIELDS is their one order: of a
# start/end event's identity, of a "remote" event's writer, of the agent's
# monitor.detect.model.Writer.
_WRITER_TYPES = {"node": _STR, "pid": _INT, "rank": _OPT_INT, "local_rank": _OPT_INT,
                 "world_size": _OPT_INT, "local_world_size": _OPT_INT, "node_rank": _OPT_INT,
                 "job": _OPT_STR, "master": _OPT_STR, "restart": _OPT_INT}
WRITER_FIELDS = tuple(_WRITER_TYPES)
_WRITER_ID = tuple(_WRITER_TYPES.items())[:2]
_WRITER_OPTIONAL = tuple(_WRITER_TYPES.items())[2:]

_COMMON = (("v", _INT), ("type", _STR)) + _WRITER_ID
_WRITE = (("seq", _INT), ("path", _STR), ("wall", _NUM), ("mono", _NUM))
_WRITE_OPTIONAL = _WRITER_OPTIONAL + (("site", _OPT_STR), ("func", _OPT_STR),
                                       ("writer", _OPT_STR))
_END = (("start_wall", _NUM), ("start_mono", _NUM), ("outcome", _STR))
_END_OPTIONAL = (("bytes", _OPT_INT),)
_DROPPED = (("count", _INT),)
_HELLO_OPTIONAL = (("ack", frozenset({bool, type(None)})),
                   ("notices", frozenset({bool, type(None)})))
_QUERY = (("path", _STR), ("qid", _INT))
_QUERY_OPTIONAL = (("alias", _OPT_STR),)
_MISSING = object()


def _check(event: dict, fields: tuple, required: bool) -> None:
    get = event.get
    for name, allowed in fields:
        value = get(name, _MISSING)
        if value is _MISSING:
            if required:
                raise EventError(REJECT_INCOMPLETE, f"missing field {name!r}")
        elif type(value) not in allowed:
            raise EventError(REJECT_INCOMPLETE, f"field {name!r} has type {type(value).__name__}")


# The same rules as the tables above, grouped by type for _is_valid_write.
_FAST_OPT_INT = tuple(name for name, allowed in _WRITE_OPTIONAL if allowed is _OPT_INT)
_FAST_OPT_STR = tuple(name for name, allowed in _WRITE_OPTIONAL if allowed is _OPT_STR)
_FAST_NUM = tuple(name for name, allowed in _WRITE if allowed is _NUM)
_FAST_END_NUM = tuple(name for name, allowed in _END if allowed is _NUM)


_WRITE_TIMES = {"start": _FAST_NUM, "end": _FAST_NUM + _FAST_END_NUM}


def _is_valid_write(e: dict) -> bool:
    """One-pass check of a start/end event: the agent's hot path (50k events/s).

    True means valid; False means "look closer": validate() then runs the field-by-field
    checks, which find the reason. Must accept exactly what those checks accept. The field
    groups are checked with map() over dict.get, so the loops run in C, not in bytecode;
    an absent optional field reads as None, which every optional type allows.
    """
    get = e.get
    if not (type(get("node")) is str and type(get("pid")) is int
            and type(get("seq")) is int and type(get("path")) is str
            and set(map(type, map(get, _FAST_NUM))) <= _NUM
            and set(map(type, map(get, _FAST_OPT_INT))) <= _OPT_INT
            and set(map(type, map(get, _FAST_OPT_STR))) <= _OPT_STR):
        return False
    kind = e["type"]
    if kind == "end":
        if not (set(map(type, map(get, _FAST_END_NUM))) <= _NUM
                and type(get("outcome")) is str and type(get("bytes")) in _OPT_INT):
            return False
    elif kind != "start":
        return False
    return write_values_valid(e)


def write_values_valid(e: dict) -> bool:
    """The rules on a start or end event's values beyond its fields' types (which the caller
    has checked): this schema version, a positive pid, an absolute path, finite times (json
    reads NaN and Infinity, which would break every comparison the detector orders writes
    by). The agent's memoised validation (monitor.ingest.codec) applies exactly these to an
    event whose shape validate() accepted before. The times are named one by one
    (_WRITE_TIMES): a map over them took twice as long, on every event."""
    return (e["v"] == SCHEMA_VERSION and e["pid"] > 0 and e["path"][:1] == "/"
            and isfinite(e["wall"]) and isfinite(e["mono"])
            and (e["type"] == "start" or (isfinite(e["start_wall"])
                                          and isfinite(e["start_mono"]))))


def validate(event: object) -> dict:
    """Return the event if it is a valid version-1 event, else raise EventError."""
    if (type(event) is dict and type(event.get("v")) is int and event["v"] == SCHEMA_VERSION
            and type(event.get("type")) is str and _is_valid_write(event)):
        return event
    if type(event) is not dict:
        raise EventError(REJECT_MALFORMED, "not a JSON object")
    version = event.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        if version is None:
            raise EventError(REJECT_INCOMPLETE, "missing field 'v'")
        if type(version) is not int and version == SCHEMA_VERSION:  # 1.0 or true: wrong type
            raise EventError(REJECT_INCOMPLETE, f"field 'v' has type {type(version).__name__}")
        raise EventError(REJECT_UNKNOWN_VERSION, f"version {version!r}")
    _check(event, _COMMON, required=True)
    kind = event["type"]
    if event["pid"] <= 0:
        raise EventError(REJECT_INCOMPLETE, "pid must be positive")
    if kind == "dropped":
        _check(event, _DROPPED, required=True)
        if event["count"] < 1:
            raise EventError(REJECT_INCOMPLETE, "count must be positive")
        return event
    if kind in JOB_SCOPE_TYPES:
        return _validate_job_scope(event, kind)
    if kind == "hello":
        _check(event, _HELLO_OPTIONAL, required=False)
        return event
    if kind == "query":
        _check(event, _QUERY, required=True)
        _check(event, _QUERY_OPTIONAL, required=False)
        _bounded_text(event, ("node", "path", "alias"))
        if event["path"][:1] != "/":
            raise EventError(REJECT_INCOMPLETE, "path must be absolute")
        return event
    if kind != "start" and kind != "end":
        raise EventError(REJECT_INCOMPLETE, f"unknown type {kind!r}")
    _check(event, _WRITE, required=True)
    _check(event, _WRITE_OPTIONAL, required=False)
    if event["path"][:1] != "/":
        raise EventError(REJECT_INCOMPLETE, "path must be absolute")
    if kind == "end":
        _check(event, _END, required=True)
        _check(event, _END_OPTIONAL, required=False)
    for name in _WRITE_TIMES[kind]:                 # finite: see write_values_valid
        if not isfinite(event[name]):
            raise EventError(REJECT_INCOMPLETE, f"field {name!r} is not a finite number")
    return event


_BOOL_OPT = frozenset({bool, type(None)})
_REMOTE = (("seq", _INT), ("path", _STR), ("wall", _NUM), ("wseq", _INT),
           ("start_wall", _NUM), ("end_wall", _NUM), ("start_mono", _NUM), ("end_mono", _NUM),
           ("outcome", _STR))
_REMOTE_OPTIONAL = (("bytes", _OPT_INT), ("site", _OPT_STR), ("func", _OPT_STR),
                    ("overlap", _BOOL_OPT), ("shared", _OPT_STR), ("writer_kind", _OPT_STR))
_REMOTE_WRITER = _WRITER_ID
_REMOTE_WRITER_OPTIONAL = _WRITER_OPTIONAL
_HAZARD = (("kind", _STR), ("seq", _INT), ("path", _STR), ("shared", _STR), ("wall", _NUM))
_HAZARD_OPTIONAL = _WRITE_OPTIONAL
_JOBSCOPE = (("state", _STR), ("wall", _NUM))
_JOBSCOPE_OPTIONAL = (("reason", _OPT_STR), ("rank", _OPT_INT), ("job", _OPT_STR),
                      ("master", _OPT_STR), ("restart", _OPT_INT), ("store_host", _OPT_STR),
                      ("store_port", _OPT_INT), ("settled", _BOOL_OPT))


def store_address_valid(host, port) -> bool:
    """Is (host, port) a store address the agent may connect to: host an IP literal or a
    host name (labels of letters, digits, "-" and "_" of at most 63 characters, at most
    MAX_STORE_HOST in all), port an int in 1-65535? Nothing else is ever connected to."""
    if type(host) is not str or type(port) is not int or not 1 <= port <= 65535:
        return False
    if not host or len(host) > MAX_STORE_HOST or not host.isascii():
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return _HOST_NAME.match(host) is not None


def _bounded_text(event: dict, names) -> None:
    for name in names:
        value = event.get(name)
        if type(value) is str and len(value) > MAX_TEXT:
            raise EventError(REJECT_INCOMPLETE, f"field {name!r} longer than {MAX_TEXT}")


def _validate_job_scope(event: dict, kind: str) -> dict:
    """remote / hazard / jobscope: every field typed, every string and list bounded."""
    if kind == "jobscope":
        _check(event, _JOBSCOPE, required=True)
        _check(event, _JOBSCOPE_OPTIONAL, required=False)
        if event["state"] not in JOBSCOPE_STATES:
            raise EventError(REJECT_INCOMPLETE, f"unknown job-scope state {event['state']!r}")
        host, port = event.get("store_host"), event.get("store_port")
        if (host is not None or port is not None) and not store_address_valid(host, port):
            raise EventError(REJECT_INCOMPLETE, "store_host/store_port is not an address")
        _bounded_text(event, ("node", "reason", "job", "master"))
        return event
    if kind == "hazard":
        _check(event, _HAZARD, required=True)
        _check(event, _HAZARD_OPTIONAL, required=False)
        if event["kind"] not in HAZARD_KINDS:
            raise EventError(REJECT_INCOMPLETE, f"unknown hazard kind {event['kind']!r}")
        for name, item_type in (("ranks", int), ("nodes", str)):
            items = event.get(name, [])
            if (type(items) is not list or len(items) > MAX_LIST
                    or any(type(i) is not item_type for i in items)):
                raise EventError(REJECT_INCOMPLETE, f"field {name!r} must be a list of at most "
                                 f"{MAX_LIST} {item_type.__name__}")
            if item_type is str and any(len(i) > MAX_TEXT for i in items):
                raise EventError(REJECT_INCOMPLETE, f"an item of {name!r} is too long")
        _bounded_text(event, ("node", "path", "shared", "job", "master", "site", "func"))
    else:
        _check(event, _REMOTE, required=True)
        _check(event, _REMOTE_OPTIONAL, required=False)
        writer = event.get("writer")
        if type(writer) is not dict or len(writer) > 32:
            raise EventError(REJECT_INCOMPLETE, "field 'writer' must be an object")
        _check(writer, _REMOTE_WRITER, required=True)
        _check(writer, _REMOTE_WRITER_OPTIONAL, required=False)
        if writer["pid"] <= 0:
            raise EventError(REJECT_INCOMPLETE, "writer pid must be positive")
        if writer["node"] == event["node"]:
            raise EventError(REJECT_INCOMPLETE, "a remote writer is on another node")
        if not all(map(isfinite, (event["start_wall"], event["end_wall"],
                                        event["start_mono"], event["end_mono"]))):
            raise EventError(REJECT_INCOMPLETE, "remote times must be finite")
        if not event["start_mono"] <= event["end_mono"]:
            raise EventError(REJECT_INCOMPLETE, "remote interval ends before it starts")
        _bounded_text(event, ("node", "path", "outcome", "site", "func", "shared",
                              "writer_kind"))
        _bounded_text(writer, ("node", "job", "master"))
    if event["path"][:1] != "/":
        raise EventError(REJECT_INCOMPLETE, "path must be absolute")
    return event


def decode(payload: bytes) -> dict:
    """Decode and validate one frame's payload (without the length header)."""
    if len(payload) > MAX_FRAME_BYTES:
        raise EventError(REJECT_OVERSIZED, f"{len(payload)} bytes")
    try:
        event = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: one 64 KiB frame of "[[[[..." nests deeper than json parses.
        raise EventError(REJECT_MALFORMED, str(exc)[:80]) from None
    return validate(event)


def decode_many(payloads: list) -> list:
    """decode() for a list of payloads: a dict or an EventError per payload, in order.

    Each payload is parsed on its own (never joined with its neighbours: two broken payloads
    could join into two valid ones), with the JSON scanner called directly, which skips
    json.loads' per-call checks. A payload that is not one bare JSON value from its first
    byte to its last goes through decode(), which finds the reason.
    """
    raw_decode = _DECODER.raw_decode
    out = []
    for payload in payloads:
        try:
            if len(payload) <= MAX_FRAME_BYTES:
                text = payload.decode("utf-8")
                value, end = raw_decode(text)
                if end == len(text):
                    out.append(validate(value))
                    continue
        except EventError as exc:
            out.append(exc)
            continue
        except (UnicodeDecodeError, ValueError, RecursionError):
            pass
        out.append(_attempt(decode, payload))
    return out


_DECODER = json.JSONDecoder()


def _attempt(check, item):
    try:
        return check(item)
    except EventError as exc:
        return exc


class FrameReader:
    """Splits a byte stream into frame payloads. Pure: feed bytes, get payloads.

    feed() returns the complete payloads seen so far and raises EventError(oversized) on a
    length above the limit, after which the stream cannot be trusted and must be closed. The
    payloads completed before the bad header in the same chunk are attached to that exception
    as .payloads, so valid events sent before the bad frame are not lost.
    pending() tells whether a partial frame is buffered (a close then means "truncated").
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES):
        # Immutable bytes, not a bytearray: each payload is then one slice (one copy), and
        # what is left over is at most one partial frame, copied once per feed.
        self._buf = b""
        self._max = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else bytes(data)
        out = []
        pos, size, unpack = 0, HEADER.size, HEADER.unpack_from
        while len(buf) - pos >= size:
            (length,) = unpack(buf, pos)
            if length > self._max:
                self._buf = buf[pos:]
                exc = EventError(REJECT_OVERSIZED, f"frame length {length}")
                exc.payloads = out
                raise exc
            end = pos + size + length
            if end > len(buf):
                break
            out.append(buf[pos + size:end])
            pos = end
        self._buf = buf[pos:]
        return out

    def pending(self) -> bool:
        return bool(self._buf)


def _short_text(value) -> bool:
    return type(value) is str and len(value) <= MAX_NOTICE_TEXT


def _opt_text(value) -> bool:
    return value is None or _short_text(value)


def _opt_int(value) -> bool:
    return value is None or type(value) is int


def decode_agent_frame(payload: bytes) -> tuple:
    """What the agent sent in one frame: ("ack", n), ("notice", notice as decode_notice
    returns it), or (None, None) for anything else. Never raises."""
    try:
        if len(payload) > MAX_NOTICE_BYTES:
            return None, None
        value = json.loads(payload.decode("utf-8"))
        if type(value) is dict and value.get("type") == "ack":
            n = value.get("n")
            if value.get("v") == NOTICE_VERSION and type(value.get("v")) is int \
                    and type(n) is int and 0 <= n < 2 ** 62:
                return "ack", n
            return None, None
        notice = _notice(value)
        return ("notice", notice) if notice is not None else (None, None)
    except Exception:       # RecursionError, MemoryError on a hostile frame, ...
        return None, None


def decode_notice(payload: bytes) -> dict | None:
    """A valid notice (see module doc) from one frame's payload, else None. Never raises."""
    try:
        if len(payload) > MAX_NOTICE_BYTES:
            return None
        return _notice(json.loads(payload.decode("utf-8")))
    except Exception:       # RecursionError, MemoryError on a hostile frame, ...
        return None


def _notice(notice) -> dict | None:
    try:
        if not (type(notice) is dict and notice.get("v") == NOTICE_VERSION
                and type(notice.get("v")) is int and notice.get("type") == "notice"
                and _short_text(notice.get("kind")) and _short_text(notice.get("path"))
                and _opt_text(notice.get("site")) and _opt_text(notice.get("id"))):
            return None
        others = notice.get("others", [])
        if type(others) is not list or len(others) > MAX_NOTICE_OTHERS:
            return None
        for other in others:
            if not (type(other) is dict and _opt_int(other.get("rank"))
                    and _opt_int(other.get("pid")) and _opt_text(other.get("node"))
                    and _opt_text(other.get("site"))):
                return None
        return {"kind": notice["kind"], "path": notice["path"], "site": notice.get("site"),
                "id": notice.get("id"),
                "others": [{k: o.get(k) for k in ("rank", "pid", "node", "site")}
                           for o in others]}
    except Exception:       # RecursionError, MemoryError on a hostile frame, ...
        return None
