"""Patch a library right after it is imported: a post-import hook for several module names.

The same technique as ckptwatch/bootstrap's TorchImportWatcher (which waits for `torch` and
is left as it is): a sys.meta_path finder that, for a watched full module name only, asks the
other finders for the real spec and gives its loader an instance-level exec_module that runs
the real one and then the callback. The module, spec and loader are otherwise untouched.

Why at import and not later: transformers and accelerate bind `from safetensors.torch import
save_file` while they import. Patched when safetensors.torch finishes importing -- before the
`from` statement that imports it completes -- their name is our wrapper.

Several parts of ckptwatch watch the same module (the writers patch safetensors.torch's saves,
the resume guard its loads): each name has a list of callbacks, run in the order they were
added. Once every watched module has been imported the finder removes itself. A callback's
failure is swallowed (the next one still runs): an import must never fail because of us.
"""
from __future__ import annotations

import sys
import threading

_lock = threading.Lock()


def find_real_spec(watcher, fullname, path, target):
    """The spec the other finders on sys.meta_path give for `fullname` (skipping `watcher`,
    the post-import finder asking), or None: what the import would find without us."""
    for finder in list(sys.meta_path):
        if finder is watcher:
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class LibraryImportWatcher:
    """sys.meta_path finder that calls each of callbacks[name] right after module `name`
    imports."""

    def __init__(self):
        self.callbacks: dict = {}        # module name -> [callback, ...]
        self._searching: set = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.callbacks or fullname in self._searching:
            return None
        self._searching.add(fullname)
        try:
            spec = self._find_real_spec(fullname, path, target)
        except Exception:
            return None
        finally:
            self._searching.discard(fullname)
        if spec is not None and spec.loader is not None:
            self._wrap_loader(fullname, spec.loader)
        return spec

    def _find_real_spec(self, fullname, path, target):
        return find_real_spec(self, fullname, path, target)

    def _wrap_loader(self, fullname, loader) -> None:
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
            # Only reached when the module imported successfully; a failed import keeps
            # watching, so a later successful one is patched.
            watcher._imported(fullname)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            pass        # a loader with __slots__: leave the import alone rather than risk it

    def _imported(self, fullname) -> None:
        with _lock:
            callbacks = self.callbacks.pop(fullname, ())
            if not self.callbacks:
                self.remove()
        for callback in callbacks:
            try:
                callback()
            except Exception:
                pass

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _current():
    for finder in sys.meta_path:
        # By name: a reloaded copy of this module has a different class object.
        if type(finder).__name__ == "LibraryImportWatcher":
            return finder
    return None


def watch(callbacks: dict) -> LibraryImportWatcher:
    """Call callbacks[name]() once module `name` is imported, after the callbacks other
    callers added for that name (idempotent per callback: one added twice runs once; pass the
    same callable object each time). Returns the one active watcher.

    A name already in sys.modules is the caller's to patch now and is not watched -- unless it
    is watched already: then its import is under way (its loader is ours; e.g. torch, and so
    the hook's install, imported in the middle of `import safetensors.torch`), the module is
    not complete yet, and the callback runs when it is."""
    with _lock:
        watcher = _current()
        if watcher is None:
            watcher = LibraryImportWatcher()
            sys.meta_path.insert(0, watcher)
        for name, callback in callbacks.items():
            listed = watcher.callbacks.get(name)
            if listed is None and name not in sys.modules:
                listed = watcher.callbacks[name] = []
            if listed is not None and callback not in listed:
                listed.append(callback)
        if not watcher.callbacks:
            watcher.remove()
        return watcher


def unwatch(callbacks=None) -> None:
    """Stop watching: for these callbacks only (the names they were added for keep the
    others'), or every name (None)."""
    with _lock:
        watcher = _current()
        if watcher is None:
            return
        if callbacks is None:
            watcher.callbacks.clear()
        else:
            for name in list(watcher.callbacks):
                kept = [c for c in watcher.callbacks[name] if c not in callbacks]
                if kept:
                    watcher.callbacks[name] = kept
                else:
                    del watcher.callbacks[name]
        if not watcher.callbacks:
            watcher.remove()
