"""The WARNING line per collision and per finding: a fixed msg, the rest in fields."""
import io
import logging

import pytest

from exporters.logline import (MAX_WRITERS_LISTED, LogExporter, collision_fields,
                               finding_fields)
from monitor.agent import logformat
from monitor.detect.model import Collision, Finding, Write, Writer


def write(pid, rank, start, end, node="n1", site="train.py:42", func="save_checkpoint",
          path="/ckpt/last.pt", job="j1"):
    return Write(writer=Writer(node=node, pid=pid, rank=rank, job=job), path=path, seq=1,
                 start_wall=start, start_mono=start, end_wall=end, end_mono=end, bytes=10,
                 outcome="ok", site=site, func=func)


def test_concurrent_fields_name_path_writers_overlap_and_sites():
    ws = tuple(write(11 + r, r, 10.0 + r * 0.25, 11.0 + r * 0.25) for r in range(4))
    c = Collision(path="/ckpt/last.pt", kind="concurrent", writes=ws, id="abc")
    assert collision_fields(c) == {
        "kind": "concurrent", "path": "/ckpt/last.pt", "writers": 4,
        "who": ["rank0@n1(pid 11)", "rank1@n1(pid 12)", "rank2@n1(pid 13)",
                "rank3@n1(pid 14)"],
        "overlap_seconds": "1.25",                        # 10.25 .. 11.5
        "call_sites": ["train.py:42 (save_checkpoint)"],  # deduplicated
        "training_job": "j1", "scope": "node", "id": "abc"}


def test_redundant_fields_unknown_ranks_and_several_sites():
    ws = (write(7, None, 0.0, 1.0, site="a.py:1", func=None),
          write(8, None, 2.0, 3.5, node="n2", site="b.py:2", func="f"))
    fields = collision_fields(Collision(path="/x.pt", kind="redundant", writes=ws))
    assert fields["who"] == ["pid 7@n1", "pid 8@n2"]
    assert fields["span_seconds"] == "3.50" and "overlap_seconds" not in fields
    assert fields["call_sites"] == ["a.py:1", "b.py:2 (f)"]


def test_many_writers_are_capped():
    ws = tuple(write(100 + r, r, r * 0.01, 5.0) for r in range(40))
    fields = collision_fields(Collision(path="/p", kind="concurrent", writes=ws))
    assert fields["writers"] == 40 and fields["who"][-1] == f"and {40 - MAX_WRITERS_LISTED} more"
    assert len(fields["who"]) == MAX_WRITERS_LISTED + 1


def test_finding_fields_size_fluctuation_torn_read_and_corrupt():
    fluct = Finding("size_fluctuation", "/c/a.pt", "j", writers=(
        {"pid": 11, "rank": 0}, {"pid": 12, "rank": None}),
        details={"size_before": 4000, "size_after": 0})
    msg, fields = finding_fields(fluct)
    assert msg == "size fluctuation"
    assert fields == {"path": "/c/a.pt", "training_job": "j",
                      "rule": "shrank while open for writing by two writers",
                      "size_before": 4000, "size_after": 0,
                      "writers": ["rank0(11)", "pid(12)"]}
    torn = Finding("torn_read", "/c/a.pt", writers=({"pid": 1, "rank": 3},),
                   details={"reader": {"pid": 8}})
    assert finding_fields(torn) == ("torn read", {"path": "/c/a.pt", "training_job": "",
                                                  "reader_pid": 8, "writers": ["rank3(1)"]})
    corrupt = Finding("verification", "/c/a.pt", "j", details={
        "result": "corrupt", "reason": "truncated zip", "cause": "truncated",
        "collision_id": "abc"})
    assert finding_fields(corrupt) == ("corrupt checkpoint", {
        "path": "/c/a.pt", "training_job": "j", "reason": "truncated zip",
        "cause": "truncated", "collision_id": "abc"})
    # A verification that found nothing is counted, not logged.
    assert finding_fields(Finding("verification", "/c/a.pt", details={"result": "ok"})) is None


def test_hazard_fields():
    hazard = Finding("hazard", "/shared/last.pt", "j7", writers=(
        {"pid": 11, "rank": 2, "node": "n2", "site": "train.py:42"},),
        details={"hazard": "local_rank_guard", "shared": "mount:nfs4", "ranks": [0, 2]})
    msg, fields = finding_fields(hazard)
    assert msg == "checkpoint hazard"
    assert fields["hazard"] == "local_rank_guard" and fields["writer"] == "rank2@n2(pid 11)"
    assert fields["ranks"] == ["0", "2"] and fields["training_job"] == "j7"
    assert fields["site"] == "train.py:42" and fields["path"] == "/shared/last.pt"


