"""A journal record as the report commands may use it: the fields they read, each of the type
they expect, and nothing else.

A journal is input: any user of a node can point `ckptwatch report` at a file, and a record's
values may be of any JSON type (a string where a list of ranks belongs, a dict where a path
belongs, NaN for a time, a list nested 900 deep). `finding()` keeps the scalars of a record
(strings cut to MAX_TEXT, finite numbers, booleans, null) and, one level down, the lists and
objects the agent writes ("writers", "reader", "ranks", ...), each bounded; a field of the
wrong type is left out, so every renderer reads `None` for it and never a surprise.
"""
from __future__ import annotations

import math

MAX_TEXT = 4096             # characters kept of any string (a path is at most 4096 bytes)
MAX_FIELDS = 64             # fields kept of one record or nested object
MAX_LIST = 256              # items kept of one list (ranks, nodes, writers)
MAX_INT = 2 ** 63           # larger integers are not a pid, rank, size or time

# Nested values the agent writes, by field: a list of objects, an object, a list of ints or
# a list of strings.
OBJECT_LISTS = ("writers",)
OBJECTS = ("reader", "first", "last", "supersedes")
INT_LISTS = ("ranks",)
TEXT_LISTS = ("nodes", "sources", "refused_globals")

_DROP = object()


def scalar(value):
    """The value if it is a usable JSON scalar (a string cut to MAX_TEXT), else _DROP."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT]
    if isinstance(value, int):
        return value if -MAX_INT < value < MAX_INT else _DROP
    if isinstance(value, float):
        return value if math.isfinite(value) else _DROP
    return _DROP


def flat(obj) -> dict:
    """The scalar fields of an object (at most MAX_FIELDS, string keys only)."""
    out = {}
    if not isinstance(obj, dict):
        return out
    for key, value in obj.items():
        if len(out) >= MAX_FIELDS:
            break
        value = scalar(value)
        if isinstance(key, str) and value is not _DROP:
            out[key[:MAX_TEXT]] = value
    return out


def finding(record: dict) -> dict | None:
    """The record's scalars and its known nested fields, checked; None without a string
    "path" (every finding is about a file)."""
    if not isinstance(record.get("path"), str):
        return None
    out = flat(record)
    for key in OBJECT_LISTS + OBJECTS + INT_LISTS + TEXT_LISTS:
        out.pop(key, None)          # a scalar where the agent writes a list or an object
    for key in OBJECT_LISTS:
        value = record.get(key)
        if isinstance(value, list):
            out[key] = [flat(item) for item in value[:MAX_LIST] if isinstance(item, dict)]
    for key in OBJECTS:
        value = record.get(key)
        if isinstance(value, dict):
            out[key] = flat(value)
    for key in INT_LISTS:
        value = record.get(key)
        if isinstance(value, list):
            out[key] = [v for v in value[:MAX_LIST]
                        if isinstance(v, int) and not isinstance(v, bool)
                        and -MAX_INT < v < MAX_INT]
    for key in TEXT_LISTS:
        value = record.get(key)
        if isinstance(value, list):
            out[key] = [v[:MAX_TEXT] for v in value[:MAX_LIST] if isinstance(v, str)]
    return out


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
    return float(value) if math.isfinite(value) else None
