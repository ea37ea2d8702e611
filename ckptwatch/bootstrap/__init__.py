"""Zero-code installation: patch torch.save now, or as soon as torch is imported; the other
checkpoint writers (safetensors, DCP, fsspec: ckptwatch/writers) likewise.

`ckptwatch run` puts this directory on PYTHONPATH, so Python's site module imports our
sitecustomize.py at start-up in every Python process of the job (torchrun workers included),
and that calls initialize(). Start-up stays cheap for processes that never import torch: only
a sys.meta_path finder is registered; ckptwatch.hook (threads, sockets) is imported when torch is.

This module is the one place that decides "now or later" (install()); ckptwatch.install() comes
here too. The hook is the instrumentor: this module calls it, it never calls back (as in
OpenTelemetry contrib, auto_instrumentation and instrumentor).

The post-import hook: a meta-path finder that, for the top-level name "torch" only, asks the
other finders for the real spec, and gives that spec's loader an instance-level exec_module that
runs the real one and then calls ckptwatch.hook.install(). The loader object, the spec and the
module are otherwise untouched (isinstance checks, __loader__, importlib.reload and submodule
imports behave as before). After torch has imported successfully the finder removes itself
and the loader's instance attribute is deleted again.
"""
from __future__ import annotations

import os
import sys

from ckptwatch import paths

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(__file__))


def install() -> bool:
    """Patch torch.save now if torch is imported (True if this call patched something), else
    register the post-import hook that patches it as soon as torch is, and return False."""
    if paths.disabled():
        return False
    _install_writers()
    # The hook is imported only once torch is: a process without torch never pays for it.
    if "torch" in sys.modules:
        from ckptwatch import hook
        if hook.torch_ready():
            return hook.install()
    watch_torch_import()
    return False


def _install_writers() -> None:
    """The other checkpoint writers (ckptwatch/writers): patched now if their library is
    imported, else as soon as it is. Costs a process that never imports them one finder."""
    try:
        from ckptwatch import writers
        writers.install()
    except Exception:
        pass


def initialize() -> None:
    """install(), from sitecustomize at interpreter start-up. Never raises."""
    try:
        install()
    except Exception:
        # Instrumentation must never break the interpreter or the user's program.
        pass


def _after_torch_import() -> None:
    try:
        from ckptwatch import hook
        hook.install()
    except Exception:
        pass


class TorchImportWatcher:
    """sys.meta_path finder that runs a callback right after `torch` finishes importing."""

    def __init__(self, callback=_after_torch_import):
        self._callback = callback
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._searching:
            return None
        self._searching = True
        try:
            spec = self._find_real_spec(fullname, path, target)
        except Exception:
            return None
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None:
            self._wrap_loader(spec.loader)
        return spec

    def _find_real_spec(self, fullname, path, target):
        from ckptwatch.postimport import find_real_spec     # the writers' finder shares it
        return find_real_spec(self, fullname, path, target)

    def _wrap_loader(self, loader) -> None:
        real_exec = getattr(loader, "exec_module", None)
        if real_exec is None:
            return
        watcher = self

        def exec_module(module):
            try:
                real_exec(module)
            finally:
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
            # Only reached when torch imported successfully; a failed import keeps watching.
            watcher.remove()
            watcher._callback()

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            pass  # a loader with __slots__: leave the import alone rather than risk it

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def watch_torch_import() -> TorchImportWatcher:
    """Register the post-import hook once (idempotent); returns the active watcher."""
    for finder in sys.meta_path:
        # By name: a reloaded copy of this module has a different class object.
        if type(finder).__name__ == "TorchImportWatcher":
            return finder
    watcher = TorchImportWatcher()
    sys.meta_path.insert(0, watcher)
    return watcher
