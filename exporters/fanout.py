"""The exporter fan-out: every Write, Collision and Finding the agent judges goes to every
exporter (metrics, journal, log line).

An exporter is any object with the five methods of `Exporter`; each decides what it does
with a value (the journal keeps a verification only when it found something, the log line
stays quiet about ordinary writes). `Fanout` is itself an Exporter: it calls each exporter in
turn on the agent loop's thread, and one exporter that raises is logged and never stops the
others, nor the loop.
"""
from __future__ import annotations

import logging
from typing import Iterable, Protocol, Sequence

from monitor.detect.model import Collision, Finding, Write

log = logging.getLogger("ckptwatch.agent")


class Exporter(Protocol):
    def publish_write(self, write: Write) -> None:
        """A write finished (once per write)."""

    def publish_collision(self, collision: Collision) -> None:
        """A collision became final (once per collision)."""

    def publish_finding(self, finding: Finding) -> None:
        """A size fluctuation, a torn read or a verification verdict."""

    def flush(self) -> None:
        """Push what is buffered (called once per tick of the loop and at shutdown)."""

    def close(self) -> None:
        """Flush and release resources (at shutdown, after the last publish)."""


class Fanout:
    """Hands each value to every exporter, in order; see the module docstring."""

    def __init__(self, exporters: Sequence[Exporter]):
        self.exporters = tuple(exporters)
        # Bound once: publish_write runs once per finished save, at tens of thousands a second.
        self._write_methods = tuple(e.publish_write for e in self.exporters)

    def publish(self, items: Iterable) -> None:
        """Writes and Collisions as the detector returns them (and Findings)."""
        for item in items:
            if isinstance(item, Write):
                self.publish_write(item)
            elif isinstance(item, Collision):
                self.publish_collision(item)
            elif isinstance(item, Finding):
                self.publish_finding(item)
            else:
                raise TypeError(f"cannot export {type(item).__name__}")

    def publish_write(self, write: Write) -> None:
        for method in self._write_methods:
            try:
                method(write)
            except Exception:
                log.exception("%s.publish_write failed", type(method.__self__).__name__)

    def publish_collision(self, collision: Collision) -> None:
        self._each("publish_collision", collision)

    def publish_finding(self, finding: Finding) -> None:
        self._each("publish_finding", finding)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args) -> None:
        for exporter in self.exporters:
            try:
                getattr(exporter, method)(*args)
            except Exception:
                # One exporter's bug (a metric, a formatting error) must not cost the others
                # their record, nor stop the agent.
                log.exception("%s.%s failed", type(exporter).__name__, method)
