"""The agent's event decoder: ckptwatch/events.py's contract, at the agent's speed.

ckptwatch/events.py is the wire contract and its decoder is the reference: stdlib only,
because it is loaded into training processes. The agent parses with orjson when it is
installed (an agent dependency, see pyproject.toml; without it, the reference's own parse,
slower); validation is always the reference's validate(), memoised.

The two JSON parsers must never disagree, including on the reason for a reject, so orjson
only ever *accepts*, and only payloads on which it provably yields the reference's value:

* Where the two parsers' JSON differs -- NaN and Infinity, numbers that overflow a double,
  lone surrogate escapes (orjson refuses them), integers beyond 64 bits (orjson returns a
  float), nesting near the parsers' different depth limits -- the payload goes to the
  reference. The first three make orjson fail; the last two are recognised before parsing by
  a run of 19 digits or a second "{" or any "[" in the bytes, which a hook's events do not
  contain (a float is at most 17 digits; events are flat) unless a string holds one: such an
  event, say a path with a bracket, takes the reference's slower way, with the same result.
* Whatever orjson's value fails validation is decoded again by the reference, so every
  reject and its reason are the reference's own. Rejects are rare and bounded in size.

Validation is the reference's validate(), memoised: for a start or end event its verdict
depends only on the kind, which fields are present with which value types, and the values
events.write_values_valid() checks (the version, pid > 0, an absolute path, finite times).
So the event's shape -- its keys in order and the types of its values, two tuples built in
C -- looked up in the set of shapes the reference accepted, and then write_values_valid(),
replace a dozen checks per event; a shape not seen yet goes to validate() itself. The sets
are bounded in count and in key length (MAX_SHAPES, _MAX_SHAPE_KEYS): a sender can invent
shapes without end, and past the bound validate() judges each new one.

tests/unit/test_codec.py holds the two to agreement on the golden fixtures and on generated
events, valid and not.
"""
from __future__ import annotations

import json

from ckptwatch import events

try:
    import orjson
except ImportError:             # documented fallback: the reference decoder, slower
    orjson = None

BACKEND = "orjson" if orjson is not None else "json"

# Digits -> "9" and "[" -> "{": one C-speed pass finds a 19-digit run (an integer that may not
# fit in 64 bits) and any container besides the outer object.
_SUSPECT = bytes.maketrans(b"0123456789[", b"9999999999{")
_LONG_NUMBER = b"9" * 19


MAX_SHAPES = 512           # accepted shapes memoised per kind; a hook needs one each
_MAX_SHAPE_KEYS = 1024     # total length of a memoised shape's keys (v1 names ~200 bytes)
_ACCEPTED: dict[str, set] = {"start": set(), "end": set()}


def validate(event: object) -> dict:
    """ckptwatch.events.validate(), memoised by the event's shape (see module doc)."""
    if type(event) is dict:
        kind = event.get("type")
        accepted = _ACCEPTED.get(kind) if type(kind) is str else None
        if accepted is not None:
            shape = (tuple(event), tuple(map(type, event.values())))
            if shape in accepted:
                # The reference accepted this shape (v, pid and path as int, int and str, its
                # times as numbers): what it checks beyond types are the contract's rules.
                if events.write_values_valid(event):
                    return event
            else:
                events.validate(event)      # raises the reference's reason
                if len(accepted) < MAX_SHAPES and sum(map(len, shape[0])) <= _MAX_SHAPE_KEYS:
                    accepted.add(shape)
                return event
    return events.validate(event)


def decode_many(payloads: list) -> list:
    """A dict or an EventError per payload, in order, exactly as ckptwatch.events.decode()
    returns or raises for each payload alone."""
    if orjson is None:
        return _decode_many_json(payloads)
    loads, error = orjson.loads, orjson.JSONDecodeError
    out = []
    append = out.append
    for payload in payloads:
        if len(payload) <= events.MAX_FRAME_BYTES:
            plain = payload.translate(_SUSPECT)
            if plain.count(b"{") == 1 and plain.find(_LONG_NUMBER) < 0:
                try:
                    append(validate(loads(payload)))
                    continue
                except (error, events.EventError):
                    pass
        append(_reference(payload))
    return out


_JSON = json.JSONDecoder()


def _decode_many_json(payloads: list) -> list:
    """Without orjson: the reference's own parse (ckptwatch.events.decode_many: each payload
    alone, one bare JSON value) with the memoised validate()."""
    raw_decode = _JSON.raw_decode
    out = []
    append = out.append
    for payload in payloads:
        if len(payload) <= events.MAX_FRAME_BYTES:
            try:
                text = payload.decode("utf-8")
                value, end = raw_decode(text)
                whole = end == len(text)
            except (UnicodeDecodeError, ValueError, RecursionError):
                whole = False
            if whole:
                try:
                    append(validate(value))
                except events.EventError as exc:
                    _drop_tracebacks(exc)
                    append(exc)
                continue
        append(_reference(payload))
    return out


def _reference(payload: bytes):
    try:
        return events.decode(payload)
    except events.EventError as exc:
        _drop_tracebacks(exc)
        return exc


def _drop_tracebacks(exc: BaseException) -> None:
    """Clear the tracebacks of exc and of the exceptions it was raised while handling. Each
    holds the frames it passed, and a frame holds the exception bound in its `except ... as`
    (this one's exc, the reference decoder's JSON or UTF-8 error): cycles that only the
    cyclic collector frees, 10-17 objects per reject, and a flood of garbage is all rejects
    (monitor/agent/gcpolicy.py lets them wait longer). Rejects are counted by reason; nothing reads
    their tracebacks."""
    for _ in range(8):      # a chain is 1-3 long; Python never lets one loop, bounded anyway
        if exc is None:
            return
        exc.__traceback__ = None
        exc = exc.__context__
