"""Job scope's store layout, write log and overlap rules: what the ranks of one job write to its
store, how a rank reads the others' writes back, and how it places them in its own time base
(the "remote" event). Pure: no store, no thread, no clock (ckptwatch/jobscope.py is the thread
that uses them).

Loaded into training processes: standard library only.

Keys (all under our prefix, never the job's): PREFIX = "/ckptwatch/2/<run>" with run = a hash of
(job id, MASTER_ADDR:MASTER_PORT when the job id is "none" or unknown, restart count), so an
elastic restart is a new run and two static-rendezvous jobs never share keys. (The leading "/"
is the one torch's own TCPStore client puts before every key, so the job's tools see ours as
they see theirs.)
  PREFIX/p/<h>    the write log of the path whose hash is h: every write of the path by any
                  rank appends one start line and one end line (APPEND: no reply, no counter)
  PREFIX/x        how many ranks have announced everything they wrote and are exiting (ADD)

The write log is the store's own order of the path's starts and ends: APPENDs to one key are
applied one after another, so every rank that reads the log reads the same lines in the same
order. Two writes overlap when each started before the other ended in that order -- a rule
every reader applies to the same data, so every node's agent reaches the same verdict and the
same group of writers. A line reaches the store one network trip after the save's start or end
(the hook hands it to the kernel before the save's first byte: ckptwatch/jobscope.py), so an
overlap or a gap shorter than that trip may be ordered either way: the ordering tolerance
(docs/decisions.md, "Job scope v2").

Line format: "\\n" + a JSON object + "\\n" (the empty lines around it keep a stray partial line
someone else appended from running into ours). The first non-empty line may be a base line
{"k":"b","n":N} left by compaction: positions then start at N, so a compacted log keeps the
positions its lines had. Every value read from a log is typed, bounded and escaped here before
anything else sees it: the job's store is input we do not control.
"""
from __future__ import annotations

import hashlib
import json
import math

from ckptwatch.events import SCHEMA_VERSION, WRITER_KINDS, WRITER_OTHER
from ckptwatch.jobrun import job_run

EPS = 1e-6
LAYOUT_VERSION = 2
MAX_LOG_BYTES = 256 * 1024      # a longer log is not read (counted: "oversized")
MAX_LINE_BYTES = 4096           # a longer line is not a record of ours
MAX_WRITES = 2048               # writes parsed from one log
MAX_NODE, MAX_SITE, MAX_FUNC, MAX_OUTCOME, MAX_SHARED = 256, 1024, 256, 64, 256
MAX_INT = 1 << 62

INF = float("inf")


def run_prefix(ident: dict) -> str:
    """/ckptwatch/2/<16 hex>: the store keys of one job run (ckptwatch.jobrun.job_run). Job
    scope starts only with MASTER_ADDR:MASTER_PORT set, so its run always has a name."""
    run = job_run(ident.get("job"), ident.get("master"), ident.get("restart"))
    text = "\0".join(map(str, run)) if run is not None else ""
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"/ckptwatch/{LAYOUT_VERSION}/{digest}"


