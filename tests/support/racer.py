"""A racer that wins every race: after each look at a file (os.stat / os.lstat of its path),
the name is a FIFO; at each look it is the regular file again. Whatever checks a path and then
opens it by name opens the FIFO, as when a user renames a FIFO over a shard between the two
calls. Used to prove that a reader opens without blocking and judges the file it opened.

    with FifoRacer(path, monkeypatch) as racer:
        ... run the reader in a thread, bounded (racer.release() unblocks an open() that
        blocked on the FIFO, so a failing run ends) ...
"""
from __future__ import annotations

import os
import threading


class FifoRacer:
    def __init__(self, path: str, monkeypatch):
        self.path = os.fspath(path)
        self.saved = self.path + ".racer-saved"
        self._lock = threading.Lock()
        self._monkeypatch = monkeypatch
        self.looks = 0

    def _as_file(self) -> None:
        if os.path.lexists(self.saved):
            os.unlink(self.path)
            os.rename(self.saved, self.path)

    def _as_fifo(self) -> None:
        os.rename(self.path, self.saved)
        os.mkfifo(self.path)

    def __enter__(self) -> "FifoRacer":
        real_stat, real_lstat = os.stat, os.lstat

        def looked(real):
            def look(path, *args, **kwargs):
                if isinstance(path, (str, os.PathLike)) and os.fspath(path) == self.path:
                    with self._lock:
                        self._as_file()
                        result = real(path, *args, **kwargs)
                        self._as_fifo()
                        self.looks += 1
                    return result
                return real(path, *args, **kwargs)
            return look

        self._monkeypatch.setattr(os, "stat", looked(real_stat))
        self._monkeypatch.setattr(os, "lstat", looked(real_lstat))
        return self

    def release(self) -> None:
        """Unblock a reader stuck in open() on the FIFO (it then reads end-of-file)."""
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        self._monkeypatch.undo()
        self.release()
        with self._lock:
            self._as_file()


def bounded(fn, timeout: float = 20.0):
    """(finished, value): fn() on a daemon thread, waited for at most `timeout` seconds."""
    box, done = [], threading.Event()

    def run():
        try:
            box.append(fn())
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(timeout)
    return finished, box[0] if box else None
