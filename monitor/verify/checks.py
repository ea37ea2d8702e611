"""Which finished checkpoints to verify and when, driven from the agent loop's thread.

The loop tells Checks what it learnt (a write started, a writer's rights, a write finished, a
file closed, a collision); tick() hands due paths to the worker thread (monitor.verify.worker)
and returns the verdicts it finished. No agent types here: writes arrive as plain values, so
monitor.verify imports neither the detector nor the daemon.
"""
from __future__ import annotations

import time

from monitor.verify.worker import Verification, Verifier, VerifySchedule


class Checks:
    """Verification of finished checkpoints, driven from the loop's thread (monitor.verify.worker).

    A path is verified once it has been quiet for `verify.quiet` seconds after its last write:
    after a collision that is when the last writer is done and the damage is final.
    """

    def __init__(self, enabled: bool = True, quiet: float = 2.0, max_paths: int = 10000,
                 deep_max_bytes: int = 0, max_rate: float | None = None, clock=time.monotonic,
                 incomplete_after: float = 60.0, on_verdict=None):
        self.enabled = enabled
        self.schedule = VerifySchedule(quiet=quiet, max_paths=max_paths,
                                       incomplete_after=incomplete_after)
        self.verifier = Verifier(deep_max_bytes=deep_max_bytes, max_rate=max_rate or None,
                                 on_verdict=on_verdict)
        self._clock = clock

    def start(self) -> None:
        if self.enabled:
            self.verifier.start()

    def stop(self) -> None:
        self.verifier.stop()

    def write_started(self, path: str, sender=None, watched: bool = False) -> None:
        """A write began: reported by a hook whose connection's rights are `sender`
        (monitor.verify.rights.Rights; None: nobody's, so it is not read on its behalf), or seen by
        the agent's own watcher under a watched root (`watched`; see VerifySchedule)."""
        if self.enabled:
            self.schedule.write_started(path, self._clock(), sender, watched=watched)

    def writer_seen(self, path: str, sender) -> None:
        """A hook reported a write of `path` (its end): it may be read with `sender`'s
        rights, as after write_started, without making the path busy again."""
        if self.enabled and sender is not None:
            self.schedule.note_sender(path, sender)

    def write_finished(self, path: str, job: str, run, watched: bool,
                       hold: float = 0.0) -> None:
        """A write of `path` finished well (outcome ok) for job label `job`, run key `run`
        (monitor.detect.model.Writer.run_key, for set checks); `watched`: the agent's own
        watcher saw it; `hold`: seconds the check waits beyond `verify.quiet`."""
        if self.enabled:
            self.schedule.write_finished(path, job, self._clock(), watched=watched, hold=hold)
            self.schedule.note_run(path, run)

    def file_closed(self, path: str) -> None:
        """The watcher saw a write to `path` finish (any writer, attributed or not)."""
        if self.enabled:
            self.schedule.write_finished(path, "", self._clock(), watched=True)

    def collided(self, path: str, collision_id: str) -> None:
        if self.enabled:
            self.schedule.collided(path, collision_id, self._clock())

    def tick(self) -> list[Verification]:
        """Hand due paths to the worker; return the verifications it finished since."""
        if not self.enabled:
            return []
        now = self._clock()
        for path, job, collision_id, readers in self.schedule.due(now):
            self.verifier.submit(path, job, collision_id, readers)
        for directory, runs in self.schedule.due_sets(now):       # checkpoint sets
            self.verifier.submit_set(directory, runs)
        for directory in self.schedule.due_unfinished(now):       # DCP without .metadata
            self.verifier.submit_set(directory, self.schedule.runs_in(directory),
                                     unfinished_for=self.schedule.incomplete_after)
        results = self.verifier.drain()
        self.schedule.verified(results, now)
        return results

    def pending(self) -> int:
        """Verifications still to come: scheduled, queued or being read (after tick())."""
        return self.schedule.pending() + self.verifier.outstanding if self.enabled else 0
