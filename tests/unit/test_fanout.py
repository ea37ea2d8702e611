"""exporters.fanout: every value reaches every exporter; one failing exporter stops none."""
import logging

from exporters.fanout import Fanout
from exporters.journal import Journal, JournalExporter, read_records
from exporters.metrics.exporter import MetricsExporter
from exporters.metrics.state import MetricsState
from monitor.detect.model import Collision, Finding, Write, Writer


def make_write(pid, start=0.0, end=1.0):
    return Write(writer=Writer("n1", pid, rank=pid, job="j"), path="/c/a.pt", seq=1,
                 start_wall=100.0 + start, start_mono=start, end_wall=100.0 + end,
                 end_mono=end, bytes=10, outcome="ok")


class RecordingExporter:
    """An exporter that records every call the fan-out makes on it, in order."""

    def __init__(self):
        self.calls = []

    def publish_write(self, write):
        self.calls.append(("write", write.writer.pid))

    def publish_collision(self, collision):
        self.calls.append(("collision", collision.path))

    def publish_finding(self, finding):
        self.calls.append(("finding", finding.kind))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


class Broken(RecordingExporter):
    def publish_write(self, write):
        raise RuntimeError("exporter bug")

    def publish_collision(self, collision):
        raise RuntimeError("exporter bug")


def test_every_exporter_gets_every_value_even_after_one_fails(caplog):
    first, second = Broken(), RecordingExporter()
    fan = Fanout([first, second])
    a, b = make_write(1), make_write(2, 0.5, 1.5)
    with caplog.at_level(logging.ERROR, logger="ckptwatch.agent"):
        fan.publish([a, b, Collision("/c/a.pt", "concurrent", (a, b)),
                     Finding("torn_read", "/c/a.pt")])
        fan.flush()
        fan.close()
    assert second.calls == [("write", 1), ("write", 2), ("collision", "/c/a.pt"),
                            ("finding", "torn_read"), ("flush",), ("close",)]
    assert first.calls == [("finding", "torn_read"), ("flush",), ("close",)]
    assert sum("Broken.publish_write failed" in r.getMessage() for r in caplog.records) == 2


def test_journal_exporter_keeps_findings_and_only_verdicts_worth_keeping(tmp_path):
    path = str(tmp_path / "journal.jsonl")
    journal = Journal(path, buffered=True)
    exporter = JournalExporter(journal)
    exporter.publish_write(make_write(1))
    exporter.publish_finding(Finding("size_fluctuation", "/c/a.pt", "j", 1.0, "n1", "fs",
                                     ({"pid": 1},), {"v": 1, "size_before": 5}))
    for result in ("ok", "gone", "unverifiable", "corrupt"):
        exporter.publish_finding(Finding("verification", f"/c/{result}.pt",
                                         details={"result": result}))
    exporter.close()
    records = list(read_records(path))
    assert [(r["type"], r["path"]) for r in records] == [
        ("write", "/c/a.pt"), ("size_fluctuation", "/c/a.pt"),
        ("verification", "/c/unverifiable.pt"), ("verification", "/c/corrupt.pt")]
    assert records[1]["writers"] == [{"pid": 1}] and records[1]["size_before"] == 5


def test_journal_exporter_counts_lost_lines(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = Journal(str(path))
    exporter = JournalExporter(journal)
    exporter.publish_write(make_write(1))
    exporter.close()
    path.unlink()
    path.mkdir()                      # the journal's name is now a directory: lines are lost
    exporter.publish_write(make_write(2))
    exporter.publish_collision(Collision("/c/a.pt", "concurrent", (make_write(1),
                                                                  make_write(2, 0.5, 1.5))))
    exporter.flush()
    assert journal.records_lost == 2


def test_metrics_exporter_counts_findings_and_verdicts():
    state = MetricsState()
    exporter = MetricsExporter(state)
    exporter.publish_finding(Finding("torn_read", "/c/a.pt", "j"))
    exporter.publish_finding(Finding("verification", "/c/a.pt",
                                     details={"result": "corrupt", "cause": "truncated"}))
    snap = state.snapshot()
    assert snap.torn_reads == {"j": 1}
    assert snap.verifications["corrupt"] == 1
