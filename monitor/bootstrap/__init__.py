"""Zero-code installation: patch torch.save as soon as torch is imported.

`ckptwatch run` puts this directory on PYTHONPATH, so Python's site module imports our
sitecustomize.py at start-up in every Python process of the job (torchrun workers included),
and that calls initialize(). Start-up stays cheap for processes that never import torch: only
a sys.meta_path finder is registered; monitor.hook (threads, sockets) is imported when torch is.

The post-import hook: a meta-path finder that, for the top-level name "torch" only, asks the
other finders for the real spec, and gives that spec's loader an instance-level exec_module that
runs the real one and then calls monitor.hook.install(). The loader object, the spec and the
module are otherwise untouched (isinstance checks, __loader__, importlib.reload and submodule
imports behave as before). After torch has imported successfully the finder removes itself
and the loader's instance attribute is deleted again.

Name clash: our package is called `monitor`, a name a training repo may well use for a module
of its own. Importing ours at start-up would shadow theirs (sys.path[0], the script's
directory, is not yet on sys.path when sitecustomize runs). So sitecustomize hides our modules
from sys.modules again right after initialize(); when torch arrives and the first `monitor`
on sys.path is not ours, our modules are imported under a temporary swap of sys.modules and
hidden again afterwards — they keep working through their own references, and the user's
`import monitor` finds the user's module. Code in our modules therefore never imports from
`monitor` lazily on the save path.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys

from monitor import paths

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(BOOTSTRAP_DIR)

_hidden: dict = {}   # our modules taken out of sys.modules by hide_package()


def _our_names(modules) -> list[str]:
    return [name for name in list(modules) if name == "monitor" or name.startswith("monitor.")]


def _is_ours(module) -> bool:
    origin = getattr(module, "__file__", None)
    return bool(origin) and os.path.abspath(origin).startswith(PACKAGE_DIR + os.sep)


def hide_package() -> None:
    """Take our `monitor` modules out of sys.modules (see the module docstring)."""
    for name in _our_names(sys.modules):
        if _is_ours(sys.modules[name]):
            _hidden[name] = sys.modules.pop(name)


def _first_monitor_is_ours() -> bool:
    spec = importlib.machinery.PathFinder.find_spec("monitor", sys.path)
    return spec is None or spec.origin is None or (
        os.path.abspath(spec.origin).startswith(PACKAGE_DIR + os.sep))


@contextlib.contextmanager
def _package_visible():
    """Make our modules `monitor.*` in sys.modules for the duration; restore the user's after."""
    theirs = {name: sys.modules.pop(name) for name in _our_names(sys.modules)}
    sys.modules.update(_hidden)
    try:
        yield
    finally:
        for name in _our_names(sys.modules):
            module = sys.modules.pop(name)
            if _is_ours(module):
                _hidden[name] = module
        sys.modules.update(theirs)


def initialize() -> None:
    """Install the hook now if torch is imported, else as soon as it is. Never raises."""
    try:
        if paths.disabled():
            return
        torch = sys.modules.get("torch")
        if torch is not None and callable(getattr(torch, "save", None)):
            from monitor import hook
            hook.install()
        else:
            watch_torch_import()
    except Exception:
        # Instrumentation must never break the interpreter or the user's program.
        pass


def _after_torch_import() -> None:
    try:
        if not _hidden or _first_monitor_is_ours():
            # Nobody else owns the name: import normally (a user's `import monitor` is ours).
            from monitor import hook
            hook.install()
            return
        with _package_visible():
            from monitor import hook
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
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

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
        # By name: the watcher registered by sitecustomize may come from an earlier copy of
        # this module (see hide_package), whose class is a different object.
        if type(finder).__name__ == "TorchImportWatcher":
            return finder
    watcher = TorchImportWatcher()
    sys.meta_path.insert(0, watcher)
    return watcher
