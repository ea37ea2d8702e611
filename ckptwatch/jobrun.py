"""One job run's identity: the one definition the hook's job scope, the agent's detector and its
hazard reports all use (design.md, "redundant write" and "Stable contract").

Loaded into training processes (ckptwatch/jobscope.py names its store keys by it) and imported
by the agent (monitor.detect.model.Writer.run_key, monitor.agent.jobreports): no imports at all.

A run is named by its job id and restart count (an elastic restart is a new run). torchrun's
static rendezvous sets TORCHELASTIC_RUN_ID=none for every job, and a launcher may set no job id
at all: then the job id does not tell two jobs apart, and the master address
(MASTER_ADDR:MASTER_PORT, the job's own store) names the run with it. With neither a job id
nor a master, nothing names the run: None, and no two such processes count as one run.
"""
from __future__ import annotations

# TORCHELASTIC_RUN_ID's value under torchrun's static rendezvous, for every job.
STATIC_RUN_ID = "none"


def job_run(job: str | None, master: str | None, restart: int | None) -> tuple | None:
    """(job, master, restart) naming one job run, master None where the job id names the
    run alone; None when nothing names it (no usable job id and no master)."""
    if job is None or job == STATIC_RUN_ID:
        if master is None:
            return None
        return (job, master, restart)
    return (job, None, restart)
