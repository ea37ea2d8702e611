"""monitor.ingest.codec: the agent's fast decoder agrees with the contract's reference decoder
(ckptwatch.events) on every payload -- the same event, or the same reject reason.

Agreement means the same repr: key order, int vs float vs bool and NaN all count. The
decoder-level reasons are malformed, oversized, unknown_version and incomplete; truncated and
pid_mismatch are decided by the framing and the socket (monitor/ingest/server.py), not by a decoder.
"""
from __future__ import annotations

import glob
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptwatch import events
from helpers import REPO_ROOT
from monitor.ingest import codec

FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures", "events")
GOLDEN = sorted(glob.glob(os.path.join(FIXTURES, "*", "*.json")))
DECODER_REASONS = {events.REJECT_MALFORMED, events.REJECT_OVERSIZED,
                   events.REJECT_UNKNOWN_VERSION, events.REJECT_INCOMPLETE}
CHECK = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

needs_orjson = pytest.mark.skipif(codec.orjson is None,
                                  reason="orjson not installed: the agent uses the reference")


def reference(payload: bytes):
    try:
        return events.decode(payload)
    except events.EventError as exc:
        return exc


def verdict(result) -> str:
    """What must agree: the reject reason, or the decoded event exactly."""
    if isinstance(result, events.EventError):
        return "reject:" + result.reason
    return "event:" + repr(result)


def assert_agree(payloads: list) -> list:
    fast = codec.decode_many(payloads)
    assert [verdict(r) for r in fast] == [verdict(reference(p)) for p in payloads]
    # ... and so do the stdlib paths: the agent's without orjson, and the reference's batch.
    assert [verdict(r) for r in codec._decode_many_json(payloads)] == [verdict(r) for r in fast]
    assert [verdict(r) for r in events.decode_many(payloads)] == [verdict(r) for r in fast]
    return fast


def start(**over) -> dict:
    event = {"v": 1, "type": "start", "node": "n", "pid": 10, "seq": 1, "rank": 0,
             "local_rank": 0, "world_size": 2, "job": "j", "path": "/c/x.pt",
             "site": "t.py:1", "func": "f", "wall": 1764460800.123456, "mono": 2.5}
    event.update(over)
    return event


def end(**over) -> dict:
    event = start(type="end", start_wall=1764460800.0, start_mono=2.0, bytes=10,
                  outcome="ok")
    event.update(over)
    return event


def raw(event: dict) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode()


@needs_orjson
def test_golden_fixtures_decode_identically():
    assert GOLDEN
    results = assert_agree([open(p, "rb").read() for p in GOLDEN])
    for path, result in zip(GOLDEN, results):
        if os.path.basename(os.path.dirname(path)) == "invalid":
            assert result.reason == os.path.basename(path).split("__")[0]
        else:
            assert type(result) is dict


# Where orjson's JSON differs from the standard library's: each must still agree.
EDGES = [
    raw(start(wall=float("nan"))).replace(b"NaN", b"NaN"),     # stdlib accepts NaN
    raw(start()).replace(b'"mono":2.5', b'"mono":Infinity'),
    raw(start()).replace(b'"mono":2.5', b'"mono":1e400'),     # overflows a double
    raw(start()).replace(b'"mono":2.5', b'"mono":18446744073709551617'),   # > 64 bits
    raw(start()).replace(b'"mono":2.5', b'"mono":-9223372036854775809'),
    raw(start()).replace(b'"pid":10', b'"pid":18446744073709551626'),
    raw(start(extra=1)).replace(b'"extra":1', b'"extra":123456789012345678901234567890'),
    raw(start(job="x")).replace(b'"job":"x"', b'"job":"\\ud800"'),        # lone surrogate
    raw(start(extra="\U0001f600 \u00e9 \\ \" \x7f")),
    raw(start(extra=[[[1]]], more={"a": {"b": None}})),
    raw(start(extra=0)).replace(b'"extra":0', b'"extra":' + b"[" * 1000 + b"]" * 1000),
    raw(start(extra=0)).replace(b'"extra":0', b'"extra":' + b"[" * 1020 + b"]" * 1020),
    raw(start(extra=0)).replace(b'"extra":0', b'"extra":' + b"[" * 3000 + b"]" * 3000),
    b'{"v":1,"v":1,' + raw(start())[1:],                         # duplicate keys
    raw(start()) + b" ", b" " + raw(start()), b"\xef\xbb\xbf" + raw(start()),
    raw(start()).replace(b'"pid":10', b'"pid":true'),
    raw(start()).replace(b'"pid":10', b'"pid":10.0'),
    raw(start()).replace(b'"v":1', b'"v":1.0'),
    raw(start()).replace(b'"mono":2.5', b'"mono":-0'),
    raw(start()).replace(b'"mono":2.5', b'"mono":4.9e-324'),
    raw(end(bytes=None)), raw(end(outcome="OSError")), raw(start(path="/ünïcode/路径.pt")),
    raw({"v": 1, "type": "dropped", "node": "n", "pid": 3, "count": 2}),
    raw({"v": 1, "type": "dropped", "node": "n", "pid": 3, "count": 0}),
    raw(start(type=["start"])), raw(start(type={"a": 1})),
    raw(start(path="rel.pt")), raw(start(pid=0)), raw(start(v=2)),
    b"", b"null", b"[]", b"1", b'"s"', b"{", b"\xff", b"{}" * 3,
    raw(start(pad="x" * events.MAX_FRAME_BYTES)),
    # json reads NaN and Infinity (orjson does not): a non-finite time is rejected either way.
    raw(start()).replace(b'"mono":2.5', b'"mono":NaN'),
    raw(start()).replace(b'"wall":', b'"wall":-Infinity,"x":'),
    raw(end()).replace(b'"start_mono":', b'"start_mono":Infinity,"y":'),
]


