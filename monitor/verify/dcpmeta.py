"""Which shard byte ranges does a torch.distributed.checkpoint `.metadata` name? Answered
without importing torch or running anything the pickle names.

`shard_ranges(data) -> ShardMap`: for every `_StorageInfo(relative_path, offset, length)` in
the pickled `Metadata.storage_data`, the (offset, length) pairs per relative path. Raises
ValueError (picklescan.OutOfBounds for a memo number no pickler writes) when the bytes are not
a valid pickle, picklescan.BeyondBudget when judging it would take more memory than allowed.

The same two readers as monitor.verify.picklescan, under the same memory rules:
- fast: the C unpickler with every global an inert placeholder; the placeholder standing for
  `_StorageInfo` records the state dict BUILD hands it. Only for pickles of at most
  picklescan.FAST_MAX_BYTES that picklescan's opcode pass found well-formed.
- careful: a stack machine over pickletools' opcode table that keeps only what a storage
  info is made of (short strings, ints, the dicts of BUILD states with those three keys); its
  memo refuses out-of-order numbers; memory is estimated every 64 KiB of input.
Both stop at MAX_RANGES ranges and MAX_FILES distinct files (BeyondBudget): ranges are kept
as 16-byte pairs in arrays, so the result itself stays within ~16 MiB.
"""
from __future__ import annotations

import pickle
from array import array
from dataclasses import dataclass, field

from . import picklescan
from .picklescan import BeyondBudget, _Inert, _Reader, _fits_fast_reader, _memo_put, _pop_mark

MAX_RANGES = 1_000_000     # storage infos (one per tensor chunk per rank): ~16 MB of pairs
MAX_FILES = 100_000        # distinct shard files (one per rank and writer thread)
_WANTED = ("relative_path", "offset", "length")
_INFO_CLASS = "_StorageInfo"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


@dataclass
class ShardMap:
    """What a .metadata says: relative path -> array('q') of offset, length, offset, ...;
    `is_dcp`: the pickle's top class is torch.distributed.checkpoint's Metadata."""

    files: dict = field(default_factory=dict)
    ranges: int = 0
    is_dcp: bool = False
    transformed: int = 0     # infos with transform_descriptors (compressed...): not archives

    def add(self, state) -> None:
        if not isinstance(state, dict):
            raise ValueError("a _StorageInfo without a state dict")
        path, offset, length = (state.get(k) for k in _WANTED)
        if not isinstance(path, str) or not _is_count(offset) or not _is_count(length):
            raise ValueError("a _StorageInfo without a proper relative_path, offset and "
                             "length")
        if self.ranges >= MAX_RANGES:
            raise BeyondBudget(f"more than {MAX_RANGES} storage entries")
        pairs = self.files.get(path)
        if pairs is None:
            if len(self.files) >= MAX_FILES:
                raise BeyondBudget(f"more than {MAX_FILES} shard files")
            pairs = self.files[path] = array("q")
        pairs.append(offset)
        pairs.append(length)
        self.ranges += 1
        if state.get("transform_descriptors"):
            self.transformed += 1


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def shard_ranges(data: bytes, budget: int = picklescan.BUDGET) -> ShardMap:
    if len(data) <= picklescan.FAST_MAX_BYTES and _fits_fast_reader(data):
        try:
            return _fast(data)
        except BeyondBudget:
            raise
        except Exception:      # damaged, or beyond the fast reader: ask the careful one
            pass
    return _careful(data, budget)


# ---------------------------------------------------------------------------- fast reader

class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(_Reader(data))
        self.found = ShardMap()
        self.classes: dict = {}

    def find_class(self, module, name):
        key = (module, name)
        cls = self.classes.get(key)
        if cls is None:
            body = {"__slots__": ()}
            if name == _INFO_CLASS:
                found = self.found
                # BUILD calls __setstate__(state): the only method of ours that sees data.
                body["__setstate__"] = lambda self, state: found.add(state)
            elif key == (_METADATA_MODULE, "Metadata"):
                self.found.is_dcp = True
            cls = self.classes[key] = type("_Inert", (_Inert,), body)
        return cls

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a .metadata has no persistent ids")


def _fast(data: bytes) -> ShardMap:
    reader = _Unpickler(data)
    reader.load()
    return reader.found


# ---------------------------------------------------------------------------- careful reader

_MARK = picklescan._MARK
_INFO = object()           # an instance of _StorageInfo (no identity needed: BUILD records)


class _State(dict):
    """A dict the pickle builds; keeps only the keys a _StorageInfo state has."""

    __slots__ = ()


