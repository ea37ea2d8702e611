"""Bounded fuzzing of what the agent reads from strangers: the event decoder (socket frames)
and the checkpoint verifier (files). Hypothesis, derandomized (the same examples every run, so
CI is stable), a few hundred examples per target, the whole file in well under a minute.

Properties: nothing raises but the documented error types; verdicts and reject reasons come
from their documented sets; memory stays under a bound (a subset runs in a child process with
an address-space cap and its peak RSS measured). Every crash or blow-up found here is a named
regression test below the fuzz targets.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import corpus
from ckptwatch import events
from helpers import subprocess_env
from monitor.verify import integrity, picklescan

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STATUSES = (integrity.OK, integrity.CORRUPT, integrity.UNVERIFIABLE)


# ---------------------------------------------------------------------------- event decoder

def _check_decoded(result):
    if isinstance(result, events.EventError):
        assert result.reason in events.REJECT_REASONS
    else:
        assert type(result) is dict and events.validate(result) is result


def _decode(payload: bytes):
    try:
        return events.decode(payload)
    except events.EventError as exc:
        return exc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                   max_size=5),
    max_leaves=8)
event_fields = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, 1.0, True, "1"]),
     "type": st.sampled_from(["start", "end", "dropped", "other", 3]),
     "node": st.sampled_from(["n1", "", 5]), "pid": st.integers(-2, 2 ** 70)},
    optional={"seq": st.integers(), "path": st.sampled_from(["/a/b.pt", "rel.pt", "", None]),
              "wall": st.floats(), "mono": st.floats() | st.integers(),
              "rank": st.none() | st.integers() | st.booleans(), "job": json_values,
              "start_wall": st.floats(), "start_mono": st.floats(),
              "outcome": st.sampled_from(["ok", "OSError", 1]), "bytes": json_values,
              "count": st.integers(-1, 3), "extra": json_values})


@FUZZ
@given(st.binary(max_size=600))
def test_decode_arbitrary_bytes(payload):
    _check_decoded(_decode(payload))


@FUZZ
@given(event_fields)
def test_decode_event_shaped_objects(event):
    payload = json.dumps(event).encode()
    _check_decoded(_decode(payload))


@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=80),
                          event_fields.map(lambda e: json.dumps(e).encode())), max_size=8))
def test_decode_many_agrees_in_length_and_kinds(payloads):
    results = events.decode_many(payloads)
    assert len(results) == len(payloads)
    for result in results:
        _check_decoded(result)


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=12), st.integers(16, 4096))
def test_frame_reader_bounds_its_buffer(chunks, max_frame):
    reader = events.FrameReader(max_frame=max_frame)
    for chunk in chunks:
        try:
            payloads = reader.feed(chunk)
        except events.EventError as exc:
            assert exc.reason == events.REJECT_OVERSIZED
            return
        assert all(len(p) <= max_frame for p in payloads)
        # What is buffered is at most one partial frame.
        assert len(reader._buf) < events.HEADER.size + max_frame


# ---------------------------------------------------------------------------- notices (hook)

hostile_text = st.text(alphabet=st.characters(codec=None, exclude_categories=["Cs"]),
                       max_size=40) | st.sampled_from(["/dev/zero:1", "\x1b[2J", "a\nb",
                                                      "/etc/shadow:7", "\u202e", ""])
notice_fields = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 2]), "type": st.sampled_from(["notice", "notice", "ack"])},
    optional={"kind": hostile_text | json_values, "path": hostile_text | json_values,
              "site": hostile_text | json_values, "id": hostile_text | json_values,
              "others": st.lists(st.fixed_dictionaries(
                  {}, optional={"rank": st.none() | st.integers() | st.booleans(),
                                "pid": st.none() | st.integers(), "node": hostile_text,
                                "site": hostile_text}), max_size=20) | json_values})


@FUZZ
@given(notice_fields)
def test_any_notice_gives_one_bounded_printable_line_and_opens_nothing(notice):
    """What the agent (or whatever CKPTWATCH_SOCKET names) sends the hook: decoded or
    refused, and a decoded one becomes one line of printable text of bounded length that
    names no file (no site is this process's own here)."""
    from ckptwatch import policy
    kind, value = events.decode_agent_frame(json.dumps(notice).encode())
    assert kind in ("notice", "ack", None)
    if kind != "notice":
        return
    text = policy.describe(value.get("site"), value)
    assert text.isprintable()
    assert len(text) < 32 * policy.MAX_SHOWN
    assert policy._where(value.get("site")) == (policy.NOWHERE, 0)


def test_deeply_nested_frame_is_malformed_not_a_crash():
    """Found by fuzzing: a 64 KiB frame of '[' made json raise RecursionError, which escaped
    decode() and decode_many() (neither a ValueError nor an EventError) into the agent's
    ingest loop."""
    deep = b"[" * (events.MAX_FRAME_BYTES - 1)
    assert _decode(deep).reason == events.REJECT_MALFORMED
    results = events.decode_many([deep, b'{"v": 1}'])
    assert [r.reason for r in results] == [events.REJECT_MALFORMED, events.REJECT_INCOMPLETE]


# ---------------------------------------------------------------------------- checkpoints

_SMALL = {}


def _small_checkpoints() -> dict:
    """A few real, small torch and safetensors files (made once per run)."""
    if not _SMALL:
        import torch
        directory = tempfile.mkdtemp(prefix="ckptfuzz")
        objs = {"dict.pt": ({"w": torch.arange(6, dtype=torch.float32), "n": 3,
                             "s": torch.ones(2, 2)[:, 0]}, {}),
                "p4.pt": ([torch.zeros(3, dtype=torch.int16)], {"pickle_protocol": 4}),
                "legacy.pt": ({"w": torch.arange(4)}, {"_use_new_zipfile_serialization":
                                                      False})}
        for name, (obj, kwargs) in objs.items():
            torch.save(obj, os.path.join(directory, name), **kwargs)
        header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
        with open(os.path.join(directory, "t.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header.encode() + bytes(8))
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                _SMALL[name] = f.read()
    return _SMALL


def _verify_bytes(data: bytes, suffix: str = ".pt", deep: bool = True):
    with tempfile.NamedTemporaryFile(suffix=suffix) as f:
        f.write(data)
        f.flush()
        return integrity.verify(f.name, deep=deep)


def _check_verdict(v):
    assert v.status in STATUSES
    assert not v.reason.startswith("verifier error"), v
    if v.status == integrity.CORRUPT:
        assert v.details["cause"] in integrity.CAUSES, v


mutation = st.tuples(st.sampled_from(["overwrite", "insert", "delete", "truncate"]),
                     st.floats(0, 1), st.binary(min_size=1, max_size=16))


@pytest.mark.torch
@FUZZ
@given(st.sampled_from(["dict.pt", "p4.pt", "legacy.pt", "t.safetensors"]),
       st.lists(mutation, min_size=1, max_size=4))
def test_verify_mutated_real_checkpoints(name, mutations):
    data = bytearray(_small_checkpoints()[name])
    for kind, where, blob in mutations:
        pos = int(where * len(data))
        if kind == "overwrite":
            data[pos:pos + len(blob)] = blob
        elif kind == "insert":
            data[pos:pos] = blob
        elif kind == "delete":
            del data[pos:pos + len(blob)]
        else:
            del data[pos:]
    _check_verdict(_verify_bytes(bytes(data), os.path.splitext(name)[1]))


# Pickle opcodes with arguments chosen to stress the readers: memo numbers anywhere in their
# range, lengths past the end, deep nesting, every construction opcode.
_ops = st.one_of(
    st.sampled_from([b"N", b"(", b"t", b"\x85", b"\x86", b"\x87", b"]", b"}", b"\x8f",
                     b"e", b"u", b"s", b"a", b"R", b"b", b"0", b"2", b"\x81", b"\x93",
                     b"Q", b")", b"\x94", b"1", b"\x88", b"\x89", b"l", b"d", b"\x90"]),
    st.integers(0, 2 ** 32 - 1).map(lambda n: b"r" + struct.pack("<I", n)),
    st.integers(0, 2 ** 32 - 1).map(lambda n: b"j" + struct.pack("<I", n)),
    st.integers(0, 255).map(lambda n: b"q" + bytes([n])),
    st.integers(0, 255).map(lambda n: b"h" + bytes([n])),
    st.integers(0, 10 ** 12).map(lambda n: b"p%d\n" % n),
    st.integers(0, 2 ** 32 - 1).map(lambda n: b"X" + struct.pack("<I", n) + b"storage"),
    st.integers(0, 2 ** 64 - 1).map(lambda n: b"\x8e" + struct.pack("<Q", n) + b"ab"),
    st.integers(0, 2 ** 64 - 1).map(lambda n: b"\x95" + struct.pack("<Q", n)),
    st.text(max_size=12).map(lambda s: b"\x8c" + bytes([len(s.encode())]) + s.encode()),
    st.just(b"\x8c\x07storage"), st.just(b"\x8c\x0ctorch\nFloatStorage"[:0] +
                                           b"ctorch\nFloatStorage\n"),
    st.integers(-2 ** 31, 2 ** 31 - 1).map(lambda n: b"J" + struct.pack("<i", n)),
    # BINSTRING's length is signed: a negative one must end the check, not loop it
    st.integers(-2 ** 31, 64).map(lambda n: b"T" + struct.pack("<i", n)),
    # globals, as GLOBAL, INST, STACK_GLOBAL and extension codes (issue 17 item 7)
    st.sampled_from([b"cposix\nsystem\n", b"i__builtin__\neval\n", b"\x93",
                     b"\x82\x01", b"\x83\x01\x00", b"\x84\x01\x00\x00\x00",
                     b"ctorch._utils\n_rebuild_tensor_v2\n", b"c\x1b[2J\n\xff\n"]),
)
pickles = st.lists(_ops, max_size=40).map(lambda ops: b"\x80\x02" + b"".join(ops) + b".")


@FUZZ
@given(pickles)
def test_pickle_readers_raise_only_documented_errors(data):
    try:
        found, names = picklescan.pickle_names(data)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError,
            picklescan.BeyondBudget):
        return
    assert isinstance(found, dict)
    # The globals a verdict may list: bounded, strings, and judged by the allowlist.
    assert len(names) <= picklescan.MAX_GLOBALS + 1
    assert all(isinstance(n, str) and len(n) <= 2 * picklescan.MAX_GLOBAL_TEXT + 1
               for n in names)
    from monitor.verify import loadable
    assert set(loadable.refused(names)) <= names


@FUZZ
@given(pickles)
def test_verify_torch_zip_around_any_pickle(data):
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        f.write(corpus.torch_zip_bytes(data, extra={"data/0": b"\0" * 8}))
        f.flush()
        v = integrity.verify(f.name)
    _check_verdict(v)
    if v.status == integrity.OK:
        # Only a pickle a real pickler could have written passes: memo numbers in order.
        assert picklescan._fits_fast_reader(data) or _careful_accepts(data)


def _careful_accepts(data: bytes) -> bool:
    try:
        picklescan.scan_pickle(data)
        return True
    except Exception:
        return False


@pytest.mark.torch
@FUZZ
@given(st.binary(min_size=0, max_size=400))
def test_verify_zip_records_from_arbitrary_directory_bytes(blob):
    """A real torch zip whose central directory is replaced by arbitrary bytes of the same
    length (counts, sizes, name lengths, extra fields all attacker-chosen)."""
    data = bytearray(_small_checkpoints()["dict.pt"])
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    if cd_offset == 0xFFFFFFFF:         # zip64: the directory offset is in the zip64 record
        cd_offset = struct.unpack_from("<Q", data, data.rfind(b"PK\x06\x06") + 48)[0]
    patch = (blob * (cd_size // max(1, len(blob)) + 1))[:cd_size] if blob else b""
    data[cd_offset:cd_offset + len(patch)] = patch
    _check_verdict(_verify_bytes(bytes(data)))


# ---------------------------------------------------------------------------- memory bound

_HOSTILE_SCRIPT = r"""
import os, struct, sys, tempfile, json
sys.path.insert(0, sys.argv[1])
import corpus
from monitor.verify import integrity, picklescan, safetensorsfile
d = tempfile.mkdtemp()
def write(name, data):
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(data)
    return path
fast = picklescan.FAST_MAX_BYTES
tokens = b"".join(b"\x8c\x02" + struct.pack("<H", i) for i in range(65536))
files = {
    # the C reader's worst amplifier (EMPTY_SET, ~240 B per byte) just under its size cap
    "sets_fast.pt": lambda: corpus.torch_zip_bytes(b"\x80\x04" + b"\x8f" * (fast - 3) + b"."),
    # the same past the cap: the careful reader, until its budget stops it
    "sets_careful.pt": lambda: corpus.torch_zip_bytes(b"\x80\x04" + b"\x8f" * (8 << 20)
                                                      + b"."),
    # short distinct-looking strings kept on the careful reader's stack
    "strings.pt": lambda: corpus.torch_zip_bytes(b"\x80\x04" + tokens * 16 + b"."),
    "memo_bomb.pt": lambda: corpus.torch_zip_bytes(corpus.memo_bomb_pickle(2 ** 31)),
    "put_bomb.pt": lambda: corpus.torch_zip_bytes(b"\x80\x02Np99999999999\n."),
    "binbytes_claim.pt": lambda: corpus.torch_zip_bytes(
        b"\x80\x03\x8e" + struct.pack("<Q", 2 ** 62) + b"."),
    "frame_claim.pt": lambda: corpus.torch_zip_bytes(
        b"\x80\x04\x95" + struct.pack("<Q", 2 ** 40) + b"N."),
    # JSON's worst amplifier (an empty object per 3 bytes) just under the header cap
    "json_objects.safetensors": lambda: (lambda h: struct.pack("<Q", len(h)) + h)(
        b'{"__metadata__":[' + b"{}," * ((safetensorsfile.MAX_SAFETENSORS_PARSE - 40) // 3)
        + b"{}]}"),
    # a 50 MB header claim in a sparse file that really is that long
    "json_too_big.safetensors": None,
}
for name, make in files.items():
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        if make is None:
            f.write(struct.pack("<Q", 50 << 20) + b"{")
            f.truncate(8 + (50 << 20) + 8)
        else:
            f.write(make())
    v = integrity.verify(path, deep=True)
    os.unlink(path)
    print(json.dumps([name, v.status, v.details.get("cause", ""), v.reason[:100]]))
"""


def test_hostile_inputs_stay_under_the_memory_bound():
    """Every hostile input above, verified in one child under a 400 MB address-space cap:
    no verifier error, none ok, and the child's peak RSS stays under 120 MiB (interpreter
    ~16 MiB + the verifier's ~64 MiB bound + slack)."""
    here = os.path.dirname(os.path.abspath(corpus.__file__))      # tests/support/
    rc, out, err, peak = corpus.run_measured(["-c", _HOSTILE_SCRIPT, here],
                                             env=subprocess_env(), limit_bytes=400 << 20,
                                             timeout=240)
    assert rc == 0, err
    verdicts = {name: (status, cause, reason) for name, status, cause, reason in
                map(json.loads, out.splitlines())}
    assert len(verdicts) == 9, verdicts
    for name, (status, cause, reason) in verdicts.items():
        # Only the two valid (if odd) files may pass.
        assert status != integrity.OK or name in ("sets_fast.pt", "json_objects.safetensors"), \
            (name, reason)
        assert not reason.startswith("verifier error"), (name, reason)
    assert verdicts["memo_bomb.pt"][:2] == (integrity.CORRUPT, "out_of_bounds")
    assert verdicts["put_bomb.pt"][:2] == (integrity.CORRUPT, "out_of_bounds")
    assert verdicts["sets_careful.pt"][0] == integrity.UNVERIFIABLE
    assert peak is not None and peak < 120 << 20, f"peak RSS {peak >> 20} MiB"


_NEGATIVE_LENGTH_SCRIPT = r"""
import json, os, struct, sys, tempfile
sys.path.insert(0, sys.argv[1])
import corpus
from monitor.verify import integrity
d = tempfile.mkdtemp()
for name, length, before in (("stays", -5, b""), ("back", -8, b"N" * 10),
                             ("far", -2 ** 31, b"N" * 4)):
    path = os.path.join(d, name + ".pt")
    with open(path, "wb") as f:
        f.write(corpus.torch_zip_bytes(b"\x80\x02" + before + b"T" + struct.pack("<i", length)
                                       + b"N."))
    v = integrity.verify(path)
    print(json.dumps([name, v.status, v.reason[:100]]), flush=True)
"""


def test_a_negative_string_length_ends_the_pickle_check():
    """BINSTRING's length is signed: -5 left the fast reader's pre-check on the same opcode
    forever, and a longer negative one sent it back to read earlier bytes again -- one
    hostile checkpoint stopped the agent's verification, at 100 % CPU. Run in a child: on
    the old code it is the timeout that fails, not the suite that hangs."""
    here = os.path.dirname(os.path.abspath(corpus.__file__))      # tests/support/
    try:
        rc, out, err, _ = corpus.run_measured(["-c", _NEGATIVE_LENGTH_SCRIPT, here],
                                              env=subprocess_env(), timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the pickle check never ended: {exc.stdout!r}")
    assert rc == 0, err
    verdicts = {name: (status, reason) for name, status, reason in
                map(json.loads, out.splitlines())}
    assert set(verdicts) == {"stays", "back", "far"}
    for name, (status, reason) in verdicts.items():
        assert status == integrity.CORRUPT, (name, status, reason)
        assert not reason.startswith("verifier error"), (name, reason)


# ---------------------------------------------------------------------------- atheris

_ATHERIS_SCRIPT = r"""
import sys, tempfile, atheris
with atheris.instrument_imports():
    from monitor.verify import integrity
def one(data):
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        f.write(data)
        f.flush()
        v = integrity.verify(f.name, deep=True)
    if v.reason.startswith("verifier error") or v.status not in ("ok", "corrupt",
                                                                 "unverifiable"):
        raise AssertionError(v)
atheris.Setup(sys.argv, one)
atheris.Fuzz()
"""


def test_atheris_short_run():
    """A short coverage-guided run of the verifier (500 inputs, fixed seed) when atheris is
    installed; atheris.Fuzz() ends its process, so it runs in a child."""
    pytest.importorskip("atheris")
    import subprocess
    proc = subprocess.run([sys.executable, "-c", _ATHERIS_SCRIPT, "-runs=500", "-seed=1",
                           "-rss_limit_mb=400"], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------- lint's reader

@FUZZ
@given(st.sampled_from([b"", b"# -*- coding: latin-1 -*-\n", b"# coding: utf-8\n",
                        b"\xef\xbb\xbf", b"# coding: bogus\n", b"#!/usr/bin/env python\n"
                        b"# vim: set fileencoding=cp1252 :\n", b"# coding: utf-16\n"]),
       st.binary(max_size=300))
def test_lint_reads_any_bytes_into_findings_never_an_exception(prefix, body):
    """lint's file reader (PEP 263 coding lines, BOMs, any bytes) and the analysis behind
    it: every file becomes findings, never a traceback."""
    from monitor.cli import lint as lint_cli
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.py")
        with open(path, "wb") as f:
            f.write(prefix + b"import torch.distributed\n" + body)
        findings = lint_cli.lint_file(path)
    assert all(f.code.startswith("CKW") and f.line >= 1 for f in findings)