def path_hash(path: str) -> str:
    return hashlib.sha1(path.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def log_key(prefix: str, h: str) -> str:
    return f"{prefix}/p/{h}"


def exit_key(prefix: str) -> str:
    return f"{prefix}/x"


# ---- lines ------------------------------------------------------------------------------

def _line(obj: dict) -> bytes:
    return b"\n" + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode(
        "ascii") + b"\n"


# The save path hands every start and end line to the store (ckptwatch/jobscope.py), so they
# are formatted in one step from cached parts instead of json.dumps of a dict (~17 µs a line
# measured, issue 22): the identity's members once per identity dict (identity() returns a new
# dict when the identity changes; a dict is never changed in place), the site's once per call
# site. The text parses to the same values as json.dumps of the dict in the same key order
# (tests/unit/test_jobscope.py checks it); the wall is written "%.6f", which a JSON reader
# reads as float(f"{wall:.6f}"), the microsecond value the hook's events carry.
_ident_parts = (None, b"", b"", b"")    # (identity, start head, start middle, end head)
_site_parts: dict = {}                  # (id(code), line) -> (code, site tail); holds the code
_MAX_SITES = 1024                       # so its id is not reused while the entry exists
_NO_SITE_TAIL = b',"site":null,"func":null}\n'
_OK = b'"ok"'


def _j(value) -> bytes:
    return json.dumps(value).encode("ascii")


def _parts_for(ident: dict):
    global _ident_parts
    who = b'"n":%s,"p":%s' % (_j(ident.get("node")), _j(ident.get("pid")))
    parts = (ident, b'\n{"k":"s",%s,"q":' % who,
             b',"r":%s,"l":%s,"ws":%s,"lws":%s,"nr":%s,"w":' % tuple(
                 _j(ident.get(name)) for name in ("rank", "local_rank", "world_size",
                                                  "local_world_size", "node_rank")),
             b'\n{"k":"e",%s,"q":' % who)
    _ident_parts = parts
    return parts


def _site_tail(code, line) -> bytes:
    if code is None:
        return _NO_SITE_TAIL
    known = _site_parts.get((id(code), line))
    if known is not None and known[0] is code:
        return known[1]
    tail = b',"site":%s,"func":%s}\n' % (_j(f"{code.co_filename}:{line}"), _j(code.co_name))
    if len(_site_parts) >= _MAX_SITES:
        _site_parts.clear()
    _site_parts[(id(code), line)] = (code, tail)
    return tail


def _wall_text(wall: float) -> bytes:
    if not math.isfinite(wall):
        raise ValueError("wall is not a finite number")    # json.dumps(allow_nan=False) did
    return b"%.6f" % wall


def start_line(ident: dict, seq: int, code, line, wall: float, writer=None) -> bytes:
    """The start of our write `seq`: who writes, from where, when (our wall clock), and with
    which library (`writer`, an events.WRITER_KINDS name; None, and no "wr" key: torch.save)."""
    parts = _ident_parts if _ident_parts[0] is ident else _parts_for(ident)
    tail = _site_tail(code, line)
    if writer is not None:
        tail = b'%s,"wr":%s}\n' % (tail[:-2], _j(writer))
    return b"%s%d%s%s%s" % (parts[1], seq, parts[2], _wall_text(wall), tail)


def end_line(ident: dict, seq: int, wall: float, size, outcome: str, shared) -> bytes:
    """The end of our write `seq`: when, how many bytes, how it ended, and why this node sees
    the path as shared storage (None: it does not)."""
    parts = _ident_parts if _ident_parts[0] is ident else _parts_for(ident)
    return b'%s%d,"w":%s,"b":%s,"o":%s,"sh":%s}\n' % (
        parts[3], seq, _wall_text(wall), b"%d" % size if type(size) is int else _j(size),
        _OK if outcome == "ok" else _j(outcome), b"null" if shared is None else _j(shared))


def base_line(n: int) -> bytes:
    return _line({"k": "b", "n": n})


def clean_text(value, limit: int):
    """A string from the store as we may show it: at most `limit` characters, control
    characters (C0, DEL, C1) written as \\xNN; None for anything that is not a string."""
    if type(value) is not str:
        return None
    value = value[:limit]
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() or c == " " else f"\\x{ord(c):02x}"
                   if ord(c) < 256 else f"\\u{ord(c):04x}" for c in value)


def writer_kind(value):
    """A log line's "wr" as we may pass it on: None when absent (torch.save), a known kind
    (events.WRITER_KINDS) as itself, anything else -- another string, any other type -- as
    "other": a fixed set, whatever a rank (or someone else with the store) wrote."""
    if value is None:
        return None
    return value if type(value) is str and value in WRITER_KINDS else WRITER_OTHER


def _int(value, low: int = -1):
    return value if type(value) is int and low <= value <= MAX_INT else None


def _wall(value):
    return float(value) if type(value) in (int, float) and math.isfinite(value) \
        and 0 <= value < 1e11 else None


