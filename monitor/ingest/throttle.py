"""A warning that can fire thousands of times a second, logged as one line and then a summary.

The first occurrence is logged in full at once; later ones are only counted, by reason, and
one summary line with the counts is logged at most every `interval` seconds while they go on.
After a quiet interval the next occurrence is logged in full again. A flood of refused
connections (18,857 WARNING lines from one burst) becomes two lines a minute.
"""
from __future__ import annotations

import logging
import time
from typing import Callable


class ThrottledWarning:
    def __init__(self, logger: logging.Logger, what: str, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._what = what                    # "connections refused", for the summary line
        self._interval = interval
        self._clock = clock
        self._window_start: float | None = None   # when the last line was logged
        self._suppressed: dict[str, int] = {}

    def occurred(self, reason: str, message: str, *args) -> None:
        """One occurrence: logged in full if nothing was logged for `interval`, else counted."""
        now = self._clock()
        if self._window_start is None or (now - self._window_start >= self._interval
                                          and not self._suppressed):
            self._window_start = now
            self._log.warning(message + " (more are summarised every %gs)", *args,
                              self._interval)
            return
        self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
        self.tick(now)

    def tick(self, now: float | None = None) -> None:
        """Log the summary if one is due; call it now and then (the server loop does)."""
        now = self._clock() if now is None else now
        if self._window_start is None or now - self._window_start < self._interval:
            return
        if not self._suppressed:
            self._window_start = None        # quiet: the next one is logged in full
            return
        total = sum(self._suppressed.values())
        detail = " ".join(f"{reason}={n}" for reason, n in sorted(self._suppressed.items()))
        self._log.warning("%d more %s in the last %.0fs (%s); suppressed", total, self._what,
                          now - self._window_start, detail)
        self._window_start, self._suppressed = now, {}
