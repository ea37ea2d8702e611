"""What an agent said about one job, once it has judged everything: its journal's collision
and write records of the job and, from a real scrape of its /metrics, the job's
ckptwatch_collisions_total per kind."""
from __future__ import annotations

from groundtruth.compare import Observed
from groundtruth.expect import KINDS


def observe(agent, node: str, job: str) -> Observed:
    """agent: a tests/support/agentproc.AgentProcess that has judged everything (wait_idle)."""
    records = agent.journal_records()
    return Observed(
        node=node,
        collisions=[r for r in records if r.get("type") == "collision" and r.get("job") == job],
        writes=[r for r in records if r.get("type") == "write" and r.get("job") == job],
        metric_counts={kind: agent.metric("ckptwatch_collisions_total", training_job=job,
                                          kind=kind) or 0 for kind in KINDS})