@needs_orjson
def test_agree_where_the_json_parsers_differ():
    results = assert_agree(EDGES)
    seen = {r.reason for r in results if isinstance(r, events.EventError)}
    assert seen == DECODER_REASONS


@needs_orjson
def test_the_same_shape_with_bad_values_is_still_rejected_after_good_ones():
    """The accepted type combinations are memoised: a payload of a known shape with a bad
    value (v 2, pid 0, relative path) must still get the reference's verdict."""
    good = [raw(start()), raw(end())] * 3
    bad = [raw(start(v=2)), raw(start(pid=0)), raw(end(pid=-4)), raw(start(path="x.pt")),
           raw(end(path=""))]
    results = assert_agree(good + bad + good)
    assert [type(r) is dict for r in results] == [True] * 6 + [False] * 5 + [True] * 6


def test_a_known_shape_with_a_non_finite_time_is_rejected_without_orjson(monkeypatch):
    # The json fallback reads NaN; the memo knows the shape from good events, so the memo's
    # own check must catch it (a NaN time once killed the agent's loop: detector.tick()).
    monkeypatch.setattr(codec, "orjson", None)
    good = raw(start())
    nan = good.replace(b'"mono":2.5', b'"mono":NaN')
    inf_end = raw(end()).replace(b'"start_mono":', b'"start_mono":Infinity,"y":')
    results = codec.decode_many([good, nan, raw(end()), inf_end, good])
    assert [type(r) is dict for r in results] == [True, False, True, False, True]
    assert {r.reason for r in results if type(r) is not dict} == {events.REJECT_INCOMPLETE}


def test_a_known_shape_follows_the_contracts_schema_version(monkeypatch):
    """The memo's value checks are the contract's rules (events.write_values_valid), not a
    copy: with the schema version moved on, a version-1 event of a shape the memo knows is
    the reference's unknown_version, and the new version's is accepted."""
    for kind in (start, end):
        v1 = kind()
        assert codec.validate(dict(v1)) == v1                 # the shape is memoised now
        monkeypatch.setattr(events, "SCHEMA_VERSION", 2)
        with pytest.raises(events.EventError) as rejected:
            codec.validate(dict(v1))
        assert rejected.value.reason == events.REJECT_UNKNOWN_VERSION
        assert codec.validate(kind(v=2)) == kind(v=2)
        monkeypatch.undo()


@needs_orjson
def test_memo_is_bounded_against_invented_shapes():
    before = {kind: set(shapes) for kind, shapes in codec._ACCEPTED.items()}
    try:
        variants = []
        for bits in range(2 ** 6):      # every None/int mix of the six optional int fields
            fields = ("rank", "local_rank", "world_size", "local_world_size", "node_rank",
                      "restart")
            variants.append(raw(start(**{f: (None if bits >> i & 1 else i)
                                         for i, f in enumerate(fields)})))
        for kind in codec._ACCEPTED:
            codec._ACCEPTED[kind].clear()
        limit = codec.MAX_SHAPES
        codec.MAX_SHAPES = 10
        try:
            assert all(type(r) is dict for r in assert_agree(variants))
        finally:
            codec.MAX_SHAPES = limit
        assert len(codec._ACCEPTED["start"]) == 10
    finally:
        codec._ACCEPTED.update(before)


json_scalars = (st.none() | st.booleans() | st.integers() | st.floats()
                | st.integers(-2 ** 70, 2 ** 70) | st.text(max_size=12))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                   max_size=4),
    max_leaves=6)
