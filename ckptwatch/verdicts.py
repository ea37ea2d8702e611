"""What the agent knows about one checkpoint file, in one place: the states, the wire and
extended-attribute encoding, and the text every command says about it.

Loaded into training processes (the resume guard, ckptwatch/resumeguard.py) and imported by the
agent (which stores verdicts with the files and answers queries) and by `ckptwatch scan` and
`ckptwatch report`, so the three tell one story about one file. Standard library only.

A FileVerdict is what is known about a file at a moment:

  state       "ok"        verified whole by the agent
              "corrupt"   verified and found corrupt (cause: one of monitor.verify's CAUSES)
              "collision" written by a concurrent collision, not (yet) verified whole
              "writing"   a save of this path is in progress right now
              "unknown"   nothing on record (no agent, no verdict, or a verdict about an
                          older version of the file)
  cause       corrupt: the bounded category (torn, truncated, crc_mismatch, ...)
  reason      corrupt: the verifier's sentence (content-free: never the file's bytes)
  collision   the id of the concurrent collision that wrote the file ("" if none)
  writers     who wrote it in that collision, as short texts ("rank 1 pid 4242 on node-a at
              train.py:40"), at most MAX_WRITERS
  last_ok     the last checkpoint of the same directory the agent verified ok ("" if none)
  identity    (st_ino, st_size, st_mtime_ns) of the file the verdict is about, or None

Identity. A verdict is about one version of one file: the guard compares the identity with
the file it is about to load (same_file) and treats a verdict about another version as
unknown, so a file replaced (renamed over: another inode) or rewritten in place (another size
or mtime) after its verdict is never judged by the old verdict. st_dev is left out on
purpose: it differs between the nodes that mount one shared filesystem, while the inode
number, size and mtime do not. Setting an extended attribute changes ctime, not mtime, so the
stored verdict does not invalidate itself.

Everything decoded here came from a socket or from a file anyone who can write the checkpoint
can tag: decode() bounds every field (MAX_BYTES in all, MAX_TEXT per string, MAX_WRITERS
writers, known states only) and returns None for anything else; describe() prints every text
through ckptwatch.policy.shown() (cut, control characters escaped).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ckptwatch.advice import FIX, RESUME_FIX

VERSION = 1
XATTR = "user.ckptwatch.verdict"   # user.*: readable by whoever may read the file, no more
MAX_BYTES = 4096                   # an encoded verdict (an ext4 xattr value fits in a block)
MAX_TEXT = 512
MAX_WRITERS = 8

OK, CORRUPT, COLLISION, WRITING, UNKNOWN = "ok", "corrupt", "collision", "writing", "unknown"
STATES = (OK, CORRUPT, COLLISION, WRITING, UNKNOWN)
# What `CKPTWATCH_POLICY=strict` refuses to load: a file proven corrupt, one written by a
# collision and not verified whole, one still being written.
REFUSED = frozenset({CORRUPT, COLLISION, WRITING})


@dataclass(frozen=True)
class FileVerdict:
    state: str = UNKNOWN
    cause: str = ""
    reason: str = ""
    collision: str = ""
    writers: tuple = ()
    last_ok: str = ""
    identity: tuple | None = None

    @property
    def worth_saying(self) -> bool:
        """Does a load of this file deserve a line in the training log? Everything but a
        plain verified-ok file and an unknown one."""
        return self.state in REFUSED or (self.state == OK and bool(self.collision))

    @property
    def refused(self) -> bool:
        return self.state in REFUSED

    def to_dict(self) -> dict:
        out = {"v": VERSION, "state": self.state}
        for name in ("cause", "reason", "collision", "last_ok"):
            value = getattr(self, name)
            if value:
                out[name] = value[:MAX_TEXT]
        if self.writers:
            out["writers"] = [w[:MAX_TEXT] for w in self.writers[:MAX_WRITERS]]
        if self.identity is not None:
            out["identity"] = list(self.identity)
        return out


UNKNOWN_VERDICT = FileVerdict()


def identity_of(st) -> tuple:
    """The identity a verdict is keyed to, from an os.stat_result (module doc)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def same_file(verdict: FileVerdict, st) -> bool:
    return verdict.identity is not None and tuple(verdict.identity) == identity_of(st)


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def encode(verdict: FileVerdict, **extra) -> bytes:
    """The verdict as compact JSON (an xattr value, or the body of an answer frame with
    `extra` fields such as type and qid); writers are dropped until it fits MAX_BYTES."""
    body = verdict.to_dict()
    body.update(extra)
    while True:
        data = _ENCODER.encode(body).encode("ascii")
        if len(data) <= MAX_BYTES:
            return data
        if not body.get("writers"):
            break
        body["writers"] = body["writers"][:-1]
    # Still too large (long non-ASCII texts, escaped): the state and identity alone.
    short = {"v": VERSION, "state": verdict.state, **extra}
    if verdict.identity is not None:
        short["identity"] = list(verdict.identity)
    return _ENCODER.encode(short).encode("ascii")


