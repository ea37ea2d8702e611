"""The agent process's garbage-collector settings (docs/decisions.md, "Ingest: the collector").

Every event the agent decodes is a dict, and every write it tracks a few objects (the detector's
entry, its Write, the journal's record) that live for a second or more: with CPython's default
first threshold (700 allocations) the cyclic collector ran ~150 times a second at 40,000 events/s
and walked each of those objects several times, ~15 % of the agent's CPU, for garbage that
reference counting frees anyway (events and writes hold no cycles).

So the agent, and only the agent process (main(); not a test or a library importing
monitor.agent.daemon), collects after GEN0_THRESHOLD net allocations instead, and moves what exists
once it has started (modules, configuration) out of the collector's sight with gc.freeze(). The
collector still runs: cyclic garbage waiting for it is bounded by the thresholds (tens of
thousands of objects, a few MB at most), whatever the input.
"""
from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000     # net new container objects between young collections (CPython: 700)
GEN1_THRESHOLD = 20         # young collections between middle ones (CPython: 10): what a
                            # write holds lives ~1-2 s, mostly gone by then
GEN2_THRESHOLD = 10         # CPython's default


def configure() -> None:
    """Set the agent's thresholds and freeze what exists now (call once, at start)."""
    gc.collect()        # what the imports left as garbage goes now, not into the frozen set
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
