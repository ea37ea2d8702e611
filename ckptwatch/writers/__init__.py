"""Checkpoint writers besides torch.save: safetensors, torch.distributed.checkpoint, fsspec.

Loaded into training processes: standard library only; each writer's library is patched only
once the process has imported it itself (ckptwatch/postimport.py), never imported by us.

Each writer module has KIND (its events.WRITER_* name), TARGETS (the modules it patches),
install(module_name) -> bool (patch what belongs to that module, imported already),
uninstall() -> bool and is_installed(). install() here patches every target imported now and
watches the import of the others; uninstall() restores what is still ours. torch.save itself
is ckptwatch/hook.py's: the writers share its sequence numbers, its emitter and its job scope
(ckptwatch/writers/record.py), so one process's writes are one story whatever library made
them.
"""
from __future__ import annotations

import functools
import importlib
import sys

from ckptwatch import paths

# The module each writer patches -> that writer's module here. Our writer modules (and the
# hook's machinery they use: threads, sockets) are imported only once a target is: a process
# that never imports these libraries pays for one meta-path finder (ckptwatch/bootstrap).
TARGETS = {
    "safetensors.torch": "safetensors_torch",
    "torch.distributed.checkpoint.filesystem": "dcp",
    "torch.distributed.checkpoint._async_thread_executor": "dcp",
    "fsspec.implementations.local": "fsspec_local",
}
WRITER_MODULES = ("safetensors_torch", "dcp", "fsspec_local")


def _writer(name: str):
    return importlib.import_module(f"ckptwatch.writers.{name}")


def install() -> bool:
    """Patch every writer whose library is imported; watch the import of the others.
    True if this call patched something. Idempotent; a no-op under CKPTWATCH_DISABLE."""
    if paths.disabled():
        return False
    from ckptwatch import postimport as imports
    patched = False
    waiting = {}
    for target, name in TARGETS.items():
        if target in sys.modules:
            patched = _install_one(name, target) or patched
        else:
            waiting[target] = _ON_IMPORT[target]
    if waiting:
        imports.watch(waiting)
    return patched


def _install_one(name: str, target: str) -> bool:
    try:
        return _writer(name).install(target)
    except Exception:
        # A library version that moved what we patch stays unpatched: never break the
        # import that triggered us.
        return False


# One callback object per target, so that watching again (a second install()) adds nothing:
# imports.watch is idempotent per callback.
_ON_IMPORT = {target: functools.partial(_install_one, name, target)
              for target, name in TARGETS.items()}


def _loaded():
    return [sys.modules[f"ckptwatch.writers.{name}"] for name in WRITER_MODULES
            if f"ckptwatch.writers.{name}" in sys.modules]


def uninstall() -> bool:
    """Restore every writer still ours and stop watching imports. True if any was restored."""
    from ckptwatch import postimport as imports
    imports.unwatch(_ON_IMPORT.values())
    restored = False
    for writer in _loaded():
        try:
            restored = writer.uninstall() or restored
        except Exception:
            pass
    return restored


def installed() -> list[str]:
    """The writer kinds patched now (events.WRITER_* names)."""
    return [writer.KIND for writer in _loaded() if writer.is_installed()]
