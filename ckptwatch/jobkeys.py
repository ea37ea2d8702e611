"""Job scope's key scheme and overlap maths: what the ranks of one job write to its store, and
how a rank reads another's write back into its own time base (the "remote" event). Pure: no store, no thread, no
clock (ckptwatch/jobscope.py is the thread that uses them).

Loaded into training processes: standard library only.

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

import hashlib
import json

from ckptwatch.events import SCHEMA_VERSION, WRITER_FIELDS
from ckptwatch.jobrun import job_run

EPS = 1e-6
RECORD_WRITER_FIELDS = tuple(f for f in WRITER_FIELDS if f not in ("job", "master", "restart"))
MAX_RECORD_BYTES = 16384        # a slot value longer than this is not a record of ours


def run_prefix(ident: dict) -> str:
    """ckptwatch/<16 hex>: the store keys of one job run (ckptwatch.jobrun.job_run). Job scope
    starts only with MASTER_ADDR:MASTER_PORT set, so its run always has a name."""
    run = job_run(ident.get("job"), ident.get("master"), ident.get("restart"))
    text = "\0".join(map(str, run)) if run is not None else ""
    return "ckptwatch/" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def path_hash(path: str) -> str:
    return hashlib.sha1(path.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def epoch(wall: float, window: float) -> int:
    """The epoch a write that started at `wall` announces itself in."""
    return int(wall // window)


def ticket_key(prefix: str) -> str:
    return f"{prefix}/t"


def counter_key(prefix: str, h: str, epoch_: int) -> str:
    return f"{prefix}/{h}/{epoch_}/n"


def slot_key(prefix: str, h: str, epoch_: int, slot: int) -> str:
    return f"{prefix}/{h}/{epoch_}/{slot}"


def slot_record(ident: dict, seq: int, path: str, code, line, wall: float) -> dict:
    """A write's record at its start, as other ranks read it from its slot: the writer, the
    call site, the start wall; the end's fields (ew, te, bytes, outcome) and the tickets are
    filled in as the thread learns them."""
    # The writer's own fields (WRITER_FIELDS less the job run's, which every reader of the
    # job's store shares: remote_event adds the reader's own).
    rec = {name: ident.get(name) for name in RECORD_WRITER_FIELDS}
    rec.update({"seq": seq, "path": path,
            "site": f"{code.co_filename}:{line}" if code is not None else None,
            "func": code.co_name if code is not None else None,
            "shared": None, "sw": wall, "ew": None, "ts": None, "te": None,
            "bytes": None, "outcome": None})
    return rec


def encode_record(rec: dict) -> str:
    return json.dumps(rec, separators=(",", ":"))


def decode_record(value) -> dict | None:
    """A slot's value as a record; None when absent, oversized or not a JSON object (another
    rank's store is input we do not control)."""
    if value is None or len(value) > MAX_RECORD_BYTES:
        return None
    try:
        rec = json.loads(value)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def related(own: dict, rec: dict, window: float) -> bool:
    """Does the write `rec` (another rank's record) fall within a window of our write `own`
    (our record: sw, ew)? Only those can form a collision with it."""
    sw, ew = rec.get("sw"), rec.get("ew")
    if not isinstance(sw, (int, float)):
        return False
    end = ew if isinstance(ew, (int, float)) else sw
    mine_start, mine_end = own["sw"], own["ew"] or own["sw"]
    return sw <= mine_end + window and end >= mine_start - window


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


def remote_event(mine: dict, sm: float, em: float, rec: dict, ident: dict,
                 wall: float) -> dict | None:
    """The "remote" event (ckptwatch/events.py) that tells our agent about another rank's
    finished write `rec` of the path of our write `mine` (our record; sm, em: its monotonic
    start and end), placed in our time base; None if `rec` is not a finished write's record."""
    if not (isinstance(rec.get("ew"), (int, float)) and isinstance(rec.get("sw"), (int, float))
            and type(rec.get("pid")) is int and type(rec.get("seq")) is int
            and isinstance(rec.get("node"), str)):
        return None
    own = {"sw": mine["sw"], "sm": sm, "ew": mine["ew"], "em": em, "ts": mine["ts"],
           "te": mine["te"]}
    start_mono, end_mono, overlap = place_remote(own, rec)
    writer = {name: rec.get(name) for name in RECORD_WRITER_FIELDS}
    writer.update(job=ident.get("job"), master=ident.get("master"),
                  restart=ident.get("restart"))
    return {"v": SCHEMA_VERSION, "type": "remote", "node": mine["node"],
            "pid": mine["pid"], "seq": mine["seq"], "path": mine["path"],
            "wall": wall, "writer": writer, "wseq": rec["seq"],
            "start_wall": rec["sw"], "end_wall": rec["ew"], "start_mono": start_mono,
            "end_mono": end_mono, "bytes": rec.get("bytes"),
            "outcome": rec.get("outcome") if isinstance(rec.get("outcome"), str)
            else "ok",
            "site": rec.get("site"), "func": rec.get("func"), "overlap": overlap,
            "shared": rec.get("shared")}
