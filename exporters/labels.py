"""Bounded label values for metric labels whose values come from input (training_job, rank).

A training job id and a rank arrive from any process that can reach the agent's socket (and from
files in watched directories). Exported as they come, 200,000 distinct values made a 312 MB
/metrics and a 3 GB agent (issue 8). So every such value is
- cleaned: cut to a maximum length (with a short hash, so two long ids stay two values) and made
  encodable as UTF-8 (a lone surrogate from JSON would otherwise fail the whole scrape);
- admitted into a set with a fixed capacity; a value that does not fit is exported as OVERFLOW;
- forgotten after it has not been used for an idle period, which frees its place.

Pure bookkeeping: no locks (the caller holds one), no clock of its own (the caller passes `now`).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

# The value exported in place of one that did not fit. Prometheus reserves label *names* that
# start with "__", not values; no job scheduler we know produces this id.
OVERFLOW = "__overflow__"
_HASH_CHARS = 8          # hex digits of the hash kept at the end of a cut value
MIN_VALUE_LENGTH = _HASH_CHARS + 8


@dataclass(frozen=True)
class LabelLimits:
    """How many label values the exporter holds at once, and for how long.

    The defaults fit a node agent: a node runs a handful of jobs a day with up to a few
    hundred local ranks; with them /metrics stays well under 1 MB whatever the input.
    """

    max_jobs: int = 100                  # distinct training_job values
    max_ranks: int = 1024                # distinct (training_job, rank) pairs
    max_value_length: int = 128          # characters per label value
    job_idle_expiry: float = 86400.0     # seconds without an update before a job's series go;
    #                                      0 keeps them for the agent's lifetime


def clean(value: str, max_length: int) -> str:
    """value as a label value: UTF-8 encodable and at most max_length characters. A cut value
    ends in "~" and a hash of the whole, so ids that share a long prefix stay apart."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(value) <= max_length:
        return value
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=_HASH_CHARS // 2).hexdigest()
    return value[:max_length - _HASH_CHARS - 1] + "~" + digest


class LabelValues:
    """At most `limit` keys, each with when it was last used, oldest use first."""

    def __init__(self, limit: int, idle_expiry: float):
        self.limit = limit
        self.idle_expiry = idle_expiry
        self._last_used: OrderedDict[Hashable, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last_used)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._last_used

    def admit(self, key: Hashable, now: float) -> bool:
        """Mark key used now; False if it is new and there is no room for it."""
        if key in self._last_used:
            self._last_used.move_to_end(key)
        elif len(self._last_used) >= self.limit:
            return False
        self._last_used[key] = now
        return True

    def expire(self, now: float) -> list:
        """Forget and return the keys unused for idle_expiry seconds. Only the idle ones are
        visited (oldest first), so calling this on every update costs nothing extra."""
        gone = []
        if self.idle_expiry <= 0:
            return gone
        while self._last_used:
            key, last = next(iter(self._last_used.items()))
            if now - last < self.idle_expiry:
                break
            self._last_used.popitem(last=False)
            gone.append(key)
        return gone

    def discard(self, key: Hashable) -> None:
        self._last_used.pop(key, None)
