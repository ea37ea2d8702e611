"""Notices for the warn policy: what the agent tells a writer about its own unsafe save.

Pure: builds notice frames (wire contract: ckptwatch/events.py) from a collision record, or
from a hazard record with the same "writers" list; the agent hands them to ingest.notify(),
which sends them to the writers' open connections that asked for notices.

Who gets a notice: a writer of the record whose write this node's hook reported itself (node
ours, source "hook", a seq: never a remote writer a job-scope report named, never a process the
filesystem watcher attributed a write to), and only on the connection whose own frames named
that write (notices_for gives the (seq, path) pairs; ingest.notify matches them against what
each connection sent). It names the recipient's own call site, as its hook reported it, and
the other writers (at most MAX_NOTICE_OTHERS; strings cut to MAX_NOTICE_TEXT). A frame that
would still exceed MAX_NOTICE_BYTES loses writers from its list until it fits.
"""
from __future__ import annotations

from ckptwatch import events
from monitor.detect.model import SOURCE_HOOK

_TEXT = events.MAX_NOTICE_TEXT


def _text(value):
    return value[:_TEXT] if isinstance(value, str) else None


def _int(value):
    return value if type(value) is int else None


def notices_for(record: dict, node: str) -> list[tuple[int, tuple, bytes]]:
    """(pid, writes, frame) for every process of `node` whose hook reported one of the
    record's writes itself; writes: the (seq, path) pairs of its own writes in the record.
    [] if not applicable."""
    writers = record.get("writers")
    path = record.get("path")
    if not isinstance(writers, list) or not isinstance(path, str):
        return []
    kind = record.get("kind") if record.get("type") == "collision" else record.get("type")
    own: dict[int, list] = {}
    for w in writers:
        pid, seq = _int(w.get("pid")), _int(w.get("seq"))
        if (pid is not None and pid > 0 and seq is not None and w.get("node") == node
                and w.get("source", record.get("source")) == SOURCE_HOOK):
            own.setdefault(pid, []).append((seq, path))
    out, done = [], set()
    for me in writers:
        pid = _int(me.get("pid"))
        if pid not in own or pid in done:
            continue
        done.add(pid)
        others = [{"rank": _int(w.get("rank")), "pid": _int(w.get("pid")),
                   "node": _text(w.get("node")), "site": _text(w.get("site"))}
                  for w in writers if w.get("pid") != pid or w.get("node") != node]
        notice = {"v": events.NOTICE_VERSION, "type": "notice", "kind": _text(kind) or "?",
                  "path": _text(record["path"]), "site": _text(me.get("site")),
                  "id": _text(record.get("id")), "others": others[:events.MAX_NOTICE_OTHERS]}
        frame = _fit(notice)
        if frame is not None:
            out.append((pid, tuple(own[pid]), frame))
    return out


def _fit(notice: dict) -> bytes | None:
    while True:
        try:
            payload = events._ENCODER.encode(notice).encode("utf-8")
        except ValueError:
            return None
        if len(payload) <= events.MAX_NOTICE_BYTES:
            return events.HEADER.pack(len(payload)) + payload
        if not notice["others"]:
            return None
        notice["others"] = notice["others"][:-1]