def decode(data, expect_type: str | None = None) -> FileVerdict | None:
    """A FileVerdict from untrusted bytes (an xattr value, an agent's answer), or None.
    Never raises."""
    try:
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_BYTES:
            return None
        value = json.loads(bytes(data).decode("utf-8"))
        return from_dict(value, expect_type)
    except Exception:       # RecursionError, MemoryError on hostile input, ...
        return None


def _text(value) -> str | None:
    if value is None:
        return ""
    return value if type(value) is str and len(value) <= MAX_TEXT else None


def from_dict(value, expect_type: str | None = None) -> FileVerdict | None:
    if type(value) is not dict or value.get("v") != VERSION or type(value.get("v")) is not int:
        return None
    if expect_type is not None and value.get("type") != expect_type:
        return None
    state = value.get("state")
    if state not in STATES:
        return None
    texts = [_text(value.get(k)) for k in ("cause", "reason", "collision", "last_ok")]
    if None in texts:
        return None
    writers = value.get("writers", [])
    if (type(writers) is not list or len(writers) > MAX_WRITERS
            or any(type(w) is not str or len(w) > MAX_TEXT for w in writers)):
        return None
    ident = value.get("identity")
    if ident is not None:
        if (type(ident) is not list or len(ident) != 3
                or any(type(i) is not int or not 0 <= i < 2 ** 64 for i in ident)):
            return None
        ident = tuple(ident)
    cause, reason, collision, last_ok = texts
    return FileVerdict(state, cause, reason, collision, tuple(writers), last_ok, ident)


# ---- the text: one story about one file, whoever tells it ---------------------------------

def writer_text(rank=None, pid=None, node=None, site=None) -> str:
    """One writer of a collision as the verdict lists it: "rank 1 pid 4242 on node-a at
    train.py:40" (the parts that are known)."""
    parts = []
    if type(rank) is int:
        parts.append(f"rank {rank}")
    if type(pid) is int:
        parts.append(f"pid {pid}")
    text = " ".join(parts) or "a process"
    if isinstance(node, str) and node:
        text += f" on {node}"
    if isinstance(site, str) and site:
        text += f" at {site}"
    return text[:MAX_TEXT]


def finding(verdict: FileVerdict) -> str:
    """What was found, without the path: "is corrupt (torn: ...)", "was written by ..."."""
    from ckptwatch.policy import shown

    state = verdict.state
    if state == CORRUPT:
        what = "is corrupt"
        detail = ": ".join(shown(t) for t in (verdict.cause, verdict.reason) if t)
        if detail:
            what += f" ({detail})"
    elif state == COLLISION:
        what = "was written by several processes at once and is not verified whole"
    elif state == WRITING:
        what = "is being written right now (a save of this path has not finished)"
    elif state == OK:
        what = "is verified whole"
    else:
        what = "has no verdict on record"
    if verdict.collision:
        what += f"; written by concurrent collision {shown(verdict.collision)}"
        if verdict.writers:
            what += f" ({', '.join(shown(w) for w in verdict.writers)})"
    return what


def action(verdict: FileVerdict, path: str = "") -> str:
    """What to do about it."""
    from ckptwatch.policy import shown

    last_ok = verdict.last_ok if verdict.last_ok and verdict.last_ok != path else ""
    if verdict.state == WRITING:
        return ("wait for the save to finish before loading it"
                + (f", or resume from {shown(last_ok)} (the last checkpoint here verified ok)"
                   if last_ok else ""))
    if verdict.state in REFUSED:
        if last_ok:
            return (f"do not resume from this file: resume from {shown(last_ok)} (the last "
                    f"checkpoint here verified ok)")
        return RESUME_FIX
    if verdict.collision:
        return FIX          # whole this time; the next race may tear it
    return ""


def describe(path: str, verdict: FileVerdict) -> str:
    """One line: which file, what was found, which collision wrote it, what to do."""
    from ckptwatch.policy import shown

    text = f"{shown(path)} {finding(verdict)}"
    todo = action(verdict, path)
    return f"{text}. {todo[:1].upper()}{todo[1:]}." if todo else text + "."
