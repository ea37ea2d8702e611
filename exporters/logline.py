"""The WARNING lines the agent logs for each collision and finding.

One line per collision, naming what a person needs to act: the path, who wrote it (rank@node
and pid, in start order), how long the writes overlapped and the call sites; one line per size
fluctuation, torn read, corrupt checkpoint and hazard. The msg is a fixed text per kind of
event ("concurrent write collision", "corrupt checkpoint", ...) and everything else is a field
of its own (path=..., training_job=..., id=...: monitor.agent.logformat writes them), so a log
query selects by path or job without parsing sentences. `LogExporter` logs them
(exporters.fanout.Exporter). `clean` escapes control characters for one-line output: values
come from training processes and file names, and must not forge a second line.
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


def collision_fields(c: Collision) -> dict:
    """The fields of a collision's log line (monitor.agent.logformat puts them after msg), e.g.
    kind=concurrent path=/ckpt/last.pt writers=4 who="rank0@n1(pid 11),..." overlap_seconds=0.84
    call_sites="train.py:42 (save_checkpoint)" training_job=j1 scope=node id=3f2a..."""
    writers = c.writers
    names = [writer_name(w) for w in writers[:MAX_WRITERS_LISTED]]
    if len(writers) > MAX_WRITERS_LISTED:
        names.append(f"and {len(writers) - MAX_WRITERS_LISTED} more")
    fields = {"kind": c.kind, "path": c.path, "writers": len(writers), "who": names}
    if c.kind == KIND_CONCURRENT:
        fields["overlap_seconds"] = f"{c.overlap_seconds:.2f}"
    else:
        first, last = c.first, c.last
        end = last.end_mono if last.end_mono is not None else last.start_mono
        fields["span_seconds"] = f"{max(0.0, end - first.start_mono):.2f}"
    fields["call_sites"] = call_sites(c) or "unknown"
    fields["training_job"] = c.job_label
    fields["scope"] = c.scope
    if c.scope != "node":
        reporters = sorted({w.reporter for w in c.writes if w.reporter is not None})
        if reporters:
            # Other nodes' writes are the word of the local processes that learnt them.
            fields["reported_by_pid"] = reporters[:MAX_WRITERS_LISTED]
    fields["id"] = c.id
    return fields


def _finding_writers(finding: Finding) -> list:
    """["rank0(11)", "pid(12)"]: the writers a finding names, as the agent has always
    logged them."""
    return [f"{'rank%s' % w['rank'] if w.get('rank') is not None else 'pid'}({w.get('pid')})"
            for w in finding.writers[:MAX_WRITERS_LISTED]]


def finding_fields(f: Finding) -> tuple[str, dict] | None:
    """The msg and fields of a finding's log line, or None for a finding not worth one (a
    verification that found nothing wrong: it is counted only)."""
    if f.kind == FINDING_SIZE_FLUCTUATION:
        fields = {"path": f.path, "training_job": f.job,
                  "rule": f.get("rule") or "shrank while open for writing by two writers",
                  "size_before": f.get("size_before"), "size_after": f.get("size_after"),
                  "writers": _finding_writers(f)}
        return "size fluctuation", fields
    if f.kind == FINDING_TORN_READ:
        reader = f.get("reader") or {}
        return "torn read", {"path": f.path, "training_job": f.job,
                             "reader_pid": reader.get("pid", "?"),
                             "writers": _finding_writers(f)}
    if f.kind == FINDING_VERIFICATION:
        if f.get("result") == "ok" and f.get("pickle") == "full_unpickle":
            names = f.get("refused_globals")
            names = names if isinstance(names, (list, tuple)) else ()
            return "checkpoint needs a full unpickle", {
                "path": f.path, "training_job": f.job,
                "refused_globals": [clean(n) for n in names[:MAX_WRITERS_LISTED]],
                "what": "torch.load(weights_only=True) refuses these callables; loading it "
                        "with weights_only=False would call them"}
        if f.get("result") != "corrupt":
            return None
        return "corrupt checkpoint", {"path": f.path, "training_job": f.job,
                                      "reason": f.get("reason"), "cause": f.get("cause"),
                                      "collision_id": f.get("collision_id") or ""}
    if f.kind == FINDING_HAZARD:
        return "checkpoint hazard", hazard_fields(f)
    return f.kind, {"path": f.path, "training_job": f.job}


HAZARD_TEXT = {
    "local_rank_guard": "local rank 0 of a node other than the first saves a shared path "
                        "that names neither its rank nor its node (a `local_rank == 0` guard: "
                        "every node's local rank 0 writes it)",
    "shared_storage_multi_writer": "several ranks write this path on shared storage",
}


def hazard_fields(f: Finding) -> dict:
    """e.g. hazard=local_rank_guard path=/ckpt/last.pt shared=mount:nfs4 what="..."
    writer="rank2@n2(pid 11)" site=train.py:42 ranks=0,2 training_job=j1"""
    writer = f.writers[0] if f.writers else {}
    who = (f"rank{writer.get('rank')}@{writer.get('node')}(pid {writer.get('pid')})"
           if writer.get("rank") is not None else f"pid {writer.get('pid')}")
    kind = f.get("hazard") or "?"
    fields = {"hazard": kind, "path": f.path, "shared": f.get("shared"),
              "what": HAZARD_TEXT.get(kind, kind), "writer": who}
    if writer.get("site"):
        fields["site"] = writer["site"]
    ranks = f.get("ranks") or []
    if ranks:
        fields["ranks"] = [str(r) for r in ranks[:MAX_WRITERS_LISTED]]
    fields["training_job"] = f.job
    return fields


class LogExporter:
    """Collisions and findings as WARNING lines (exporters.fanout.Exporter); writes are not
    logged, one line per save would drown the rest."""

    def publish_write(self, write: Write) -> None:
        pass

    def publish_collision(self, collision: Collision) -> None:
        try:
            log.warning("%s write collision", collision.kind,
                        extra={"fields": collision_fields(collision)})
        except Exception:
            log.exception("cannot format collision on %r", collision.path)

    def publish_finding(self, finding: Finding) -> None:
        line = finding_fields(finding)
        if line is not None:
            log.warning("%s", line[0], extra={"fields": line[1]})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
