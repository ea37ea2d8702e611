"""ckptwatch.events: the wire contract — encode/decode, every reject reason, framing, fixtures.

Golden fixtures in tests/fixtures/events/: valid/*.json must keep decoding unchanged forever;
invalid/<reason>__<name>.json must keep being rejected with that reason.
"""
import glob
import json
import os
import struct

import pytest

from helpers import REPO_ROOT
from ckptwatch import events
from ckptwatch.events import EventError, FrameReader, decode, encode, validate

FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures", "events")
VALID = sorted(glob.glob(os.path.join(FIXTURES, "valid", "*.json")))
INVALID = sorted(glob.glob(os.path.join(FIXTURES, "invalid", "*.json")))


def start(**over) -> dict:
    event = {"v": 1, "type": "start", "node": "n", "pid": 10, "seq": 1, "rank": 0,
             "path": "/c/x.pt", "site": "t.py:1", "func": "f", "wall": 1.5, "mono": 2.5}
    event.update(over)
    return event


def end(**over) -> dict:
    event = start(type="end", start_wall=1.0, start_mono=2.0, bytes=10, outcome="ok")
    event.update(over)
    return event


def payload(frame: bytes) -> bytes:
    (length,) = events.HEADER.unpack_from(frame)
    assert length == len(frame) - events.HEADER.size
    return frame[events.HEADER.size:]


def reason_of(func, *args) -> str:
    with pytest.raises(EventError) as info:
        func(*args)
    return info.value.reason


# ---- round trip ---------------------------------------------------------------------------

@pytest.mark.parametrize("event", [start(), end(), end(outcome="OSError", bytes=None),
                                   {"v": 1, "type": "dropped", "node": "n", "pid": 3,
                                    "count": 2},
                                   start(path="/ünïcode/路径.pt", job=None, master="h:1")])
def test_encode_decode_round_trip(event):
    assert decode(payload(encode(event))) == event


def test_encode_is_compact_json_with_length_header():
    frame = encode(start())
    assert frame[4:5] == b"{" and b", " not in frame and b": " not in frame
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4


def test_encode_refuses_oversized_and_nan():
    with pytest.raises(ValueError):
        encode(start(path="/" + "a" * events.MAX_FRAME_BYTES))
    with pytest.raises(ValueError):
        encode(start(wall=float("nan")))


# ---- every reject reason --------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"\xff\xfe", b"{not json", b"[1, 2]", b'"text"', b"null"])
def test_malformed(raw):
    assert reason_of(decode, raw) == events.REJECT_MALFORMED


def test_oversized_payload():
    assert reason_of(decode, b" " * (events.MAX_FRAME_BYTES + 1)) == events.REJECT_OVERSIZED


@pytest.mark.parametrize("version", [0, 2, 99])
def test_unknown_version(version):
    assert reason_of(validate, start(v=version)) == events.REJECT_UNKNOWN_VERSION


def test_version_of_another_type():
    assert reason_of(validate, start(v="1")) == events.REJECT_UNKNOWN_VERSION
    # Equal to 1 but not an int: a wrongly typed field, like any other.
    assert reason_of(validate, start(v=1.0)) == events.REJECT_INCOMPLETE
    assert reason_of(validate, start(v=True)) == events.REJECT_INCOMPLETE


def _without(event: dict, key: str) -> dict:
    event = dict(event)
    del event[key]
    return event


@pytest.mark.parametrize("event", [
    _without(start(), "v"),
    _without(start(), "pid"),
    _without(start(), "path"),
    _without(start(), "mono"),
    _without(end(), "outcome"),
    _without(end(), "start_mono"),
    start(pid=True),                 # a boolean is not a pid
    start(pid=0),
    start(pid="10"),
    start(rank="0"),
    start(rank=False),
    start(path="relative/x.pt"),
    start(type="middle"),
    start(wall="now"),
    end(bytes=1.5),
    {"v": 1, "type": "dropped", "node": "n", "pid": 3, "count": 0},
    {"v": 1, "type": "dropped", "node": "n", "pid": 3},
])
def test_incomplete(event):
    assert reason_of(validate, event) == events.REJECT_INCOMPLETE


def test_optional_fields_may_be_absent_or_null_and_extras_are_ignored():
    minimal = {k: v for k, v in start().items() if k in ("v", "type", "node", "pid", "seq",
                                                         "path", "wall", "mono")}
    assert validate(minimal) == minimal
    assert validate(start(rank=None, job=None, site=None)) is not None
    assert validate(start(future_field={"x": 1}))["future_field"] == {"x": 1}


def test_truncated_and_pid_mismatch_are_stream_level_reasons():
    # Neither can be seen in one payload: "truncated" is a close with FrameReader.pending(),
    # "pid_mismatch" a peer-credential check in the agent. Both are part of the label set.
    assert set(events.REJECT_REASONS) == {
        "malformed", "oversized", "unknown_version", "incomplete", "truncated",
        "pid_mismatch", "rate_limited"}
    reader = FrameReader()
    assert reader.feed(encode(start())[:7]) == []
    assert reader.pending() is True


# ---- FrameReader ----------------------------------------------------------------------------

