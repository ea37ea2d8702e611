"""MetricsExporter: the metrics as one of the agent's exporters (exporters.fanout.Exporter)."""
from __future__ import annotations

from exporters.metrics.state import MetricsState
from monitor.detect.model import (FINDING_HAZARD, FINDING_VERIFICATION, Collision, Finding,
                                  Write)


class MetricsExporter:
    """Each published value updates MetricsState; scrapes read it (StateCollector)."""

    def __init__(self, state: MetricsState):
        self.state = state

    def publish_write(self, write: Write) -> None:
        self.state.write_finished(write)

    def publish_collision(self, collision: Collision) -> None:
        self.state.collision(collision)

    def publish_finding(self, finding: Finding) -> None:
        if finding.kind == FINDING_VERIFICATION:
            self.state.verification(finding.get("result"), finding.get("cause") or "",
                                    job=finding.job, path=finding.path,
                                    collision_id=finding.get("collision_id") or "",
                                    wall=finding.wall)
        elif finding.kind == FINDING_HAZARD:
            # Their latest-time gauges take the agent's clock, not the finding's wall (a
            # hook's word for a hazard, a write's end for a size fluctuation): a sender's
            # clock far in the future must not hold an alert up for good.
            self.state.hazard(finding.job, finding.get("hazard"))
        else:
            self.state.finding(finding.kind, finding.job)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