def _careful(data: bytes, budget: int) -> ShardMap:
    table, end, i = picklescan._OPCODES, len(data), 0
    stack, memo, found = [], [], ShardMap()
    made = 0
    check_at = min(end, picklescan.CHECK_EVERY)
    while True:
        if i >= check_at:
            if i >= end:
                raise ValueError("ends before STOP (truncated)")
            used = made + 8 * (len(stack) + len(memo)) + 16 * found.ranges
            if used > budget:
                raise BeyondBudget(f"judging it needs more than {budget >> 20} MiB of memory "
                                   f"({i} of {end} bytes read)")
            check_at = min(end, i + picklescan.CHECK_EVERY)
        spec = table[data[i]]
        if spec is None:
            raise ValueError(f"unknown opcode {data[i]:#04x} at {i}")
        kind, arg_kind, n, value_kind, below, has_mark, after, name = spec
        i += 1
        raw, i = picklescan.read_argument(data, i, end, arg_kind, n, name)
        # -- the stack effects that matter; everything else is the generic rule
        if kind == picklescan._K_PUT:
            _memo_put(memo, picklescan._memo_index(raw, arg_kind), stack)
        elif kind == picklescan._K_MEMOIZE:
            if not stack:
                raise ValueError("stack underflow at MEMOIZE")
            memo.append(stack[-1])
        elif kind == picklescan._K_GET:
            key = picklescan._memo_index(raw, arg_kind)
            stack.append(memo[key] if key < len(memo) else None)
        elif kind == picklescan._K_MARK:
            stack.append(_MARK)
        elif kind == picklescan._K_VALUE:
            stack.append(None if raw is None else picklescan._decode_value(value_kind, raw))
            made += 80 + 4 * len(raw or b"")
        elif kind == picklescan._K_GLOBAL:
            stack.append(_global(found, raw[0].decode("utf-8", "replace"),
                                 raw[1].decode("utf-8", "replace")))
            made += 200
        elif kind == picklescan._K_STACK_GLOBAL:
            if len(stack) < 2:
                raise ValueError("stack underflow at STACK_GLOBAL")
            qual, module = stack.pop(), stack.pop()
            stack.append(_global(found, module, qual))
            made += 64
        elif kind == picklescan._K_STOP:
            if not stack:
                raise ValueError("stack underflow at STOP")
            return found
        elif name == "EMPTY_DICT":
            stack.append(_State())
            made += 240
        elif name in ("SETITEM", "SETITEMS"):
            items = _pop_mark(stack) if name == "SETITEMS" else stack[-2:]
            if name == "SETITEM":
                if len(stack) < 3:
                    raise ValueError("stack underflow at SETITEM")
                del stack[-2:]
            if len(items) % 2 or not stack:
                raise ValueError(f"stack underflow at {name}")
            target = stack[-1]
            if isinstance(target, _State):
                for k, v in zip(items[::2], items[1::2]):
                    if k in _WANTED and (isinstance(v, (str, int)) or v is None):
                        target[k] = v
                    elif k == "transform_descriptors":
                        target[k] = True if v is not None else None
        elif name in ("NEWOBJ", "NEWOBJ_EX", "REDUCE"):
            count = {"NEWOBJ": 2, "NEWOBJ_EX": 3, "REDUCE": 2}[name]
            if len(stack) < count:
                raise ValueError(f"stack underflow at {name}")
            cls = stack[-count]
            del stack[-count:]
            stack.append(_INFO if cls == ("global", _INFO_CLASS) else None)
        elif name == "BUILD":
            if len(stack) < 2:
                raise ValueError("stack underflow at BUILD")
            state = stack.pop()
            if stack[-1] is _INFO:
                if isinstance(state, _State):
                    found.add(state)
                else:
                    raise ValueError("a _StorageInfo without a state dict")
        elif kind == picklescan._K_NOP:
            if name == "FRAME" and int.from_bytes(raw, "little") > end - i:
                raise ValueError("FRAME runs past the end (truncated)")
        else:                       # generic: pop what it takes, push one unknown value
            if has_mark:
                _pop_mark(stack)
            if below:
                if below > len(stack):
                    raise ValueError(f"stack underflow at {name}")
                del stack[-below:]
            if after:
                stack.append(None)
                made += 16


def _global(found: ShardMap, module, name):
    """What a global becomes on the careful reader's stack: a marker for _StorageInfo."""
    if (module, name) == (_METADATA_MODULE, "Metadata"):
        found.is_dcp = True
    return ("global", _INFO_CLASS) if name == _INFO_CLASS else None
