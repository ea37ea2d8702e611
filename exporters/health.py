"""The agent's health verdicts, as Prometheus' own endpoints mean them:

- healthy (/-/healthy, the liveness probe): the agent is alive and a restart would not help it
  otherwise -- every source thread runs, the socket it bound is still there, the loop turns.
- ready (/-/ready, and /healthz as before; the readiness probe): the agent is doing its job
  right now -- it has finished starting (socket bound, filesystem watches set, verifier running)
  and its loop keeps up: no event has waited longer than max_lag to be judged. A loop that is
  behind is alive (restarting it would lose the queue) but not ready.

Duck-typed on purpose (exporters import no agent module): `ingest` has `alive`,
`socket_intact()` and `path`; `fs` has `alive`; `inbox` has `oldest_wait()` and `backlog()`;
`heartbeat[0]` is the loop's last turn on `clock`; `started` has `is_set()`.
"""
from __future__ import annotations

import time

STALL_SECONDS = 30.0        # not healthy when the loop has not turned for this long
MAX_LAG_SECONDS = 10.0      # not ready when an event has waited this long for the loop to take it


def liveness_check(ingest, heartbeat: list[float], fs=None, clock=time.monotonic):
    """/-/healthy: a source's thread died, the socket was removed or replaced, or the core loop
    stopped turning -- what a restart cures."""
    def healthy() -> tuple[bool, str]:
        if not ingest.alive:
            return False, "ingest thread is not running"
        if not ingest.socket_intact():
            return False, f"socket {ingest.path} was removed or replaced since the agent bound it"
        if fs is not None and not fs.alive:
            return False, "filesystem attribution thread is not running"
        if clock() - heartbeat[0] > STALL_SECONDS:
            return False, "agent loop stalled"
        return True, ""
    return healthy


def health_check(ingest, heartbeat: list[float], fs=None,
                 inbox=None, max_lag: float = MAX_LAG_SECONDS,
                 clock=time.monotonic, started=None):
    """/-/ready and /healthz: healthy (liveness_check), started (`started` set, when given),
    and not behind: the oldest event waiting for the loop has waited at most max_lag (a loop
    that keeps up takes every batch within a tick)."""
    healthy = liveness_check(ingest, heartbeat, fs, clock)

    def health() -> tuple[bool, str]:
        if started is not None and not started.is_set():
            return False, "agent is starting"
        ok, reason = healthy()
        if not ok:
            return ok, reason
        if inbox is not None:
            lag = inbox.oldest_wait()
            if lag > max_lag:
                return False, (f"agent loop behind: oldest queued event waited {lag:.1f}s "
                               f"({inbox.backlog()} queued)")
        return True, ""
    return health
