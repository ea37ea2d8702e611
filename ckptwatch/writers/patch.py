"""One attribute replaced by a wrapper, idempotently and reversibly.

install() sets owner.attr to make(original) once; a second install() while ours is in place
does nothing. uninstall() restores the original only if the attribute still holds our wrapper
(someone who wrapped ours keeps theirs; ours goes quiet through the writer's `active` flag).
The wrapper carries the original in MARKER, like the hook's torch.save wrapper; it is kept and
reused on a later install(), so re-installing never stacks wrappers.
"""
from __future__ import annotations

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
