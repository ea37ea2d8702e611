"""safetensors.torch.save_file, and so save_model and Hugging Face's save_pretrained.

save_model calls save_file through its module's global name, and transformers and accelerate
bind `from safetensors.torch import save_file` while they import, after safetensors.torch has
finished importing: patched at that moment (ckptwatch/postimport.py) every one of those
names is our wrapper. A name bound before the patch keeps the original, as with torch.save.

The write reported is the target path from before safetensors creates anything until
save_file returns. safetensors (0.8) writes a temporary file in the target's directory and
renames it onto the target, so its files are already whole under the `atomic` policy's rule;
there is nothing for that policy to add, and it adds nothing. Two writers of one path still
race: the last rename wins silently, which is what the agent reports.
"""
from __future__ import annotations

import functools
import os
import sys

from ckptwatch import events
from ckptwatch.writers import record
from ckptwatch.writers.patch import Patch

KIND = events.WRITER_SAFETENSORS
TARGETS = ("safetensors.torch",)

_active = False
_patches: list = []
_skip: tuple = ()


def _target(args, kwargs):
    filename = args[1] if len(args) > 1 else kwargs.get("filename")
    if isinstance(filename, (str, bytes, os.PathLike)):
        return os.path.abspath(os.fsdecode(filename))
    return None


def _make(original):
    @functools.wraps(original)
    def save_file(*args, **kwargs):
        if not _active or record.busy():
            return original(*args, **kwargs)
        path = _target(args, kwargs)
        started = record.begin(path, KIND, _skip) if path else None
        if started is None:
            return original(*args, **kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            record.finish(started, type(exc).__name__)
            raise
        record.finish(started, "ok")
        return result
    return save_file


def install(module_name: str = TARGETS[0]) -> bool:
    global _active, _skip
    module = sys.modules.get(module_name)
    if module is None:
        return False
    if not _patches:
        _patches.append(Patch(module, "save_file", _make))
    _skip = tuple(d for d in (record.library_dir("safetensors"), record.library_dir("torch"))
                  if d)
    patched = any([p.install() for p in _patches])
    _active = True
    return patched


def uninstall() -> bool:
    global _active
    _active = False
    return any([p.uninstall() for p in _patches])


def is_installed() -> bool:
    return _active and any(p.is_ours() for p in _patches)
