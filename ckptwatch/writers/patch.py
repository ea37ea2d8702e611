"""One attribute replaced by a wrapper, idempotently and reversibly.

install() sets owner.attr to make(original) once; a second install() while ours is in place
does nothing. uninstall() restores the original only if the attribute still holds our wrapper
(someone who wrapped ours keeps theirs; ours goes quiet through the writer's `active` flag).
The wrapper carries the original in MARKER, like the hook's torch.save wrapper; it is kept and
reused on a later install(), so re-installing never stacks wrappers.

PatchSet: one writer's patches, made per module it patches when that module is first
installed, and the two things its wrappers read on every call: whether they record (`active`)
and which library directories they skip when they look for the user's call site (`skip`).
"""
from __future__ import annotations

import sys

MARKER = "__ckptwatch_original__"


class Patch:
    def __init__(self, owner, attr: str, make):
        self.owner, self.attr, self.make = owner, attr, make
        self.wrapper = None

    def is_ours(self) -> bool:
        current = self.owner.__dict__.get(self.attr) if isinstance(self.owner, type) \
            else getattr(self.owner, self.attr, None)
        return current is not None and current is self.wrapper

    def install(self) -> bool:
        if self.is_ours():
            return False
        current = (self.owner.__dict__.get(self.attr) if isinstance(self.owner, type)
                   else getattr(self.owner, self.attr, None))
        if current is None:
            return False
        if self.wrapper is None or getattr(self.wrapper, MARKER, None) is not current:
            self.wrapper = self.make(current)
            setattr(self.wrapper, MARKER, current)
        setattr(self.owner, self.attr, self.wrapper)
        return True

    def uninstall(self) -> bool:
        if not self.is_ours():
            return False
        setattr(self.owner, self.attr, getattr(self.wrapper, MARKER))
        return True


class PatchSet:
    def __init__(self, patches_for, libraries: tuple):
        """patches_for(module_name, module) -> [Patch]; libraries: the top-level packages
        whose frames are not the user's call site."""
        self._patches_for = patches_for
        self._libraries = libraries
        self._by_module: dict = {}
        self.active = False
        self.skip: tuple = ()

    def install(self, module_name: str) -> bool:
        module = sys.modules.get(module_name)
        if module is None:
            return False
        patches = self._by_module.get(module_name)
        if patches is None:
            patches = self._by_module[module_name] = self._patches_for(module_name, module)
        from ckptwatch.writers import record   # record imports the hook: not at our import
        self.skip = tuple(d for d in map(record.library_dir, self._libraries) if d)
        patched = any([p.install() for p in patches])
        self.active = True
        return patched

    def uninstall(self) -> bool:
        self.active = False
        return any([p.uninstall() for patches in self._by_module.values() for p in patches])

    def is_installed(self) -> bool:
        return self.active and any(p.is_ours() for patches in self._by_module.values()
                                   for p in patches)
