"""torch.distributed.checkpoint's filesystem writer: every shard and the `.metadata`.

What is patched (module torch.distributed.checkpoint.filesystem, when it is imported):
- FileSystem.create_stream, opened for writing: one write per file from before it is opened
  until it is closed. DCP writes a shard (`__{rank}_{n}.distcp`) through it -- on the calling
  thread, on its own worker threads (thread_count > 1), or on async_save's executor thread --
  and torch.saves each tensor into the open stream: those nested saves pass through (the
  hook's busy flag), so a shard is one write, whole, not its first tensor only.
- _FileSystemWriter.finish: the write of the `.metadata` file, from before DCP creates
  `.metadata.tmp` until it has renamed it onto `.metadata` (the rename is the write of the
  final path; the temporary file itself is not reported).
- _FileSystemWriter.write_data and _ThreadBasedAsyncCheckpointExecutor.execute_save (module
  _async_thread_executor): the caller's site is handed to DCP's worker threads and to
  async_save's executor thread (record.handoff), whose own stacks hold no user frame.

Attribution: every write is reported by the process that makes it, with that process's
identity, whatever thread does the I/O. async_save's process-based executor
(AsyncCheckpointerType.PROCESS) writes from a child process: under `ckptwatch run` that child
is instrumented too (it inherits the bootstrap and the rank variables) and its writes carry
its own pid and the parent's rank, but no call site.

Policies: `atomic` does not rewrite DCP's shards (a shard is only meaningful with the
`.metadata` that lists it, and DCP already writes `.metadata` by rename); `warn` works (the
notice names the site of the dcp.save call where there is one).
"""
from __future__ import annotations

import contextlib
import functools
import os

from ckptwatch import events
from ckptwatch.writers import record
from ckptwatch.writers.patch import Patch, PatchSet

KIND = events.WRITER_DCP
FILESYSTEM = "torch.distributed.checkpoint.filesystem"
ASYNC_THREAD = "torch.distributed.checkpoint._async_thread_executor"
TARGETS = (FILESYSTEM, ASYNC_THREAD)



def _writing(mode) -> bool:
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def _local_path(path) -> str | None:
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return None
    if "://" in text:
        return None             # an fsspec URL: not a local file
    return os.path.abspath(text)


def _make_create_stream(original):
    @functools.wraps(original)
    @contextlib.contextmanager
    def create_stream(self, path, mode):
        started = None
        if _set.active and _writing(mode) and not record.busy():
            target = _local_path(path)
            if target is not None:
                started = record.begin(target, KIND, _set.skip)
        if started is None:
            with original(self, path, mode) as stream:
                yield stream
            return
        outcome = "ok"
        try:
            with original(self, path, mode) as stream:
                yield stream
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            record.finish(started, outcome)
    return create_stream


def _metadata_path(writer) -> str | None:
    try:
        if not writer.use_collectives and writer.rank is not None:
            path = writer._get_metadata_path(writer.rank)
        else:
            path = writer._get_metadata_path()
        return _local_path(path)
    except Exception:
        return None


def _make_finish(original):
    @functools.wraps(original)
    def finish(self, *args, **kwargs):
        if not _set.active or record.busy():
            return original(self, *args, **kwargs)
        target = _metadata_path(self)
        started = record.begin(target, KIND, _set.skip) if target else None
        if started is None:
            return original(self, *args, **kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            record.finish(started, type(exc).__name__)
            raise
        record.finish(started, "ok")
        return result
    return finish


def _make_handoff(original):
    """write_data / execute_save: hand the caller's site to the threads that will write."""
    @functools.wraps(original)
    def handing_off(*args, **kwargs):
        if _set.active:
            record.handoff(_set.skip)
        return original(*args, **kwargs)
    return handing_off


def _patches_for(module_name: str, module) -> list:
    if module_name == FILESYSTEM:
        return [Patch(module.FileSystem, "create_stream", _make_create_stream),
                Patch(module._FileSystemWriter, "finish", _make_finish),
                Patch(module._FileSystemWriter, "write_data", _make_handoff)]
    if module_name == ASYNC_THREAD:
        return [Patch(module._ThreadBasedAsyncCheckpointExecutor, "execute_save",
                      _make_handoff)]
    return []


_set = PatchSet(_patches_for, ("torch",))


def install(module_name: str = FILESYSTEM) -> bool:
    return _set.install(module_name)


def uninstall() -> bool:
    return _set.uninstall()


def is_installed() -> bool:
    return _set.is_installed()