class LoggedWrite:
    """One write as the log tells it: who, where, start and end (wall and position)."""

    __slots__ = ("node", "pid", "seq", "rank", "local_rank", "world_size",
                 "local_world_size", "node_rank", "site", "func", "sw", "ew", "ts", "te",
                 "bytes", "outcome", "shared", "writer_kind")

    def __init__(self, rec: dict, pos: int):
        self.node, self.pid, self.seq = rec["n"], rec["p"], rec["q"]
        self.rank, self.local_rank = _int(rec.get("r")), _int(rec.get("l"))
        self.world_size, self.local_world_size = _int(rec.get("ws")), _int(rec.get("lws"))
        self.node_rank = _int(rec.get("nr"))
        self.site = clean_text(rec.get("site"), MAX_SITE)
        self.func = clean_text(rec.get("func"), MAX_FUNC)
        self.writer_kind = writer_kind(rec.get("wr"))
        self.sw, self.ts = rec["w"], pos
        self.ew = self.te = self.bytes = self.outcome = self.shared = None

    @property
    def key(self) -> tuple:
        return (self.node, self.pid, self.seq)

    @property
    def done(self) -> bool:
        return self.te is not None

    def writer(self) -> dict:
        return {"node": self.node, "pid": self.pid, "rank": self.rank,
                "local_rank": self.local_rank, "world_size": self.world_size,
                "local_world_size": self.local_world_size, "node_rank": self.node_rank}


def parse_log(value: bytes) -> list:
    """The writes a log holds, in the order of their starts (LoggedWrite; ts/te are the
    positions of their start and end lines). Lines that are not ours are skipped but keep
    their position: every reader numbers the same bytes the same way."""
    writes: dict[tuple, LoggedWrite] = {}
    pos = 0
    first = True
    for raw in value.split(b"\n"):
        if not raw:
            continue
        pos += 1
        rec = _record(raw)
        if first:
            first = False
            if rec is not None and rec.get("k") == "b" and _int(rec.get("n"), 0) is not None:
                pos = rec["n"]
                continue
        if rec is None:
            continue
        kind = rec.get("k")
        node, pid, seq = rec.get("n"), _int(rec.get("p"), 1), _int(rec.get("q"), 0)
        wall = _wall(rec.get("w"))
        if type(node) is not str or not node or len(node) > MAX_NODE or pid is None \
                or seq is None or wall is None:
            continue
        key = (node, pid, seq)
        if kind == "s":
            if key not in writes and len(writes) < MAX_WRITES:
                rec["n"] = clean_text(node, MAX_NODE)
                rec["w"] = wall
                writes[key] = LoggedWrite(rec, pos)
        elif kind == "e":
            w = writes.get(key)
            if w is not None and w.te is None:
                w.te, w.ew = pos, max(wall, w.sw)
                w.bytes = _int(rec.get("b"), 0)
                w.outcome = clean_text(rec.get("o"), MAX_OUTCOME) or "ok"
                w.shared = clean_text(rec.get("sh"), MAX_SHARED)
    return list(writes.values())


def compacted(value: bytes, stale) -> bytes | None:
    """The log without its longest prefix of lines that are stale(key) or not records of a
    write (a base line keeps the positions of the lines left); None when nothing is stale."""
    lines = [raw for raw in value.split(b"\n") if raw]
    pos, start = 0, 0
    for i, raw in enumerate(lines):
        rec = _record(raw)
        if i == 0 and rec is not None and rec.get("k") == "b" \
                and _int(rec.get("n"), 0) is not None:
            pos = rec["n"]
            start = 1
            continue
        key = None if rec is None else (rec.get("n"), rec.get("p"), rec.get("q"))
        if key is not None and not stale(key):
            break
        pos += 1
        start = i + 1
    else:
        return b""
    if start == 0 or (start == 1 and lines and _record(lines[0]) is not None
                      and _record(lines[0]).get("k") == "b"):
        return None
    return base_line(pos) + b"".join(b"\n" + raw + b"\n" for raw in lines[start:])


def _record(raw: bytes):
    if len(raw) > MAX_LINE_BYTES or raw[:1] != b"{":
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return rec if type(rec) is dict else None


# ---- the store's order ----------------------------------------------------------------------

def overlaps(a: LoggedWrite, b: LoggedWrite) -> bool:
    """Did a and b overlap in the store's order (each started before the other ended)?"""
    a_end = a.te if a.te is not None else INF
    b_end = b.te if b.te is not None else INF
    return a.ts < b_end and b.ts < a_end


