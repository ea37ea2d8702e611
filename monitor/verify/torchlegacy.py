"""The legacy torch format (torch.save before 1.6, or with _use_new_zipfile_serialization=False):
a non-zip pickle stream with torch's magic number. What integrity.verify() checks of one: see
its docstring. No checksums either: sizes and layout only. Raises verdict.Corrupt or
verdict.Unverifiable.
"""
from __future__ import annotations

import pickletools
import struct

from .fileio import pread
from .torchzip import MAX_PICKLE_BYTES, STORAGE_ELEMENT_SIZE, ok_verdict, pickle_contents
from .verdict import FMT_TORCH_LEGACY, Corrupt, Unverifiable, Verdict

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_MAGIC_BYTES = LEGACY_MAGIC.to_bytes(10, "little")


def verify_legacy(f, size, path, deep, throttle) -> Verdict:
    """magic, protocol version, sys info, the object, the sorted storage keys: five pickles;
    then per key an 8-byte element count and the storage's bytes, to exactly the end."""
    f.seek(0)
    storages = {}
    keys = None
    names = set()
    for i in range(5):
        start = f.tell()
        if start >= size:
            raise Corrupt(f"truncated: the file ends before pickle {i + 1} of 5")
        data = _read_pickle(f, size, i)
        # torch.load unpickles all five: any of them could name a callable.
        found, named = pickle_contents(data, "the pickled object" if i == 3
                                       else f"pickle {i + 1} of 5")
        names |= named
        if i == 3:
            storages = found
        elif i == 4:
            keys = [arg for op, arg, _ in pickletools.genops(data)
                    if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE")]
    pos = f.tell()
    for key in keys:
        head = pread(f, pos, 8)
        if len(head) < 8:
            raise Corrupt(f"truncated: storage {key} is missing (file ends at {size})")
        count = struct.unpack("<q", head)[0]
        type_name, numel = storages.get(key, (None, None))
        elem = STORAGE_ELEMENT_SIZE.get(type_name)
        if elem is None:
            raise Unverifiable(f"legacy torch file with a storage of unknown layout "
                               f"({type_name}): cannot follow it")
        if count != numel:
            raise Corrupt(f"storage {key} holds {count} elements, the pickle says {numel}")
        pos += 8 + count * elem
        if pos > size:
            raise Corrupt(f"truncated: storage {key} runs {pos - size} bytes past the end")
    if pos != size:
        raise Corrupt(f"{size - pos} unexpected bytes after the last storage")
    return ok_verdict(FMT_TORCH_LEGACY, {
        "storages": len(keys), "deep": deep,
        "note": "legacy format has no checksums: sizes and layout checked only"}, names)


class _Bounded:
    """A file seen only up to `size`: pickletools reads length-prefixed strings with one
    read(n), and a damaged length must not allocate gigabytes."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self.f.tell())
        return self.f.read(left if n is None or n < 0 else min(n, left))

    def readline(self) -> bytes:
        return self.f.readline(max(0, self.size - self.f.tell()))

    def tell(self) -> int:
        return self.f.tell()


def _read_pickle(f, size: int, index: int) -> bytes:
    start = f.tell()
    # genops decodes every argument: never let it see more than MAX_PICKLE_BYTES.
    limit = min(size, start + MAX_PICKLE_BYTES)
    try:
        for _ in pickletools.genops(_Bounded(f, limit)):
            pass
    except (ValueError, struct.error) as e:
        if f.tell() >= size:      # the parse ran into the end of the file
            raise Corrupt(f"truncated: pickle {index + 1} of 5 is cut short") from None
        if f.tell() >= limit:
            raise Unverifiable(f"legacy torch file whose pickle {index + 1} of 5 is larger "
                               f"than the verifier reads ({MAX_PICKLE_BYTES >> 20} MiB)") \
                from None
        raise Corrupt(f"pickle {index + 1} of 5 is not a valid pickle ({e})") from None
    end = f.tell()
    f.seek(start)
    data = f.read(end - start)
    return data