def test_frame_reader_splits_many_frames_in_one_chunk():
    frames = [encode(start(seq=i)) for i in range(5)]
    reader = FrameReader()
    out = reader.feed(b"".join(frames))
    assert [decode(p)["seq"] for p in out] == list(range(5))
    assert reader.pending() is False


def test_frame_reader_byte_by_byte():
    first = encode(start(seq=1))
    stream = first + encode(end(seq=1))
    reader = FrameReader()
    out = []
    for i in range(len(stream)):
        out += reader.feed(stream[i:i + 1])
        at_boundary = i + 1 in (len(first), len(stream))
        assert reader.pending() is not at_boundary
    assert [decode(p)["type"] for p in out] == ["start", "end"]
    assert not reader.pending()


def test_frame_reader_partial_header_and_body():
    frame = encode(start())
    reader = FrameReader()
    assert reader.feed(frame[:2]) == []          # half a header
    assert reader.feed(frame[2:10]) == []        # header + part of body
    assert reader.feed(frame[10:] + frame[:3]) == [payload(frame)]
    assert reader.pending()                      # the next frame's first bytes


def test_frame_reader_zero_length_frame_is_a_malformed_payload():
    reader = FrameReader()
    (empty,) = reader.feed(struct.pack(">I", 0))
    assert reason_of(decode, empty) == events.REJECT_MALFORMED


def test_frame_reader_oversized_length_raises_after_good_frames():
    good = encode(start())
    reader = FrameReader(max_frame=1000)
    assert reader.feed(good) == [payload(good)]
    with pytest.raises(EventError) as info:
        reader.feed(struct.pack(">I", 1001) + b"x" * 10)
    assert info.value.reason == events.REJECT_OVERSIZED


def test_frame_reader_keeps_good_frames_that_precede_an_oversized_header_in_one_chunk():
    good = encode(start())
    reader = FrameReader(max_frame=1000)
    with pytest.raises(EventError) as info:
        reader.feed(good + good + struct.pack(">I", 1001))
    assert info.value.reason == events.REJECT_OVERSIZED
    assert info.value.payloads == [payload(good), payload(good)]


def test_frame_reader_default_limit_is_the_contract_limit():
    reader = FrameReader()
    limit_frame = struct.pack(">I", events.MAX_FRAME_BYTES) + b"x" * events.MAX_FRAME_BYTES
    assert len(reader.feed(limit_frame)) == 1
    with pytest.raises(EventError):
        reader.feed(struct.pack(">I", events.MAX_FRAME_BYTES + 1))


# ---- golden fixtures ------------------------------------------------------------------------

def test_there_are_golden_fixtures():
    kinds = {json.load(open(p))["type"] for p in VALID}
    assert kinds == {"start", "end", "dropped", "remote", "hazard", "jobscope"}
    assert INVALID


@pytest.mark.parametrize("path", VALID, ids=os.path.basename)
def test_golden_valid_fixture_decodes_unchanged(path):
    raw = open(path, "rb").read()
    event = decode(raw)
    assert event == json.loads(raw)
    assert decode(payload(encode(event))) == event


@pytest.mark.parametrize("path", INVALID, ids=os.path.basename)
def test_golden_invalid_fixture_keeps_its_reject_reason(path):
    expected = os.path.basename(path).split("__")[0]
    assert expected in events.REJECT_REASONS
    assert reason_of(decode, open(path, "rb").read()) == expected


def test_decode_many_matches_decode_one_by_one_whatever_is_mixed_in():
    from ckptwatch.events import decode_many
    good = [payload(encode(start(seq=i))) for i in range(5)]
    nasty = [b"", b" ", b"1,2", b"{}", b'{"v":2}', b"\xff\xfe", b"[", b"]", b"null",
             b'{"a":1},{"b":2}', payload(encode(start(pid=0)))]
    for bad in nasty:
        for position in (0, 2, 5):
            mixed = good[:position] + [bad] + good[position:]
            got = decode_many(mixed)
            assert len(got) == len(mixed)
            for item, raw in zip(got, mixed):
                try:
                    expected = decode(raw)
                except EventError as exc:
                    assert isinstance(item, EventError) and item.reason == exc.reason, (bad, raw)
                else:
                    assert item == expected, (bad, raw)
    assert decode_many(good) == [decode(p) for p in good]
    assert decode_many([]) == []


def test_decode_many_does_not_glue_two_broken_payloads_into_valid_ones():
    """Found by fuzzing: decode_many parsed "[p1,p2,...]" at once, so two payloads that are
    each invalid JSON could join into two valid values (`{"a":1},{"b":[1` + `2]}`), and two
    half-events into two whole ones; each payload must stand alone."""
    from ckptwatch.events import decode_many
    glued = [b'{"a":1},{"b":[1', b'2]}']
    got = decode_many(glued)
    assert [getattr(r, "reason", None) for r in got] == [events.REJECT_MALFORMED] * 2
    # The same trick with events: neither half is a valid event on its own.
    whole = payload(encode(start(seq=1)))
    first, second = whole[:-1] + b'},{"v":1,"type":"start","node":"n","pid":7' , \
        b'"seq":2,"path":"/c.pt","wall":1.0,"mono":2.0}'
    assert [getattr(r, "reason", None) for r in decode_many([first, second])] == \
        [events.REJECT_MALFORMED] * 2
