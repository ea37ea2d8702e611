"""fsspec's local files: checkpoints written through fsspec (Lightning's checkpoint IO).

Lightning saves a checkpoint by torch.save into an io.BytesIO (not a file: the hook does not
report it) and then writes the bytes through fsspec, inside a transaction: fsspec's
LocalFileOpener writes a temporary file (tempfile.mkstemp, in the system's temporary
directory, not next to the target) and moves it onto the target when the transaction
commits. The move is the write of the target -- a rename, or a copy when the temporary
directory is on another filesystem -- so the write reported is the target's, from before the
opener exists until the commit has returned (or the discard, outcome "discarded"). Outside a
transaction (autocommit) the opener writes the target itself, and the write ends when it is
closed.

Only checkpoint files are reported: a write mode and a name ending in one of
CHECKPOINT_SUFFIXES. fsspec also writes loggers' CSV and YAML files, which are not
checkpoints.

Patched (module fsspec.implementations.local, when it is imported): LocalFileOpener's
__init__, close, __exit__, commit and discard. Remote filesystems (s3, gcs, ...) are not local files
and are not reported: the agent cannot see them either.

Policies: `warn` works. `atomic` does not change fsspec writes: inside a transaction they are
a temporary file moved into place already; an autocommit write is left as the caller made it.
"""
from __future__ import annotations

import functools
import os

from ckptwatch import events
from ckptwatch.writers import record
from ckptwatch.writers.patch import Patch, PatchSet

KIND = events.WRITER_FSSPEC
TARGETS = ("fsspec.implementations.local",)
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".distcp")
_SLOT = "_ckptwatch_write"          # the opener's write in progress, in its __dict__



def _checkpoint_target(path, mode) -> str | None:
    if not (isinstance(mode, str) and "b" in mode and any(c in mode for c in "wax")):
        return None
    if not isinstance(path, str) or "://" in path or not path.endswith(CHECKPOINT_SUFFIXES):
        return None
    return os.path.abspath(path)


def _make_init(original):
    @functools.wraps(original)
    def __init__(self, path, mode, *args, **kwargs):
        started = None
        if _set.active and not record.busy():
            target = _checkpoint_target(path, mode)
            if target is not None:
                started = record.begin(target, KIND, _set.skip)
        if started is None:
            return original(self, path, mode, *args, **kwargs)
        try:
            original(self, path, mode, *args, **kwargs)
        except BaseException as exc:
            record.finish(started, type(exc).__name__)
            raise
        # The write goes on in the caller's code until close or commit: the thread is not
        # inside a save meanwhile.
        record.resume(started)
        self.__dict__[_SLOT] = started
    return __init__


def _make_end(original, on_autocommit: bool, outcome_ok: str = "ok"):
    """close (ends an autocommit write), commit and discard (end a transaction's write)."""
    @functools.wraps(original)
    def end(self, *args, **kwargs):
        started = self.__dict__.get(_SLOT)
        if started is None or bool(self.__dict__.get("autocommit", True)) != on_autocommit:
            return original(self, *args, **kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            if self.__dict__.pop(_SLOT, None) is not None:
                record.finish(started, type(exc).__name__)
            raise
        if self.__dict__.pop(_SLOT, None) is not None:
            record.finish(started, outcome_ok)
        return result
    return end


def _patches_for(module_name: str, module) -> list:
    opener = module.LocalFileOpener
    return [
        Patch(opener, "__init__", _make_init),
        Patch(opener, "close", lambda o: _make_end(o, on_autocommit=True)),
        # `with fs.open(...)` closes the inner file in __exit__, not through close().
        Patch(opener, "__exit__", lambda o: _make_end(o, on_autocommit=True)),
        Patch(opener, "commit", lambda o: _make_end(o, on_autocommit=False)),
        Patch(opener, "discard", lambda o: _make_end(o, on_autocommit=False,
                                                     outcome_ok="discarded"))]

_set = PatchSet(_patches_for, ("fsspec", "torch"))


def install(module_name: str = TARGETS[0]) -> bool:
    return _set.install(module_name)


def uninstall() -> bool:
    return _set.uninstall()


def is_installed() -> bool:
    return _set.is_installed()
