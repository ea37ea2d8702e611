"""The one-line WARNING message the agent logs for each collision.

One line per collision, greppable, naming what a person needs to act: the path, who wrote it
(rank@node and pid, in start order), how long the writes overlapped and the call sites.
Values come from training processes, so control characters are escaped: a path with a newline
must not forge a second log line.
"""
from __future__ import annotations

from monitor.detect.model import KIND_CONCURRENT, Collision, Writer

# A 512-rank job all saving to one path should not produce a 30 kB log line.
MAX_WRITERS_LISTED = 16


def clean(text) -> str:
    """The text with control characters escaped (\\n, \\x1b, ...), for one-line output."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def writer_name(writer: Writer) -> str:
    """rank3@node-a(pid 1234), or pid 1234@node-a when the rank is unknown."""
    if writer.rank is None:
        return f"pid {writer.pid}@{clean(writer.node)}"
    return f"rank{writer.rank}@{clean(writer.node)}(pid {writer.pid})"


def call_sites(collision: Collision) -> list[str]:
    """Distinct "file:line (function)" of the writes, in start order."""
    sites: dict[str, None] = {}
    for write in collision.writes:
        if write.site is None:
            continue
        site = clean(write.site)
        if write.func:
            site += f" ({clean(write.func)})"
        sites.setdefault(site, None)
    return list(sites)


def collision_message(c: Collision) -> str:
    """One line for a WARNING log, e.g.

    concurrent write collision on /ckpt/last.pt: 4 writers rank0@n1(pid 11), rank1@n1(pid 12),
    ... overlapping 0.84s; call sites: train.py:42 (save_checkpoint); job j1; id 3f2a...
    """
    writers = c.writers
    names = [writer_name(w) for w in writers[:MAX_WRITERS_LISTED]]
    if len(writers) > MAX_WRITERS_LISTED:
        names.append(f"and {len(writers) - MAX_WRITERS_LISTED} more")
    if c.kind == KIND_CONCURRENT:
        timing = f"overlapping {c.overlap_seconds:.2f}s"
    else:
        first, last = c.first, c.last
        end = last.end_mono if last.end_mono is not None else last.start_mono
        timing = f"one after another over {max(0.0, end - first.start_mono):.2f}s"
    sites = call_sites(c)
    parts = [f"{clean(c.kind)} write collision on {clean(c.path)}: {len(writers)} writers "
             f"{', '.join(names)} {timing}",
             f"call sites: {', '.join(sites) if sites else 'unknown'}"]
    if c.job_label:
        parts.append(f"job {clean(c.job_label)}")
    if c.scope != "node":
        parts.append(f"scope {clean(c.scope)}")
    if c.id:
        parts.append(f"id {clean(c.id)}")
    return "; ".join(parts)