FIELD_NAMES = ("v", "type", "node", "pid", "seq", "path", "wall", "mono", "start_wall",
               "start_mono", "rank", "local_rank", "world_size", "local_world_size",
               "node_rank", "restart", "job", "master", "site", "func", "outcome", "bytes",
               "count", "extra")
odd_values = (json_values | st.sampled_from([0, -1, 1, 2, 1.0, True, False, None, "", "start",
                                             "end", "dropped", "/", "rel.pt", 2 ** 64 + 3,
                                             -2 ** 63 - 1, float("nan")]))
valid_events = st.builds(
    lambda kind, pid, rank, job, wall, seq, path, nbytes, extra: (
        start(pid=pid, rank=rank, job=job, wall=wall, seq=seq, path=path, **extra)
        if kind == "start" else
        end(pid=pid, rank=rank, job=job, wall=wall, seq=seq, path=path, bytes=nbytes,
            **extra)),
    st.sampled_from(["start", "end"]), st.integers(1, 2 ** 63), st.none() | st.integers(),
    st.none() | st.text(max_size=10), st.floats() | st.integers(), st.integers(),
    st.text(max_size=10).map(lambda t: "/" + t), st.none() | st.integers(0, 2 ** 70),
    st.dictionaries(st.sampled_from(["x", "note", "k"]), json_values, max_size=2))
# A valid event with up to three fields replaced by odd values or removed: every reason, and
# the near misses where a fast path would go wrong.
generated_events = st.builds(
    lambda event, changes: {**{k: v for k, v in event.items()
                               if k not in {name for name, value, drop in changes if drop}},
                            **{name: value for name, value, drop in changes if not drop}},
    valid_events,
    st.lists(st.tuples(st.sampled_from(FIELD_NAMES), odd_values, st.booleans()), max_size=3))


def encoded(event: dict) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass")


# One branch per verdict, so every reason is drawn whatever hypothesis favours.
any_payload = st.one_of(
    valid_events.map(encoded),
    generated_events.map(encoded),                                  # mostly incomplete
    st.builds(lambda e, v: encoded({**e, "v": v}), valid_events,
              st.integers().filter(lambda v: v != 1) | st.text(max_size=3)),  # unknown_version
    generated_events.map(encoded).flatmap(                          # malformed: cut short
        lambda p: st.integers(0, max(0, len(p) - 1)).map(lambda i: p[:i])),
    st.binary(max_size=120),
    valid_events.map(lambda e: encoded({**e, "pad": "x" * events.MAX_FRAME_BYTES})),
)


@needs_orjson
@CHECK
@given(st.lists(any_payload, min_size=1, max_size=6))
def test_agree_on_generated_events(payloads):
    assert_agree(payloads)


def test_generated_events_reach_every_decoder_reason():
    """The generator above is not vacuous: it draws valid events and every reason."""
    seen = set()

    @CHECK
    @given(any_payload)
    def collect(payload):
        result = reference(payload)
        seen.add(result.reason if isinstance(result, events.EventError) else "valid")
    collect()
    assert seen == DECODER_REASONS | {"valid"}


def test_without_orjson_the_agent_decodes_with_the_reference(monkeypatch):
    """orjson is optional: without it decode_many is the reference's, verdict for verdict."""
    monkeypatch.setattr(codec, "orjson", None)
    payloads = EDGES + [open(p, "rb").read() for p in GOLDEN]
    for batch in (payloads, [b"\xff"] + payloads, payloads[::-1]):
        assert [verdict(r) for r in codec.decode_many(batch)] == \
            [verdict(reference(p)) for p in batch]


@pytest.mark.parametrize("with_orjson", [True, False])
def test_rejects_leave_no_garbage_for_the_cyclic_collector(monkeypatch, with_orjson):
    """A reject is counted by its reason and dropped: nothing may keep it (and the frames its
    traceback holds) in a reference cycle, which only the cyclic collector frees. A flood of
    garbage frames is all rejects, and the agent lets that collector wait (monitor/gcpolicy)."""
    import gc

    if not with_orjson:
        monkeypatch.setattr(codec, "orjson", None)
    bad = [b'{"v":1,"type":"start"', b"[1,2,3]", b"\xff\xfe not utf-8", b"{}", b"NaN",
           b'{"v":1,"type":"start","node":"n","pid":5,"seq":1}',
           b'{"v":99,"type":"start","node":"n","pid":5}', b'{"v":1,"type":"nope"}',
           b'{"v":1,"type":"start","pid":-1}', b"x" * (events.MAX_FRAME_BYTES + 1)]
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        results = codec.decode_many(bad * 10)
        assert all(isinstance(r, events.EventError) for r in results)
        del results
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
