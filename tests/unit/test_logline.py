"""The WARNING line per collision and per finding."""
import logging

from exporters.logline import MAX_WRITERS_LISTED, LogExporter, collision_message, finding_message
from monitor.detect.model import Collision, Finding, Write, Writer


def write(pid, rank, start, end, node="n1", site="train.py:42", func="save_checkpoint",
          path="/ckpt/last.pt", job="j1"):
    return Write(writer=Writer(node=node, pid=pid, rank=rank, job=job), path=path, seq=1,
                 start_wall=start, start_mono=start, end_wall=end, end_mono=end, bytes=10,
                 outcome="ok", site=site, func=func)


def test_concurrent_message_names_path_writers_overlap_and_sites():
    ws = tuple(write(11 + r, r, 10.0 + r * 0.25, 11.0 + r * 0.25) for r in range(4))
    c = Collision(path="/ckpt/last.pt", kind="concurrent", writes=ws, id="abc")
    msg = collision_message(c)
    assert msg.startswith("concurrent write collision on /ckpt/last.pt: 4 writers "
                          "rank0@n1(pid 11), rank1@n1(pid 12), rank2@n1(pid 13), "
                          "rank3@n1(pid 14) overlapping 1.25s; ")  # 10.25 .. 11.5
    assert "call sites: train.py:42 (save_checkpoint);" in msg   # deduplicated
    assert msg.endswith("; job j1; id abc")
    assert "\n" not in msg


def test_redundant_message_and_unknown_ranks_and_several_sites():
    ws = (write(7, None, 0.0, 1.0, site="a.py:1", func=None),
          write(8, None, 2.0, 3.5, node="n2", site="b.py:2", func="f"))
    c = Collision(path="/x.pt", kind="redundant", writes=ws)
    msg = collision_message(c)
    assert msg.startswith("redundant write collision on /x.pt: 2 writers pid 7@n1, pid 8@n2 "
                          "one after another over 3.50s; call sites: a.py:1, b.py:2 (f)")


def test_control_characters_cannot_forge_log_lines():
    ws = (write(1, 0, 0.0, 1.0, path="/a\nWARNING fake"), write(2, 1, 0.5, 1.0))
    c = Collision(path="/a\nWARNING fake", kind="concurrent", writes=ws)
    msg = collision_message(c)
    assert "\n" not in msg and "/a\\nWARNING fake" in msg


def test_many_writers_are_capped():
    ws = tuple(write(100 + r, r, r * 0.01, 5.0) for r in range(40))
    msg = collision_message(Collision(path="/p", kind="concurrent", writes=ws))
    assert "40 writers" in msg and f"and {40 - MAX_WRITERS_LISTED} more" in msg
    assert "rank39@" not in msg


def test_finding_messages_size_fluctuation_torn_read_and_corrupt():
    fluct = Finding("size_fluctuation", "/c/a.pt", "j", writers=(
        {"pid": 11, "rank": 0}, {"pid": 12, "rank": None}),
        details={"size_before": 4000, "size_after": 0})
    assert finding_message(fluct) == ("size fluctuation on /c/a.pt: shrank from 4000 to 0 "
                                      "bytes while written by rank0(11), pid(12)")
    ruled = Finding("size_fluctuation", "/c/a.pt", writers=({"pid": 11, "rank": 0},),
                    details={"rule": "finished sizes differ", "size_before": 10,
                             "size_after": 9})
    assert finding_message(ruled) == ("size fluctuation on /c/a.pt: finished sizes differ "
                                      "(10 then 9 bytes) by rank0(11)")
    torn = Finding("torn_read", "/c/a.pt", writers=({"pid": 1, "rank": 3},),
                   details={"reader": {"pid": 8}})
    assert finding_message(torn) == ("torn read of /c/a.pt: pid 8 opened it for reading "
                                     "while rank3(1) wrote it")
    corrupt = Finding("verification", "/c/a.pt", details={
        "result": "corrupt", "reason": "truncated zip", "cause": "truncated",
        "collision_id": "abc"})
    assert finding_message(corrupt) == ("corrupt checkpoint /c/a.pt: truncated zip "
                                        "[truncated] (written by collision abc)")
    # A verification that found nothing is counted, not logged.
    assert finding_message(Finding("verification", "/c/a.pt", details={"result": "ok"})) is None


def test_a_file_name_cannot_forge_a_finding_log_line():
    """File names come from whoever can create files in a watched directory."""
    torn = Finding("torn_read", "/c/a.pt\nERROR fake line", writers=({"pid": 1},),
                   details={"reader": {"pid": 8}})
    assert "\n" not in finding_message(torn) and "a.pt\\nERROR" in finding_message(torn)


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
    assert [r.getMessage().split(" on ")[0].split(" of ")[0] for r in caplog.records] == \
        ["concurrent write collision", "torn read"]
