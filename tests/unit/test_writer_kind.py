"""The events' `writer` field on the agent's side: typed by the contract, bounded to the known
kinds by the detector, carried into writes, collisions, journal records and the report --
and nothing a sender puts there comes out as sent (hostile values)."""
import json
import os

import pytest

from helpers import wait_for
from wire import Recorder, connect, end_event, start_event
from ckptwatch import events
from monitor.cli.report import render_collision
from monitor.detect.detector import Detector
from monitor.detect.model import Collision, Write
from monitor.ingest.server import IngestServer

HOSTILE_STRINGS = ["x" * 60_000, "safetensors\n\x1b[31mFAKE", "../../etc/passwd", "",
                   "TORCH.SAVE", "dcp "]


@pytest.fixture
def server(sockdir, no_thread_leak):
    rec = Recorder()
    srv = IngestServer(os.path.join(sockdir, "agent.sock"), rec.on_events, rec.on_reject)
    srv.start()
    srv.rec = rec
    yield srv
    srv.stop()


def test_a_writer_that_is_not_a_string_is_rejected_a_string_is_delivered(server):
    frames = [events.encode(start_event(seq=1, writer=123)),
              events.encode(start_event(seq=2, writer=["dcp"])),
              events.encode(start_event(seq=3, writer={"k": "v"})),
              events.encode(start_event(seq=4, writer=True)),
              events.encode(end_event(seq=5, writer=1.5))]
    frames += [events.encode(start_event(seq=10 + i, writer=w))
               for i, w in enumerate(HOSTILE_STRINGS + ["safetensors", None])]
    with connect(server.path) as sock:
        sock.sendall(b"".join(frames))
        wait_for(lambda: len(server.rec.events) + len(server.rec.rejects) == len(frames))
    assert server.rec.rejects == [events.REJECT_INCOMPLETE] * 5
    assert [e["seq"] for e in server.rec.events] == list(range(10, 10 + len(HOSTILE_STRINGS) + 2))


def _start(pid, seq, mono, writer):
    event = {"v": 1, "type": "start", "node": "n1", "pid": pid, "seq": seq,
             "path": "/ckpt/model.safetensors", "wall": 1e9 + mono, "mono": mono, "rank": pid,
             "job": "j", "restart": 0, "site": "train.py:1", "func": "f"}
    if writer is not None:
        event["writer"] = writer
    return event


def _end(pid, seq, mono, start_mono, writer):
    event = _start(pid, seq, mono, writer)
    event.update(type="end", start_wall=1e9 + start_mono, start_mono=start_mono, bytes=10,
                 outcome="ok")
    return event


@pytest.mark.parametrize("sent, kept", [("safetensors", "safetensors"), ("dcp", "dcp"),
                                        ("fsspec", "fsspec"), ("torch.save", "torch.save"),
                                        (None, None)]
                         + [(h, "other") for h in HOSTILE_STRINGS])
def test_the_detector_keeps_a_known_kind_and_calls_anything_else_other(sent, kept):
    now = [100.0]
    det = Detector(clock=lambda: now[0], wall_clock=lambda: 1e9 + now[0], settle=0.0)
    out = []
    # Two processes overlapping on one path: one collision naming both writes.
    out += det.observe(_start(11, 1, 100.0, sent))
    out += det.observe(_start(12, 1, 100.1, "safetensors"))
    now[0] = 100.5
    out += det.observe(_end(11, 1, 100.4, 100.0, sent))
    out += det.observe(_end(12, 1, 100.5, 100.1, "safetensors"))
    now[0] = 200.0
    out += det.tick()
    writes = [o for o in out if isinstance(o, Write)]
    (collision,) = [o for o in out if isinstance(o, Collision)]
    assert sorted(w.writer_kind or "-" for w in writes) == sorted([kept or "-", "safetensors"])
    assert sorted(w.writer_kind or "-" for w in collision.writes) == sorted(
        [kept or "-", "safetensors"])
    # The journal record carries the bounded kind, and a record read back keeps it.
    record = next(w for w in writes if w.writer.pid == 11).to_record()
    assert record.get("writer") == kept
    assert Write.from_record(json.loads(json.dumps(record))).writer_kind == kept
    # The report names the libraries, never a hostile text as sent.
    text = "\n".join(render_collision(collision, width=100))
    shown = sorted({kept or "torch.save", "safetensors"})
    assert f"written with: {', '.join(shown)}" in text
    for hostile in HOSTILE_STRINGS:
        if hostile and hostile not in ("dcp ",):
            assert hostile not in text


def test_a_record_with_a_hostile_writer_reads_back_bounded():
    record = {"node": "n", "pid": 1, "path": "/p", "start_wall": 1.0, "writer": "<script>"}
    assert Write.from_record(record).writer_kind == "other"
    assert Write.from_record(dict(record, writer=["dcp"])).writer_kind is None
