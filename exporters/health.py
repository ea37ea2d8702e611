"""/healthz's verdict: is every source thread alive and is the loop keeping up?

Duck-typed on purpose (exporters import no agent module): `ingest` has `alive`,
`socket_intact()` and `path`; `fs` has `alive`; `inbox` has `oldest_wait()` and `backlog()`;
`heartbeat[0]` is the loop's last turn on `clock`.
"""
from __future__ import annotations

import time

STALL_SECONDS = 30.0        # /healthz fails when the loop has not turned for this long
MAX_LAG_SECONDS = 10.0      # ... or when an event has waited this long for the loop to take it


def health_check(ingest, heartbeat: list[float], fs=None,
                 inbox=None, max_lag: float = MAX_LAG_SECONDS,
                 clock=time.monotonic):
    """/healthz: unhealthy when a source's thread died, the core loop stopped turning, or it
    turns but is behind: the oldest event waiting for it has waited more than max_lag
    (a loop that keeps up takes every batch within a tick)."""
    def health() -> tuple[bool, str]:
        if not ingest.alive:
            return False, "ingest thread is not running"
        if not ingest.socket_intact():
            return False, f"socket {ingest.path} was removed or replaced since the agent bound it"
        if fs is not None and not fs.alive:
            return False, "filesystem attribution thread is not running"
        if clock() - heartbeat[0] > STALL_SECONDS:
            return False, "agent loop stalled"
        if inbox is not None:
            lag = inbox.oldest_wait()
            if lag > max_lag:
                return False, (f"agent loop behind: oldest queued event waited {lag:.1f}s "
                               f"({inbox.backlog()} queued)")
        return True, ""
    return health
