"""Helpers shared by the benchmarks: a real agent subprocess on a private socket and port."""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from monitor.cli.launcher import AgentProcess, free_port  # noqa: E402

__all__ = ["REPO", "Agent", "free_port"]


class Agent(AgentProcess):
    """The real agent (python agent.py) on a private socket, port and journal, started at
    once; quiet (warning level) so its log costs the measurement nothing."""

    def __init__(self, *extra: str):
        super().__init__(None, *extra, log_level="warning")
        self.start(timeout=20)

    def stop(self) -> None:
        """Benchmarks are done with the agent: stop it and remove its directories."""
        self.close()
