"""The one-line WARNING messages the agent logs for each collision and finding.

One line per collision, greppable, naming what a person needs to act: the path, who wrote it
(rank@node and pid, in start order), how long the writes overlapped and the call sites; one
line per size fluctuation, torn read and corrupt checkpoint. Values come from training
processes and file names, so control characters are escaped: a path with a newline must not
forge a second log line. `LogExporter` logs them (exporters.fanout.Exporter).
"""
from __future__ import annotations

import logging

from monitor.detect.model import (FINDING_HAZARD, FINDING_SIZE_FLUCTUATION, FINDING_TORN_READ,
                                  FINDING_VERIFICATION, KIND_CONCURRENT, Collision, Finding,
                                  Write, Writer)

log = logging.getLogger("ckptwatch.agent")

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
        reporters = sorted({w.reporter for w in c.writes if w.reporter is not None})
        if reporters:
            # Other nodes' writes are the word of the local processes that learnt them.
            parts.append("other nodes' writes reported by pid "
                         + ", ".join(str(p) for p in reporters[:MAX_WRITERS_LISTED]))
    if c.id:
        parts.append(f"id {clean(c.id)}")
    return "; ".join(parts)


def _finding_writers(finding: Finding) -> str:
    """rank0(11), pid(12): the writers a finding names, as the agent has always logged them."""
    return ", ".join(f"{'rank%s' % w['rank'] if w.get('rank') is not None else 'pid'}"
                     f"({w.get('pid')})" for w in finding.writers)


def finding_message(f: Finding) -> str | None:
    """One line for a WARNING log, or None for a finding not worth one (a verification that
    found nothing wrong: it is counted only)."""
    path = clean(f.path)
    if f.kind == FINDING_SIZE_FLUCTUATION:
        who = clean(_finding_writers(f))
        if f.get("rule"):
            return (f"size fluctuation on {path}: {clean(f.get('rule'))} "
                    f"({f.get('size_before')} then {f.get('size_after')} bytes) by {who}")
        return (f"size fluctuation on {path}: shrank from {f.get('size_before')} to "
                f"{f.get('size_after')} bytes while written by {who}")
    if f.kind == FINDING_TORN_READ:
        reader = f.get("reader") or {}
        return (f"torn read of {path}: pid {reader.get('pid', '?')} opened it for reading "
                f"while {clean(_finding_writers(f))} wrote it")
    if f.kind == FINDING_VERIFICATION:
        if f.get("result") == "ok" and f.get("pickle") == "full_unpickle":
            names = ", ".join(clean(n) for n in f.get("refused_globals") or ())
            return (f"checkpoint {path} names callables torch.load(weights_only=True) refuses "
                    f"({names}): loading it with weights_only=False would call them")
        if f.get("result") != "corrupt":
            return None
        by = f" (written by collision {clean(f.get('collision_id'))})" \
            if f.get("collision_id") else ""
        return (f"corrupt checkpoint {path}: {clean(f.get('reason'))} "
                f"[{clean(f.get('cause'))}]{by}")
    if f.kind == FINDING_HAZARD:
        return hazard_message(f)
    return f"{clean(f.kind)} on {path}"


HAZARD_TEXT = {
    "local_rank_guard": "local rank 0 of a node other than the first saves a shared path "
                        "that names neither its rank nor its node (a `local_rank == 0` guard: "
                        "every node's local rank 0 writes it)",
    "shared_storage_multi_writer": "several ranks write this path on shared storage",
}


def hazard_message(f: Finding) -> str:
    """e.g. hazard local_rank_guard on /ckpt/last.pt (shared: mount:nfs4): ...; by rank2@n2
    (pid 11) at train.py:42; ranks 0, 2; job j1"""
    writer = f.writers[0] if f.writers else {}
    who = (f"rank{writer.get('rank')}@{clean(writer.get('node'))}(pid {writer.get('pid')})"
           if writer.get("rank") is not None else f"pid {writer.get('pid')}")
    kind = f.get("hazard") or "?"
    text = (f"hazard {clean(kind)} on {clean(f.path)} (shared: {clean(f.get('shared'))}): "
            f"{HAZARD_TEXT.get(kind, clean(kind))}; by {who}")
    if writer.get("site"):
        text += f" at {clean(writer['site'])}"
    ranks = f.get("ranks") or []
    if ranks:
        text += "; ranks " + ", ".join(str(r) for r in ranks[:MAX_WRITERS_LISTED])
    if f.job:
        text += f"; job {clean(f.job)}"
    return text


class LogExporter:
    """Collisions and findings as WARNING lines (exporters.fanout.Exporter); writes are not
    logged, one line per save would drown the rest."""

    def publish_write(self, write: Write) -> None:
        pass

    def publish_collision(self, collision: Collision) -> None:
        try:
            log.warning("%s", collision_message(collision))
        except Exception:
            log.exception("cannot format collision on %r", collision.path)

    def publish_finding(self, finding: Finding) -> None:
        message = finding_message(finding)
        if message is not None:
            log.warning("%s", message)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
