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

from ckptwatch import events
from ckptwatch.writers import record
from ckptwatch.writers.patch import Patch, PatchSet

KIND = events.WRITER_SAFETENSORS
TARGETS = ("safetensors.torch",)



def _target(args, kwargs):
    filename = args[1] if len(args) > 1 else kwargs.get("filename")
    if isinstance(filename, (str, bytes, os.PathLike)):
        return os.path.abspath(os.fsdecode(filename))
    return None


def _make(original):
    @functools.wraps(original)
    def save_file(*args, **kwargs):
        if not _set.active or record.busy():
            return original(*args, **kwargs)
        path = _target(args, kwargs)
        started = record.begin(path, KIND, _set.skip) if path else None
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


def _patches_for(module_name: str, module) -> list:
    return [Patch(module, "save_file", _make)]

_set = PatchSet(_patches_for, ("safetensors", "torch"))


def install(module_name: str = TARGETS[0]) -> bool:
    return _set.install(module_name)


def uninstall() -> bool:
    return _set.uninstall()


def is_installed() -> bool:
    return _set.is_installed()