def group_of(writes: list, mine: LoggedWrite) -> list:
    """The maximal group of transitively overlapping writes (store order) holding `mine`."""
    ordered = sorted(writes, key=lambda w: w.ts)
    group: list = []
    stop = -INF
    for w in ordered:
        end = w.te if w.te is not None else INF
        if group and w.ts < stop:
            group.append(w)
            stop = max(stop, end)
        else:
            if any(g is mine for g in group):
                return group
            group, stop = [w], end
    return group if any(g is mine for g in group) else [mine]


def group_open(group: list) -> bool:
    """A group is final once all of its writes have ended: any later start comes after every
    end in the store's order, so it can no longer join."""
    return any(w.te is None for w in group)


def related(mine: LoggedWrite, other: LoggedWrite, window: float) -> bool:
    """Is `other` within a collision window of `mine` (walls, each node's own clock)? Only
    those can form a collision with it; the window is a minute, clock skew a fraction."""
    mine_end = mine.ew if mine.ew is not None else mine.sw
    other_end = other.ew if other.ew is not None else other.sw
    return other.sw <= mine_end + window and other_end >= mine.sw - window


def linked(writes: list, mine: LoggedWrite, window: float) -> list:
    """The other writes that can share a collision with `mine`: within a window of it (walls,
    as related()) or of a write that is, and so on -- a redundant chain goes on as long as each
    next write starts within a window of the previous one's end, so a write two windows after
    ours still joins our chain through one in between (tests/e2e/test_groundtruth.py, y3).
    One sort and one sweep; an in-flight write spans its start only, as in related(). `mine`
    need not be in `writes` (a write whose lines are not in the log: judged on its walls)."""
    if not any(w is mine for w in writes):
        writes = list(writes) + [mine]
    spans = sorted(((w.sw, w.ew if w.ew is not None else w.sw, i)
                    for i, w in enumerate(writes)), key=lambda s: s[:2])
    component: list = []
    found = False
    stop = -INF
    for start, end, i in spans:
        if component and start > stop + window:
            if found:
                break
            component = []
        component.append(writes[i])
        found = found or writes[i] is mine
        stop = max(stop, end) if len(component) > 1 else end
    return [w for w in component if w is not mine]


def place_remote(own: dict, remote: dict) -> tuple[float, float, bool | None]:
    """A remote write's interval in this process's monotonic time base, and whether it
    overlapped our write in the store's order (None: positions unknown, walls decide).

    own: sw, sm (our start wall / mono), ew, em, ts, te; remote: sw, ew, ts, te. The walls are
    mapped through our own wall-mono offset, then moved the least needed to agree with the
    store's order, so the agent's detector (which compares intervals) reaches the same verdict.
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


def remote_event(ident: dict, seq: int, path: str, sm: float, em: float, mine: LoggedWrite,
                 other: LoggedWrite, wall: float) -> dict:
    """The "remote" event (ckptwatch/events.py) that tells our agent about another node's
    finished write `other` of the path of our write `mine` (sm, em: its monotonic start and
    end), placed in our time base by the store's order."""
    own = {"sw": mine.sw, "sm": sm, "ew": mine.ew, "em": em, "ts": mine.ts, "te": mine.te}
    start_mono, end_mono, overlap = place_remote(
        own, {"sw": other.sw, "ew": other.ew, "ts": other.ts, "te": other.te})
    writer = other.writer()
    writer.update(job=ident.get("job"), master=ident.get("master"),
                  restart=ident.get("restart"))
    event = {"v": SCHEMA_VERSION, "type": "remote", "node": ident["node"], "pid": ident["pid"],
             "seq": seq, "path": path, "wall": wall, "writer": writer, "wseq": other.seq,
             "start_wall": other.sw, "end_wall": other.ew, "start_mono": start_mono,
             "end_mono": end_mono, "bytes": other.bytes, "outcome": other.outcome,
             "site": other.site, "func": other.func, "overlap": overlap,
             "shared": other.shared}
    if other.writer_kind is not None:
        event["writer_kind"] = other.writer_kind
    return event

