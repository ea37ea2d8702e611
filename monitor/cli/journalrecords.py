"""A journal record as the report commands may use it: the fields they read, each of the type
they expect, and nothing else.

A journal is input: any user of a node can point `ckptwatch report` at a file, and a record's
values may be of any JSON type (a string where a list of ranks belongs, a dict where a path
belongs, NaN for a time, a list nested 900 deep). `finding()` keeps the scalars of a record
(strings cut to MAX_TEXT, finite numbers, booleans, null) and, one level down, the lists and
objects the agent writes ("writers", "reader", "ranks", ...), each bounded; a field of the
wrong type is left out, so every renderer reads `None` for it and never a surprise.
`sized()` also says how many bytes the kept values weigh, so the lists that keep records can
be bounded by weight as well as by count (monitor/cli/journalview.py).
"""
from __future__ import annotations

from itertools import islice

MAX_TEXT = 4096             # characters kept of any string (a path is at most 4096 bytes)
MAX_FIELDS = 64             # fields kept of one record or nested object
MAX_LIST = 256              # items kept of one list (ranks, nodes)
MAX_OBJECTS = 64            # objects kept of one list of objects (writers)
MAX_INT = 2 ** 63           # larger integers are not a pid, rank, size or time
SCALAR_WEIGHT = 16          # bytes counted for a key, a number, a boolean or null
# A record whose kept values weigh more is not one the agent wrote (its records weigh a few
# KiB; a collision's writers are not findings): it is unreadable, as a malformed line.
MAX_RECORD_WEIGHT = 256 << 10

# Nested values the agent writes, by field: a list of objects, an object, a list of ints or
# a list of strings.
OBJECT_LISTS = ("writers",)
OBJECTS = ("reader", "first", "last", "supersedes")
INT_LISTS = ("ranks",)
TEXT_LISTS = ("nodes", "sources", "refused_globals")
NESTED = OBJECT_LISTS + OBJECTS + INT_LISTS + TEXT_LISTS


def _flat(obj, weight: list) -> dict:
    """The scalar fields of a JSON object (at most MAX_FIELDS); adds their weight."""
    out = {}
    total = 0
    for key, value in islice(obj.items(), MAX_FIELDS):
        kind = type(value)
        if kind is str:
            if len(value) > MAX_TEXT:
                value = value[:MAX_TEXT]
            total += len(value)
        elif kind is int:
            if not -MAX_INT < value < MAX_INT:
                continue
        elif kind is float:
            if value - value != 0:          # NaN or infinite
                continue
        elif value is not None and kind is not bool:
            continue
        if len(key) > MAX_TEXT:             # json.loads makes every key a string
            key = key[:MAX_TEXT]
        out[key] = value
        total += len(key) + SCALAR_WEIGHT
    weight[0] += total
    return out


def flat(obj) -> dict:
    """The scalar fields of an object (at most MAX_FIELDS, string keys only)."""
    if type(obj) is not dict:
        return {}
    return _flat({k: v for k, v in islice(obj.items(), MAX_FIELDS) if type(k) is str}, [0])


def sized(record: dict) -> tuple[dict | None, int]:
    """(finding(record), the bytes its kept strings and values weigh); (None, 0) without a
    string "path" or when that weight is over MAX_RECORD_WEIGHT."""
    if type(record.get("path")) is not str:
        return None, 0
    weight = [0]
    out = _flat(record, weight)
    for key in NESTED:
        out.pop(key, None)          # a scalar where the agent writes a list or an object
    for key in OBJECT_LISTS:
        value = record.get(key)
        if type(value) is list:
            out[key] = [_flat(item, weight) for item in islice(value, MAX_OBJECTS)
                        if type(item) is dict]
    for key in OBJECTS:
        value = record.get(key)
        if type(value) is dict:
            out[key] = _flat(value, weight)
    for key in INT_LISTS:
        value = record.get(key)
        if type(value) is list:
            kept = [v for v in islice(value, MAX_LIST) if type(v) is int
                    and -MAX_INT < v < MAX_INT]
            out[key] = kept
            weight[0] += SCALAR_WEIGHT * len(kept)
    for key in TEXT_LISTS:
        value = record.get(key)
        if type(value) is list:
            kept = [v[:MAX_TEXT] for v in islice(value, MAX_LIST) if type(v) is str]
            out[key] = kept
            weight[0] += sum(len(v) + SCALAR_WEIGHT for v in kept)
    if weight[0] > MAX_RECORD_WEIGHT:
        return None, 0
    return out, weight[0]


def finding(record: dict) -> dict | None:
    """The record's scalars and its known nested fields, checked; None without a string
    "path" (every finding is about a file)."""
    return sized(record)[0]


def text(record: dict, key: str) -> str | None:
    """A string field, or None."""
    value = record.get(key)
    return value if isinstance(value, str) else None


def integer(record: dict, key: str) -> int | None:
    """An integer field (not a boolean), or None."""
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def number(record: dict, key: str) -> float | None:
    """A finite number field (not a boolean), or None."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value - value == 0 else None