@pytest.fixture
def agent_log():
    """The agent's logfmt formatter on the ckptwatch.agent logger, into a string."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logformat.LogfmtFormatter())
    logger = logging.getLogger("ckptwatch.agent")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_collision_line_is_logfmt_with_path_and_job_as_fields(agent_log):
    """f503c65 logged msg="concurrent write collision on /ckpt/last.pt: 2 writers ... job j1":
    a log query for path= or training_job= found nothing."""
    ws = (write(11, 0, 0.0, 1.0), write(12, 1, 0.5, 1.5))
    LogExporter().publish_collision(Collision(path="/ckpt/run 1/last.pt", kind="concurrent",
                                              writes=ws, id="abc"))
    line = agent_log.getvalue()
    assert line.count("\n") == 1
    assert ' msg="concurrent write collision" kind=concurrent path="/ckpt/run 1/last.pt" ' \
           'writers=2 who="rank0@n1(pid 11),rank1@n1(pid 12)" overlap_seconds=0.50 ' \
           'call_sites="train.py:42 (save_checkpoint)" training_job=j1 scope=node id=abc\n' \
           in line


def test_control_characters_cannot_forge_log_lines(agent_log):
    """File names come from whoever can create files in a watched directory."""
    ws = (write(1, 0, 0.0, 1.0, path="/a\nlevel=error fake"), write(2, 1, 0.5, 1.0))
    exporter = LogExporter()
    exporter.publish_collision(Collision(path="/a\nlevel=error fake", kind="concurrent",
                                         writes=ws))
    exporter.publish_finding(Finding("torn_read", "/c/a.pt\r\x1b[2Kfake", writers=({"pid": 1},),
                                     details={"reader": {"pid": 8}}))
    lines = agent_log.getvalue().splitlines()
    assert len(lines) == 2
    assert 'path="/a\\nlevel=error fake"' in lines[0]
    assert 'path="/c/a.pt\\r\\x1b[2Kfake"' in lines[1] and "\x1b" not in lines[1]


def test_log_exporter_logs_collisions_and_findings_not_writes(caplog):
    exporter = LogExporter()
    ws = (write(11, 0, 0.0, 1.0), write(12, 1, 0.5, 1.5))
    with caplog.at_level(logging.WARNING, logger="ckptwatch.agent"):
        exporter.publish_write(ws[0])
        exporter.publish_collision(Collision(path="/ckpt/last.pt", kind="concurrent",
                                             writes=ws))
        exporter.publish_finding(Finding("verification", "/c/a.pt",
                                         details={"result": "gone"}))
        exporter.publish_finding(Finding("torn_read", "/c/a.pt", details={"reader": {}}))
    assert [r.getMessage() for r in caplog.records] == \
        ["concurrent write collision", "torn read"]
    assert caplog.records[0].fields["path"] == "/ckpt/last.pt"


def test_an_ok_file_that_needs_a_full_unpickle_gets_a_line_of_fields(caplog):
    # An ok torch file whose pickle names callables torch.load(weights_only=True) refuses:
    # one line, a fixed msg and the rest in fields like every other finding (this branch used
    # an undefined `path` and returned a bare string: NameError in the fan-out).
    unsafe = Finding("verification", "/c/a.pt", "j", details={
        "result": "ok", "pickle": "full_unpickle",
        "refused_globals": ["os.system", "evil\x1b[2J"] + [f"m.f{i}" for i in range(40)]})
    msg, fields = finding_fields(unsafe)
    assert msg == "checkpoint needs a full unpickle"
    assert fields["path"] == "/c/a.pt" and fields["training_job"] == "j"
    assert fields["refused_globals"][:2] == ["os.system", "evil\\x1b[2J"]
    assert len(fields["refused_globals"]) == MAX_WRITERS_LISTED
    assert "weights_only=False" in fields["what"]
    exporter = LogExporter()
    with caplog.at_level(logging.WARNING, logger="ckptwatch.agent"):
        exporter.publish_finding(unsafe)
    assert [r.getMessage() for r in caplog.records] == ["checkpoint needs a full unpickle"]
    assert caplog.records[0].fields["path"] == "/c/a.pt"
